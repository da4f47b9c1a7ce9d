"""What a results file must keep with itself (design §4, "v3 consistency").

A file edited by hand or by a script can be well typed and still describe no execution that ever
happened: an arm given another arm's tokens while its teacher-forced scores say otherwise, a replay
in a bucket smaller than its prompt, DeepStack that changes the answer of a model without
DeepStack. Each rule below reads the parsed run (requests as the file holds them, so a place names
the file's own indices) and raises `Contradiction` naming the field; `parity verdict` then exits 2
instead of re-judging a file that contradicts itself.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterator

from parity.arms import EAGER_NORMAL, EAGER_ZERO
from parity.runner.buckets import AUTO, prefill_bucket_ladder, smallest_fitting
from parity.design import forwards
from parity import registry
from parity.judge.metrics import Tolerances, compare
from parity.plan.entries import read_plan
from parity.results import (
    SCHEMA, SEQUENCE_REQUESTS, ArmResult, CaseResult, FixtureInfo, RequestSpec, RunResult,
)
from parity.judge.verdict import FOUR_ARM_CHECKS, POWER_CHECK, sequence_check

# Teacher forcing an arm on tokens it generated itself repeats the same computation in another batch
# shape (one cached pass over all tokens instead of one decode step per token; on a server a prefill
# instead of decode steps), so the scores agree up to kernel noise. Measured in float32: 2.9e-6 over
# every scenario and fixture of the tiny presets in-process, 3.1e-6 over `--scenario all --fixture
# all` on the real SGLang 0.5.23 server on the CPU (21 cases, 140 arms); in bfloat16 0.031 on the
# CPU. The float32 floor sits 32x above that, and close enough to the auto tolerance (3e-5) that an
# edited answer cannot hide much of a logprob divergence behind it; reduced precision gets SGLang's
# own bound between prefill and decode logprobs in bf16 (1.0). Copying another arm's tokens leaves
# ~3 (the upstream drop). Any dtype other than float32, or none, gets the reduced-precision floor.
FORCED_NOISE_FLOOR = {"float32": 1e-4}
REDUCED_PRECISION_FORCED_FLOOR = 1.0


@dataclass(frozen=True)
class ArmPlace:
    """Where an arm is in a run: its case's index, its request's (None in a four-arm case), its name."""

    case: int
    request: int | None
    arm: str


class Contradiction(Exception):
    """The file contradicts itself; the message names the field, and `place` the arm it is about
    (None for what no one arm wrote: `parity run` fails that arm instead of refusing its own run)."""

    def __init__(self, message: str, place: ArmPlace | None = None) -> None:
        super().__init__(message)
        self.place = place


@dataclass(frozen=True)
class _Request:
    """The arms that answered one request: a four-arm case, or one request of a sequence."""

    where: str  # JSON path of the object holding the arms
    case: CaseResult
    fixture: FixtureInfo | None
    arms: tuple[ArmResult, ...]
    case_index: int = 0
    request_index: int | None = None
    prompt: str = ""

    def at(self, arm: ArmResult) -> str:
        return f"{self.where}.{arm.name}"

    def contradiction(self, arm: ArmResult, message: str) -> Contradiction:
        return Contradiction(message, ArmPlace(self.case_index, self.request_index, arm.name))

    def arm(self, name: str) -> ArmResult | None:
        return next((a for a in self.arms if a.name == name and not a.failed), None)


def _requests(run: RunResult) -> Iterator[_Request]:
    for ci, case in enumerate(run.cases):
        if case.is_sequence and run.schema == SCHEMA:
            for ri, request in enumerate(case.requests):
                yield _Request(f"cases[{ci}].requests[{ri}].arms", case, request.fixture, request.arms, ci, ri,
                               request.prompt)
        else:  # four-arm, or a /1 reuse case whose arms are its text-only follow-up's
            fixture = case.requests[0].fixture if case.requests else case.fixture
            yield _Request(f"cases[{ci}].arms", case, fixture, case.all_arms(), ci, 0 if case.requests else None,
                           case.prompt)


def _ran(request: _Request) -> Iterator[ArmResult]:
    return (arm for arm in request.arms if not arm.failed)


def _same_prefix(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


# --- the rules, one function each ------------------------------------------------------------------

def forced_matches_own_scores(run: RunResult) -> None:
    """Where an arm's tokens equal reference r's (up to step i), `forced[r][i]` is the arm's own score.
    Not asked of an arm whose leak witness fired: the engine handed its steps stale DeepStack rows, so
    a scoring prefill and the generation saw different inputs; the arm is FAIL_STALE_STATE anyway."""
    dtype = str(run.config.get("dtype"))
    floor = FORCED_NOISE_FLOOR.get(dtype, REDUCED_PRECISION_FORCED_FLOOR)
    for request in _requests(run):
        for arm in _ran(request):
            if arm.evidence is not None and arm.evidence.leak is not None:
                continue
            for name, scores in arm.forced.items():
                reference = request.arm(name)
                for i in range(_same_prefix(arm.token_ids, reference.token_ids) if scores is not None else 0):
                    delta = abs(scores[i] - arm.token_logprobs[i])
                    if delta > floor:
                        raise request.contradiction(
                            arm, f"{request.at(arm)}.forced.{name}[{i}] is {scores[i]:.6g}, but the arm's own "
                                 f"token_logprobs[{i}] is {arm.token_logprobs[i]:.6g} for the same token after the "
                                 f"same tokens (|Δ| {delta:.3g} > {floor:g}, the {dtype} noise floor): teacher "
                                 "forcing of identical tokens gives the same scores")


def forced_scores_every_reference(run: RunResult) -> None:
    """Every arm that ran is scored teacher-forced on its own tokens and on each reference that ran
    (a null where the backend could not score exactly those tokens): a missing key is an edit that
    hides a tf delta."""
    if run.schema != SCHEMA:
        return  # a /1 file has no teacher-forced scores
    for request in _requests(run):
        for arm in _ran(request):
            wanted = [arm.name] + [ref for ref in _references(request, arm) if request.arm(ref) is not None]
            missing = [name for name in wanted if name not in arm.forced]
            if missing:
                raise request.contradiction(arm, f"{request.at(arm)}.forced lacks {missing[0]}, which the run "
                                                 "scores for every arm that ran: a missing teacher-forced score "
                                                 "is an edit")


def _references(request: _Request, arm: ArmResult) -> list[str]:
    """The arms `arm` is compared against (the second arm of each of its checks)."""
    if request.case.is_sequence:
        check = sequence_check(arm.deepstack)
        power = request.request_index == 0 and arm.name == POWER_CHECK.a
        return [check.b] if arm.name == check.a else [POWER_CHECK.b] if power else []
    return [check.b for check in FOUR_ARM_CHECKS if check.a == arm.name]


def replays_fit_their_buckets(run: RunResult) -> None:
    """A replay's bucket holds the whole prompt and is one the run captured."""
    captured = run.config.get("captured_buckets")
    for request in _requests(run):
        for arm in _ran(request):
            evidence = arm.evidence
            for bucket in evidence.buckets if evidence else ():
                where = f"{request.at(arm)}.evidence.buckets has {bucket}"
                if captured is not None and bucket not in captured:
                    raise request.contradiction(arm, f"{where}, which is not among the run's captured buckets "
                                                     f"(config.captured_buckets {captured})")
                if evidence.max_bucket is not None and bucket > evidence.max_bucket:
                    raise request.contradiction(
                        arm, f"{where}, larger than its evidence.max_bucket {evidence.max_bucket}")
                tokens = evidence.prompt_tokens
                # Only when every prefill replayed is prompt_tokens the prompt of those replays (a server
                # names the longest prefill that ran eagerly); a prompt longer than every bucket is
                # prefilled in chunks, each in its own bucket.
                chunked = evidence.serving is not None and bool(evidence.serving.chunks)  # each chunk has its own
                whole = evidence.prefill_replayed and tokens is not None and not chunked and (
                    evidence.max_bucket is None or tokens <= evidence.max_bucket)
                if whole and bucket < tokens:
                    raise request.contradiction(arm, f"{where}, smaller than its {tokens}-token prompt "
                                                     f"(evidence.prompt_tokens): a replayed prompt fits its bucket")


