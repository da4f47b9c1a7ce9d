"""The plan of a run: what `parity run` asked for (`RunSpec`), and the cases, requests and arms it
expands to, with their prompt lengths, their plan entries (design §4b) and their shard.

Nothing here runs a model: a backend is asked only how long a request's prompt is and which bucket
it lands in.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Sequence

from parity.arms import MODES, RUN_ORDER, ArmSpec, arm_for
from parity.backends.protocol import Backend, Request
from parity.errors import UsageError
from parity.media.fixtures import Fixture, Prompt
from parity.plan.entries import PlanEntry, scenario_case_id, text_sha256
from parity.design import (
    CASE_IMAGE, EXTENDED_TEXT, FOUR_ARM, OTHER_TEXT, REUSE, SEQUENCE_REQUESTS, TWIN_IMAGE, WARMUP, SERVER_PROFILES, RequestSpec,
    forwards,
)
from parity.plan.sharding import Shard, assignment, case_cost
from parity.judge.verdict import SEQUENCE_POWER_ARM

# Appended to a text-only request until it lands in its image request's bucket.
_FILLER = " Answer in plain words."
_FILLER_WORD = " one"  # one token in Qwen's tokenizer and in the presets'
# The prefix scenario's follow-ups: one shares the whole first prompt, one only the image.
_EXTENSION = " Answer in one short sentence."
OTHER_QUESTION = "Which colour covers most of the picture?"


@dataclass(frozen=True)
class CaseSpec:
    fixture: Fixture
    prompt: Prompt

    @property
    def id(self) -> str:
        return f"{self.fixture.name}/{self.prompt.id}"


@dataclass(frozen=True)
class RunSpec:
    """What the run is: model, arms, cases, scenarios, and how answers are compared."""

    model: str
    arms: tuple[ArmSpec, ...]
    cases: tuple[CaseSpec, ...]
    scenarios: tuple[str, ...] = (FOUR_ARM,)
    max_new_tokens: int = 20
    logprob_tol: float | None = None  # None: auto, from the dtype's measured noise
    tie_margin: float | None = None  # None: the dtype's (metrics.auto_tolerances)
    repeat: int = 1
    localize_threshold: float | None = None  # None: auto, from the dtype's measured noise
    shard: Shard | None = None  # run only this shard's cases (design §8); None: all of them

    @property
    def modes(self) -> tuple[str, ...]:
        return tuple(m for m in MODES if any(a.mode == m for a in self.arms))


@dataclass(frozen=True)
class PlannedRequest:
    label: str
    request: Request
    deepstack: str
    power: bool = False  # also run eagerly with DeepStack zeroed: the sequence's power (design §3 v3)
    replays: bool = True  # False: planned past every captured bucket (the growth scenario's long request)
    forward: int | None = None  # batch: submitted at once with the case's other requests of this number


@dataclass(frozen=True)
class PlannedCase:
    id: str
    scenario: str
    spec: CaseSpec
    requests: tuple[PlannedRequest, ...]
    arms: tuple[ArmSpec, ...] = ()  # four-arm only: the selected arms, in run order


def plan_cases(spec: RunSpec, backend: Backend) -> tuple[PlannedCase, ...]:
    planned = []
    for scenario in spec.scenarios:
        for case in spec.cases:
            image = Request(case.fixture, case.prompt.text)
            if scenario == FOUR_ARM:
                arms = tuple(sorted(spec.arms, key=lambda a: RUN_ORDER.index(a.name)))
                requests = (PlannedRequest("image", image, "normal"),)
            else:
                arms = ()
                requests = tuple(PlannedRequest(r.label, _sequence_request(r, scenario, backend, image), r.deepstack,
                                                 power=r.power, replays=r.replays, forward=r.forward)
                                 for r in SEQUENCE_REQUESTS[scenario])
            planned.append(PlannedCase(scenario_case_id(scenario, case.id), scenario, case, requests, arms))
    planned = _past_every_bucket(planned, backend, spec.max_new_tokens)
    ids = [p.id for p in planned]
    if len(set(ids)) != len(ids):
        raise UsageError(f"two cases share an id ({', '.join(sorted({i for i in ids if ids.count(i) > 1}))})")
    return tuple(planned)


def _sequence_request(spec: RequestSpec, scenario: str, backend: Backend, image: Request) -> Request:
    if spec.image is None:
        # reuse: a shorter text request in the image's bucket; the others: exactly as long where reachable
        like = image if spec.length_of == CASE_IMAGE else Request(image.fixture.reshaped(spec.length_of), image.prompt)
        text = text_request_in_bucket(backend, like, same_length=scenario != REUSE)
        return Request(None, text.prompt, spec.serving)
    fixture = image.fixture
    if spec.image == TWIN_IMAGE:
        fixture = fixture.twin()
    elif spec.image != CASE_IMAGE:
        fixture = fixture.reshaped(spec.image)
    prompt = {EXTENDED_TEXT: image.prompt + _EXTENSION, OTHER_TEXT: OTHER_QUESTION}.get(spec.text, image.prompt)
    return Request(fixture, prompt, spec.serving)  # a LONG_TEXT one is lengthened once the plan is whole


def _past_every_bucket(planned: Sequence[PlannedCase], backend: Backend, new_tokens: int) -> tuple[PlannedCase, ...]:
    """The growth scenario's long requests lengthened with filler until their prompts are longer
    than the bucket of every request that replays, its scoring prefills (the prompt and up to
    `new_tokens` more) included, and of every batch's forward: with `--buckets auto`, past every
    bucket the run captures, so the DeepStack buffer sized for those must grow."""
    if all(r.replays for c in planned for r in c.requests):
        return tuple(planned)
    buckets = [backend.bucket_of(backend.prompt_length(r.request) + new_tokens)
               for c in planned for r in c.requests if r.replays]
    # A batch's requests share a forward: the graphs are captured for all of them at once.
    buckets += [backend.bucket_of(sum(backend.prompt_length(c.requests[i].request) for i in group))
                for c in planned for group in forwards(c.requests) if len(group) > 1]
    largest = max((b for b in buckets if b is not None), default=None)
    out = []
    for case in planned:
        requests = list(case.requests)
        for i, req in enumerate(requests):
            if not req.replays and largest is not None:
                text = req.request.prompt
                while backend.prompt_length(replace(req.request, prompt=text)) <= largest:
                    text += _FILLER
                requests[i] = replace(req, request=replace(req.request, prompt=text))
        out.append(replace(case, requests=tuple(requests)))
    return tuple(out)


def replayed_lengths(planned: Sequence[PlannedCase], lengths: dict[str, list[int]]) -> list[int]:
    """The prefill lengths a run's graphs must fit: every request's that replays, and every batch's
    requests together (their forward holds them all, at most)."""
    out = []
    for case in planned:
        n = lengths[case.id]
        out += [length for req, length in zip(case.requests, n) if req.replays]
        out += [sum(n[i] for i in group) for group in forwards(case.requests) if len(group) > 1]
    return out


def serving_order(planned: Sequence[PlannedCase]) -> list[PlannedCase]:
    """The order a session serves the cases in: grouped by the server profile their requests need
    (`design.Serving.server_profile`), so a server engine starts one server per profile and mode,
    and a warm-up case first of its group (a graph server warms up before any image); otherwise
    in plan order."""
    def key(case: PlannedCase) -> tuple[int, bool]:
        profile = case.requests[0].request.serving.server_profile
        return SERVER_PROFILES.index(profile), case.scenario != WARMUP

    return sorted(planned, key=key)


def planned_arm_runs(spec: RunSpec) -> int:
    """How many generations the plan makes (repeats included), known before a model loads."""
    arms = [a.name for a in spec.arms]
    return sum(case_cost(scenario, arms) for scenario in spec.scenarios) * len(spec.cases) * spec.repeat


def text_request_in_bucket(backend: Backend, image: Request, same_length: bool) -> Request:
    """The image request's prompt without the image, lengthened with filler until it lands in the
    image request's bucket: shorter than it (reuse), or exactly as long where reachable (stream),
    so a stale DeepStack slot has rows to leak into."""
    limit = backend.prompt_length(image)
    target = backend.bucket_of(limit)
    text = image.prompt
    if target is None:
        return Request(None, text)
    longest = limit if same_length else limit - 1
    for filler in (_FILLER, _FILLER_WORD):  # coarse steps first, then one word at a time
        length = backend.prompt_length(Request(None, text))
        while not (backend.bucket_of(length) == target and (not same_length or length == limit)):
            longer = backend.prompt_length(Request(None, text + filler))
            if longer > longest or longer <= length:
                break
            text, length = text + filler, longer
    return Request(None, text)


def check_lengths(spec: RunSpec, backend: Backend, planned: Sequence[PlannedCase]) -> dict[str, list[int]]:
    """Case id -> the prompt length of each of its requests; a request past the context is refused."""
    lengths: dict[str, list[int]] = {}
    for case in planned:
        for req in case.requests:
            length = backend.prompt_length(req.request)
            limit = backend.max_positions
            if limit is not None and length + spec.max_new_tokens > limit:
                raise UsageError(
                    f"case {case.id}: a prompt of {length} tokens plus --max-new-tokens {spec.max_new_tokens} "
                    f"exceeds the model's context of {limit} positions; use a shorter prompt or fewer new tokens")
            lengths.setdefault(case.id, []).append(length)
    return lengths


def plan_entry(case: PlannedCase, lengths: Sequence[int]) -> PlanEntry:
    fixture = case.spec.fixture
    return PlanEntry(case.id, case.scenario, None if fixture is None else fixture.sha256,
                     text_sha256(case.spec.prompt.text), max(lengths))


def generations(spec: RunSpec, case: PlannedCase) -> int:
    """What a case costs: its generations over every request and mode (sharding's cost, the
    progress total)."""
    return case_cost(case.scenario, [a.name for a in spec.arms])


def shard_assignment(spec: RunSpec, plan: Sequence[PlanEntry]) -> dict[str, int]:
    """Case id -> shard, in plan order: a pure function of the plan (plan.assignment)."""
    return assignment(plan, [a.name for a in spec.arms], spec.shard.count)


def in_shard(spec: RunSpec, planned: Sequence[PlannedCase], plan: Sequence[PlanEntry]) -> tuple[PlannedCase, ...]:
    if spec.shard is None:
        return tuple(planned)
    assigned = shard_assignment(spec, plan)
    return tuple(case for case in planned if assigned[case.id] == spec.shard.index)


def arms_for(case: PlannedCase, mode: str, req: PlannedRequest) -> list[str]:
    if case.scenario == FOUR_ARM:
        return [a.name for a in case.arms if a.mode == mode]
    arm = arm_for(mode, req.deepstack).name
    return [arm, SEQUENCE_POWER_ARM] if req.power and mode == "eager" else [arm]