def evidence_matches_record(run: RunResult) -> None:
    """The tap's record of the prompt's LM entry and the evidence tell the same replay."""
    for request in _requests(run):
        for arm in _ran(request):
            record, evidence = arm.deepstack_record, arm.evidence
            if record is None or evidence is None or record.replay is None:
                continue
            if record.replay and evidence.replayed_calls == 0:
                raise request.contradiction(arm, f"{request.at(arm)}.evidence.replayed_calls is 0, but its "
                                                 "deepstack_record.replay is true")
            if not record.replay and evidence.prefill_replayed:
                raise request.contradiction(arm, f"{request.at(arm)}.evidence.prefill_replayed is true, but its "
                                                 "deepstack_record.replay is false")


def enough_lm_entries(run: RunResult) -> None:
    """A generation of n tokens is one prefill and n - 1 decode steps at least, where parity counts
    every LM entry itself (the transformers backend). A server's tap sees a decode step only where
    the step runs eagerly: decode steps replayed by the engine's decode graph never reach it."""
    if not registry.of_run(run.config).in_process:
        return
    for request in _requests(run):
        for arm in _ran(request):
            needed = max(1, len(arm.token_ids))
            if arm.evidence is not None and arm.evidence.lm_calls < needed:
                raise request.contradiction(
                    arm, f"{request.at(arm)}.evidence.lm_calls is {arm.evidence.lm_calls}, fewer than the "
                         f"prefill and {needed - 1} decode steps of its {len(arm.token_ids)} tokens")


def answers_fit_max_new_tokens(run: RunResult) -> None:
    limit = run.config.get("max_new_tokens")
    if limit is None:
        return
    for request in _requests(run):
        for arm in _ran(request):
            for where, ids in ((f"{request.at(arm)}.token_ids", arm.token_ids),
                               *((f"{request.at(arm)}.repeats[{i}].token_ids", r.token_ids)
                                 for i, r in enumerate(arm.repeats))):
                if len(ids) > limit:
                    raise request.contradiction(
                        arm, f"{where} has {len(ids)} tokens, more than config.max_new_tokens {limit}")


def one_fingerprint_per_request(run: RunResult) -> None:
    """Every arm of a request is handed the same DeepStack rows before its tap acts on them, and
    every request of one image and prompt the same rows as every other (the vision tower is
    deterministic: another fingerprint is another seed, checkpoint or dtype). A request whose
    image goes through the encoder graphs in graph mode (layout) is held to it within each mode:
    those graphs are under test, and rows that differ from eager's are what they get wrong."""
    by_input: dict[tuple, tuple[str, ArmResult]] = {}
    for request in _requests(run):
        spec = _spec(request)
        per_mode = spec is not None and spec.serving.encoder_graph
        # A server's record covers the rows of the request's first prefill with DeepStack (a chunk,
        # or what the prefix cache left): requests are compared within their serving profile.
        profile = None if spec is None else spec.serving.server_profile
        for mode in ("eager", "bcg") if per_mode else (None,):
            _one_fingerprint(request, [arm for arm in _ran(request) if arm.deepstack_record is not None
                                       and mode in (None, arm.mode)], by_input, mode or "", profile)


def _spec(request: _Request) -> RequestSpec | None:
    if request.request_index is None or not request.case.is_sequence:
        return None
    label = request.case.requests[request.request_index].label
    return next((s for s in SEQUENCE_REQUESTS.get(request.case.scenario, ()) if s.label == label), None)


def _one_fingerprint(request: _Request, recorded: list[ArmResult], by_input: dict, mode: str,
                     profile: str | None) -> None:
    for arm in recorded:
        record = arm.deepstack_record
        if record.action != arm.deepstack:
            raise request.contradiction(
                arm, f"{request.at(arm)}.deepstack_record.action is {record.action!r}, but the arm "
                     f"runs DeepStack {arm.deepstack!r}")
        first = recorded[0].deepstack_record
        seen = (record.sha256, record.shape, record.dtype, record.nonzero_rows)
        if seen != (first.sha256, first.shape, first.dtype, first.nonzero_rows):
            raise request.contradiction(
                arm, f"{request.at(arm)}.deepstack_record differs from {recorded[0].name}'s "
                     f"(sha256 {record.sha256[:12]}… vs {first.sha256[:12]}…): the arms of one request "
                     "see the same DeepStack rows before zeroing")
        if request.fixture is None or not record.nonzero_rows:
            continue
        key = (request.fixture.sha256, request.fixture.size, request.prompt, mode, profile)  # same bytes, other size: another image
        where, other = by_input.setdefault(key, (request.at(arm), arm))
        if other.deepstack_record.sha256 != record.sha256:
            theirs = other.deepstack_record.sha256
            raise request.contradiction(
                arm, f"{request.at(arm)}.deepstack_record (sha256 {record.sha256[:12]}…) differs from {where}'s "
                     f"({theirs[:12]}…) for the same image and prompt: DeepStack computed by another seed, "
                     "checkpoint or dtype")


def records_where_the_tap_fired(run: RunResult) -> None:
    """An arm whose tap saw DeepStack rows keeps their record, and an arm with a record had a tap that
    fired (v5): a record deleted or added by hand would switch the fingerprint rules off or on. On a
    server the tap also counts the arm's scoring requests, while the record is its generation's: a
    generation whose prefix-cache hit covered every visual row saw none, and has no record."""
    in_process = registry.of_run(run.config).in_process
    for request in _requests(run):
        for arm in _ran(request):
            evidence, record = arm.evidence, arm.deepstack_record
            if evidence is None:
                continue  # a /1 arm: the record is all the evidence there is
            if evidence.tap_calls and record is None and not _prefill_without_visual_rows(evidence, in_process):
                raise request.contradiction(arm, f"{request.at(arm)}.deepstack_record is null, but its tap saw "
                                                 f"DeepStack rows in {evidence.tap_calls} LM entry(ies) "
                                                 "(evidence.tap_calls): the record of what it saw is kept")
            if record is not None and not evidence.tap_calls:
                raise request.contradiction(arm, f"{request.at(arm)}.deepstack_record is set, but evidence.tap_calls "
                                                 "is 0: a tap that never fired recorded nothing")


def _prefill_without_visual_rows(evidence, in_process: bool) -> bool:
    """A server's generation whose prefix-cache hit covered every visual row: its prefill holds none,
    so its tap record has no DeepStack rows (or none at all). parity's own tap sees the whole prompt."""
    serving = evidence.serving
    return (not in_process and serving is not None and serving.image_span is not None
            and serving.cached_tokens >= serving.image_span[1])


def rows_where_deepstack_moved_the_answer(run: RunResult) -> None:
    """Where zeroing DeepStack changed a case's eager answer (its power), every record of the case's
    image requests saw non-zero DeepStack rows: zero rows cannot have moved an answer (unless the
    request's prefill computed no visual row, a server's prefix-cache hit over all of them)."""
    in_process = registry.of_run(run.config).in_process
    tolerances = Tolerances(run.logprob_tol, run.tie_margin)
    moved = {ci for ci, case in enumerate(run.cases)
             if (pair := _power_pair(case)) is not None and compare(*pair, tolerances).difference_shown}
    for request in _requests(run):
        if request.case_index not in moved or request.fixture is None:
            continue
        for arm in _ran(request):
            if (arm.deepstack_record is not None and not arm.deepstack_record.nonzero_rows
                    and not (arm.evidence is not None and _prefill_without_visual_rows(arm.evidence, in_process))):
                raise request.contradiction(
                    arm, f"{request.at(arm)}.deepstack_record has 0 non-zero rows, but zeroing DeepStack changed "
                         f"cases[{request.case_index}]'s eager answer: the rows it saw were not zero")


def power_needs_deepstack(run: RunResult) -> None:
    """DeepStack can change an answer only where there is an image and a model that consumes it."""
    layers = run.deepstack_layers  # None in /1: inferred from the records, nothing to contradict
    for request in _requests(run):
        for arm in _ran(request):
            rows = arm.deepstack_record.nonzero_rows if arm.deepstack_record else 0
            if rows and request.fixture is None:
                raise request.contradiction(
                    arm, f"{request.at(arm)}.deepstack_record has {rows} non-zero DeepStack rows, but "
                         "the request has no image")
            if rows and layers == 0:
                raise request.contradiction(
                    arm, f"{request.at(arm)}.deepstack_record has {rows} non-zero DeepStack rows, but "
                         "config.deepstack_layers is 0")
    tolerances = Tolerances(run.logprob_tol, run.tie_margin)
    for ci, case in enumerate(run.cases):
        pair = _power_pair(case)
        if pair is None or not compare(*pair, tolerances).difference_shown:
            continue
        shown = f"cases[{ci}]: {EAGER_ZERO} and {EAGER_NORMAL} answer differently (DeepStack power)"
        place = ArmPlace(ci, 0 if case.is_sequence else None, EAGER_ZERO)
        if case.fixture is None:
            raise Contradiction(f"{shown}, but the case has no image", place)
        if layers == 0:
            raise Contradiction(f"{shown}, but config.deepstack_layers is 0", place)


def _power_pair(case: CaseResult) -> tuple[ArmResult, ArmResult] | None:
    """(zeroed, normal) eager answers to the same image request, where the case has both."""
    if not case.is_sequence:
        zero, normal = case.arm(EAGER_ZERO), case.arm(EAGER_NORMAL)
    else:
        # The power request's own eager arms: the same image and prompt, DeepStack zeroed or not.
        power = next((spec.label for spec in SEQUENCE_REQUESTS.get(case.scenario, ()) if spec.power), None)
        request = next((r for r in case.requests if r.label == power), None)
        arms = {} if request is None else {a.name: a for a in request.arms}
        zero, normal = arms.get(EAGER_ZERO), arms.get(EAGER_NORMAL)
    if zero is None or normal is None or zero.failed or normal.failed:
        return None
    return zero, normal


def captured_buckets_fit_the_prompts(run: RunResult) -> None:
    """With `--buckets auto` a run captures buckets of SGLang's ladder up to its longest prompt's."""
    captured, policy = run.config.get("captured_buckets"), run.config.get("buckets")
    if not captured or policy is None:
        return
    if policy != AUTO:
        stray = [b for b in captured if b not in policy]
        if stray:
            raise Contradiction(f"config.captured_buckets has {stray[0]}, which config.buckets {policy} does not list")
        return
    ladder = prefill_bucket_ladder(max(captured))
    stray = [b for b in captured if b not in ladder]
    if stray:
        raise Contradiction(f"config.captured_buckets has {stray[0]}, which is not on the bucket ladder of "
                            "--buckets auto")
    longest = _longest_prompt(run)
    batched = _longest_batch(run)
    needed = None if longest is None or batched is None else smallest_fitting(ladder, max(longest, batched))
    if needed is not None and max(captured) > needed:
        what = (f"longest prompt ({longest} tokens)" if longest >= batched
                else f"largest batch of requests sharing a forward ({batched} tokens)")
        raise Contradiction(f"config.captured_buckets has {max(captured)}, but the run's {what} replays in bucket "
                            f"{needed}: --buckets auto captures no larger one")


def _longest_prompt(run: RunResult) -> int | None:
    """The longest prompt of the run's plan (design §4b): a shard captures for the whole plan."""
    try:
        return max(entry.prompt_tokens for entry in read_plan(run.config))
    except ValueError:
        return None  # a /1 file records no plan


def _longest_batch(run: RunResult) -> int | None:
    """The most prompt tokens of requests a batch case submits at once (their forward holds at most
    as many; the run's graphs are captured to fit them): 0 without a batch case, None when a member's
    prompt length is not recorded."""
    def tokens(request) -> int | None:
        return next((a.evidence.prompt_tokens for a in request.arms
                     if a.evidence is not None and a.evidence.prompt_tokens is not None), None)

    longest = 0
    for case in run.cases:
        specs = SEQUENCE_REQUESTS.get(case.scenario, ()) if case.is_sequence else ()
        for group in forwards(specs):
            if len(group) < 2:
                continue
            held = [tokens(case.requests[i]) if i < len(case.requests) else None for i in group]
            if None in held:
                return None
            longest = max(longest, sum(held))
    return longest


RULES: tuple[Callable[[RunResult], None], ...] = (
    forced_matches_own_scores, forced_scores_every_reference, replays_fit_their_buckets, evidence_matches_record,
    enough_lm_entries, answers_fit_max_new_tokens, records_where_the_tap_fired, one_fingerprint_per_request,
    rows_where_deepstack_moved_the_answer, power_needs_deepstack, captured_buckets_fit_the_prompts,
)


def check_consistency(run: RunResult) -> None:
    """Raise `Contradiction` for the first rule the run breaks."""
    for rule in RULES:
        rule(run)
