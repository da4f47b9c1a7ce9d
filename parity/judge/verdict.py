"""Verdicts (design §3): per case from its arms, overall from the cases, and their exit codes.

The rules are applied in table order by `_case_verdict`; each may only rest on what the arms
recorded as they ran. A PASS needs evidence that the graph path ran (rule 4) and that the tap
fired (rule 1b); missing evidence is never read as "fine".
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Iterator, Mapping

from parity.arms import Mode, arm_for
from parity.design import (  # noqa: F401  (the comparisons, as verdict readers import them)
    BCG_NORMAL, BCG_ZERO, EAGER_NORMAL, EAGER_ZERO, FOUR_ARM_CHECKS, FOUR_ARMS, POWER_CHECK, SEQUENCE_POWER_ARM,
    SEQUENCE_REQUESTS, Check, RequestSpec, power_request,
)
from parity import registry
from parity.judge.evidence_rules import Rules, bucket_fault, not_replayed_reason, path_not_reached, runs_of, tap_fired
from parity.judge.metrics import NOISE_FLOOR, compare, first_divergence, tuple_text
from parity.evidence import InputFreshness
from parity.results import SCHEMA_V1, ArmResult, CaseResult, Comparison, FixtureInfo, RunResult, Verdict
from parity.plan.sharding import unmerged_note

PASS = "PASS"
ERROR = "ERROR"
INCOMPLETE = "INCOMPLETE"
INCONCLUSIVE_NO_POWER = "INCONCLUSIVE_NO_POWER"
INCONCLUSIVE_NONDETERMINISTIC = "INCONCLUSIVE_NONDETERMINISTIC"
INCONCLUSIVE_NOT_REPLAYED = "INCONCLUSIVE_NOT_REPLAYED"
INCONCLUSIVE_UNVERIFIED = "INCONCLUSIVE_UNVERIFIED"
FAIL_CONTROL_DIVERGES = "FAIL_CONTROL_DIVERGES"
FAIL_DEEPSTACK_DROPPED = "FAIL_DEEPSTACK_DROPPED"
FAIL_GRAPH_DIVERGES = "FAIL_GRAPH_DIVERGES"
FAIL_STALE_STATE = "FAIL_STALE_STATE"
FAIL_INPUT_NOT_FRESH = "FAIL_INPUT_NOT_FRESH"

EXIT_CODES = {
    PASS: 0,
    FAIL_CONTROL_DIVERGES: 1,
    FAIL_DEEPSTACK_DROPPED: 1,
    FAIL_GRAPH_DIVERGES: 1,
    FAIL_STALE_STATE: 1,
    FAIL_INPUT_NOT_FRESH: 1,
    INCOMPLETE: 3,
    INCONCLUSIVE_NO_POWER: 3,
    INCONCLUSIVE_NONDETERMINISTIC: 3,
    INCONCLUSIVE_NOT_REPLAYED: 3,
    INCONCLUSIVE_UNVERIFIED: 3,
    ERROR: 4,
}
USAGE_EXIT = 2
# Verdicts that say the set-up could not be trusted: a PASS in another case does not hide them.
SETUP_FAULTS = (INCOMPLETE, INCONCLUSIVE_NONDETERMINISTIC, INCONCLUSIVE_NOT_REPLAYED)

# An arm reproduces itself when ids are equal and logprobs agree to this: the noise floor of a
# correct replay on any x86 CPU (metrics.NOISE_FLOOR), not bit equality.
REPEAT_TOL = NOISE_FLOOR
# The runner variant that leaves the DeepStack slot uncleared between requests (graph_runner.py).
NO_CLEAR_RUNNER = "no-clear"


@dataclass(frozen=True)
class Group:
    """Arms that answered one request: the four arms of a case, or one request of a sequence."""

    request: int | None
    label: str | None
    fixture: FixtureInfo | None
    arms: Mapping[str, ArmResult]
    needed: tuple[str, ...]
    checks: tuple[Check, ...]

    def where(self, n_requests: int) -> str:
        return "" if self.request is None else f"request {self.request + 1} of {n_requests} ({self.label}): "


def sequence_check(deepstack: str) -> Check:
    return Check(arm_for(Mode.BCG, deepstack).name, arm_for(Mode.EAGER, deepstack).name, True,
                 "the graph sequence answers as the eager one")


def groups(case: CaseResult) -> tuple[Group, ...]:
    if not case.is_sequence:
        return (Group(None, None, case.fixture, {a.name: a for a in case.arms}, FOUR_ARMS, FOUR_ARM_CHECKS),)
    out = []
    power = power_request(case.scenario)
    for i, request in enumerate(case.requests):
        check = sequence_check(request.deepstack)
        needed, checks = (check.b, check.a), (check,)
        if i == power:  # the sequence's power arm (design §3 v3)
            needed, checks = needed + (SEQUENCE_POWER_ARM,), checks + (POWER_CHECK,)
        out.append(Group(i, request.label, request.fixture, {a.name: a for a in request.arms}, needed, checks))
    return tuple(out)


def request_spec(case: CaseResult, group: Group) -> RequestSpec | None:
    """What the scenario's design says of the group's request (None for a four-arm case)."""
    return next((s for s in SEQUENCE_REQUESTS.get(case.scenario, ()) if s.label == group.label), None)


def checks_for(case: CaseResult) -> Iterator[tuple[Group, Check]]:
    for group in groups(case):
        for check in group.checks:
            yield group, check


def comparable_pairs(case: CaseResult) -> list[tuple[int | None, ArmResult, ArmResult]]:
    """(request, a, reference) for every check whose two arms exist and did not fail, in design order."""
    pairs = []
    for group, check in checks_for(case):
        a, b = group.arms.get(check.a), group.arms.get(check.b)
        if a is not None and b is not None and not a.failed and not b.failed:
            pairs.append((group.request, a, b))
    return pairs


def _consumes_deepstack(case: CaseResult, rules: Rules) -> bool:
    if rules.deepstack_layers is not None:
        return rules.deepstack_layers > 0
    # /1: the model is shown to consume DeepStack when some arm's tap saw non-zero rows.
    return any(tap_fired(arm) for arm in case.all_arms() if not arm.failed)


# --- judging -------------------------------------------------------------------------------------

def self_delta(arm: ArmResult) -> tuple[bool, float]:
    """(reproduced exactly, max |Δ logprob| over the arm's repeats)."""
    same, worst = True, 0.0
    for rep in arm.repeats:
        if first_divergence(arm.token_ids, rep.token_ids) is not None:
            same = False
        n = min(len(rep.token_logprobs), len(arm.token_logprobs))
        worst = max([worst] + [abs(arm.token_logprobs[i] - rep.token_logprobs[i]) for i in range(n)])
    return same and worst <= REPEAT_TOL, worst


def judge_case(case: CaseResult, rules: Rules) -> CaseResult:
    """Recompute the case's comparisons and verdict from its arms alone."""
    comparisons = tuple(compare(a, b, rules.tolerances, request) for request, a, b in comparable_pairs(case))
    return replace(case, comparisons=comparisons, verdict=_case_verdict(case, comparisons, rules))


def _case_verdict(case: CaseResult, comparisons: tuple[Comparison, ...], rules: Rules) -> Verdict:
    if case.absent:
        return Verdict(INCOMPLETE, "a planned case (config.plan) the file does not hold: it never ran here, or was "
                                   "removed from the file")
    all_groups = groups(case)
    n = len(case.requests)
    tol = rules.tolerances.logprob_tol
    present = [(g, g.arms[name]) for g in all_groups for name in g.needed if name in g.arms]
    for group, arm in present:  # rule 1
        if arm.failed:
            first_line = next((ln for ln in arm.error.strip().splitlines()), "no message")
            # The engine's own record that a graph read rows not written for its request explains a
            # failed arm (a stale input breaks its answers' agreement with their scores): it is the finding.
            witnessed = _freshness_verdict(all_groups, n)
            if witnessed is not None:
                return Verdict(witnessed.code, f"{witnessed.reason}; {group.where(n)}arm {arm.name} failed as well: "
                                               f"{first_line}")
            return Verdict(ERROR, f"{group.where(n)}arm {arm.name} failed: {first_line}")
    if _consumes_deepstack(case, rules):  # rule 1b
        for group, arm in present:
            if group.fixture is not None and not tap_fired(arm):
                return Verdict(ERROR, f"{group.where(n)}arm {arm.name} shows no tap call at its LM entry for an "
                                      "image request: the DeepStack ablation cannot be trusted")
    for group, arm in present:  # rule 1c: a replay outside the bucket policy is a runner fault
        for label, evidence, _ in runs_of(arm):
            fault = bucket_fault(label, evidence, rules)
            if fault:
                return Verdict(ERROR, f"{group.where(n)}{fault}")
    for group in all_groups:  # rule 2
        missing = [name for name in group.needed if name not in group.arms]
        if missing:
            return Verdict(INCOMPLETE, f"{group.where(n)}arm(s) not run: {', '.join(missing)}")
    for group, arm in present:  # rule 2, --repeat: a stop mid-arm keeps the repeats that finished
        if len(arm.repeats) < rules.repeat - 1:
            return Verdict(INCOMPLETE, f"{group.where(n)}arm {arm.name} ran {len(arm.repeats) + 1} of its "
                                       f"{rules.repeat} runs (--repeat {rules.repeat})")
    # Rule 4 before rule 3, per run: a repeat that took another path did not "fail to reproduce".
    for group, arm in present:
        spec = request_spec(case, group)
        if spec is not None and not spec.replays and arm.mode == "bcg":
            continue  # planned past every bucket: its proof is the path it reached (below)
        for label, evidence, shown in runs_of(arm):
            reason = not_replayed_reason(label, arm, evidence, shown, rules)
            if reason:
                return Verdict(INCONCLUSIVE_NOT_REPLAYED, group.where(n) + reason)
    for group, arm in present:  # rule 3
        reproduced, worst = self_delta(arm)
        if not reproduced:
            return Verdict(INCONCLUSIVE_NONDETERMINISTIC,
                           f"{group.where(n)}arm {arm.name} does not reproduce itself "
                           f"(self-delta {worst:.3g} > {REPEAT_TOL:g} or ids differ)")
    # A graph that read rows not written for its request never passes, whatever the answers.
    witnessed = _freshness_verdict(all_groups, n) or _leak_verdict(all_groups, n)
    if witnessed is not None:
        return witnessed
    by_key = {(c.a, c.b, c.request): c for c in comparisons}
    if case.is_sequence:
        return _sequence_verdict(case, all_groups, by_key, n, rules)
    verdict = _four_arm_verdict(by_key, tol)
    if verdict.code == PASS and rules.runner == NO_CLEAR_RUNNER:
        verdict = Verdict(PASS, f"{verdict.reason}; note: --runner no-clear leaks state only from one request "
                                "into the next, which a four-arm case never reaches (--scenario reuse, stream or "
                                "all reaches it)")
    return verdict


def _path_verdict(case: CaseResult, all_groups: tuple[Group, ...], n: int, backend: str) -> Verdict | None:
    """INCONCLUSIVE_NOT_REPLAYED when a request's graph arm does not show the serving path its
    scenario is about (design §10): what never ran cannot pass. Where the engine has no such path
    to configure, the reason says so."""
    cannot = registry.info(backend).unreachable
    earlier = None
    for group in all_groups:
        spec = request_spec(case, group)
        arm = group.arms.get(group.checks[0].a)  # the graph arm
        if spec is None or spec.proves is None or arm is None:
            continue
        for label, evidence, _ in runs_of(arm):
            why = path_not_reached(spec.proves, evidence, earlier, cannot.get(spec.proves))
            if why:
                return Verdict(INCONCLUSIVE_NOT_REPLAYED,
                               f"{group.where(n)}{label} did not reach the {case.scenario} scenario's path "
                               f"({spec.proves}): {why}; so it was not tested")
        earlier = arm.evidence
    return None


def _freshness_verdict(all_groups: tuple[Group, ...], n: int) -> Verdict | None:
    """The freshness witness (design §6): a replay that read rows of an input an earlier request left
    is FAIL_STALE_STATE; rows this request should have written and did not (or wrote wrong) are a
    drop: FAIL_DEEPSTACK_DROPPED for DeepStack, FAIL_INPUT_NOT_FRESH naming any other input."""
    for group in all_groups:
        for name in group.needed:
            arm = group.arms.get(name)
            for record in () if arm is None or arm.evidence is None else arm.evidence.freshness:
                if record.fresh:
                    continue
                rows = ", ".join(map(str, record.first)) + (", ..." if record.offending > len(record.first) else "")
                rows += _whose_rows(arm, all_groups, record)
                where = f"{group.where(n)}arm {arm.name}: the {record.graph} graph read {record.input} rows "
                poison = (f"; {record.poisoned} of them still held the poison sentinel after its refresh"
                          if record.poisoned else "")
                if record.stale:
                    source = _source(group, all_groups, record.left_by)
                    return Verdict(FAIL_STALE_STATE, f"{where}[{rows}] that {source} left ({record.stale} stale "
                                                     f"row(s) in {record.replays} replay(s){poison}; "
                                                     "freshness witness)")
                how = "; ".join(part for part in (
                    f"{record.unwritten} never written for it" if record.unwritten else "",
                    f"{record.miswritten} written with other values than it supplies" if record.miswritten else "")
                    if part)
                code = FAIL_DEEPSTACK_DROPPED if record.input == "deepstack" else FAIL_INPUT_NOT_FRESH
                if not record.offending:  # the poison alone saw it: a write the witness took for this one's
                    return Verdict(code, f"{where}that still held the poison sentinel after its request's refresh "
                                         f"({record.poisoned} row(s) in {record.replays} replay(s); --poison)")
                return Verdict(code, f"{where}[{rows}] that are not its request's: {how} ({record.replays} "
                                     f"replay(s){poison}; freshness witness)")
    return None


def _whose_rows(arm: ArmResult, all_groups: tuple[Group, ...], record: InputFreshness) -> str:
    """In a forward requests shared, whose rows the first offending row is ("" outside a batch)."""
    batch = None if arm.evidence is None or arm.evidence.serving is None else arm.evidence.serving.batch
    if batch is None or not record.first:
        return ""
    row = record.first[0]
    for group in all_groups:
        other = group.arms.get(arm.name)
        serving = None if other is None or other.evidence is None else other.evidence.serving
        mine = None if serving is None else serving.batch
        if mine is not None and mine.forward == batch.forward and mine.start <= row < mine.end:
            return f"; from row {row}: request {group.request + 1}'s rows ({group.label}) in forward {batch.forward}"
    return f"; from row {row}: forward {batch.forward}'s padding"


def _source(group: Group, all_groups: tuple[Group, ...], sha256: str | None) -> str:
    """The request that left rows, named from the image its request carried (`sha256`)."""
    same = [g for g in all_groups if g.request is not None and g.fixture is not None and g.fixture.sha256 == sha256]
    earlier = [g for g in same if g.request < (group.request or 0)]
    later = [g for g in same if g.request > (group.request or 0)]
    if earlier:
        return f"request {earlier[-1].request + 1} ({earlier[-1].label})"
    if group.fixture is not None and group.fixture.sha256 == sha256:
        # A four-arm case's arms serve the same image one after the other on one engine.
        return "its own earlier steps" if group.request is not None else "another arm's request of this case"
    if later:  # a sequence is scored after all its requests ran
        return f"request {later[0].request + 1} ({later[0].label}), served before this one was scored"
    if sha256 is None:
        return "an earlier text-only request"
    return f"an earlier request (image {sha256[:12]})"


def _leak_verdict(all_groups: tuple[Group, ...], n: int) -> Verdict | None:
    """FAIL_STALE_STATE when an arm's leak witness fired: the engine handed a request DeepStack
    rows an earlier request left in its buffer, whatever the answers then were."""
    for group in all_groups:
        for name in group.needed:
            arm = group.arms.get(name)
            leak = None if arm is None or arm.evidence is None else arm.evidence.leak
            if leak is None:
                continue
            source = _source(group, all_groups, leak.source_sha256) if leak.source_sha256 else "an earlier request"
            return Verdict(FAIL_STALE_STATE,
                           f"{group.where(n)}arm {arm.name} received {leak.rows} DeepStack row(s) left in the engine's "
                           f"buffer by {source}, in {leak.steps} step(s) (leak witness: the rows were never cleared)")
    return None


def _describe(c: Comparison, tol: float) -> str:
    departure = "" if c.replay_departure is None else f" ({c.replay_departure})"
    return f"{c.a} vs {c.b} {tuple_text(c, tol)}{departure}"


def _four_arm_verdict(by_key: Mapping, tol: float) -> Verdict:
    power = by_key[(EAGER_ZERO, EAGER_NORMAL, None)]
    if not power.difference_shown:  # rule 5
        return Verdict(INCONCLUSIVE_NO_POWER,
                       f"{_describe(power, tol)}: zeroing DeepStack does not change the eager answer, "
                       "so nothing can be proven")
    control = by_key[(BCG_ZERO, EAGER_ZERO, None)]
    if not control.match:  # rule 6
        return Verdict(FAIL_CONTROL_DIVERGES,
                       f"{_describe(control, tol)}: graph and eager differ even with DeepStack ablated")
    sees = by_key[(BCG_NORMAL, BCG_ZERO, None)]
    if not sees.difference_shown:  # rule 7
        return Verdict(FAIL_DEEPSTACK_DROPPED,
                       f"{_describe(sees, tol)}: graph replay answers as if DeepStack were zero")
    same = by_key[(BCG_NORMAL, EAGER_NORMAL, None)]
    if same.match:  # rule 8
        return Verdict(PASS, f"{_describe(same, tol)}: graph replay answers as eager and sees DeepStack")
    return Verdict(FAIL_GRAPH_DIVERGES, f"{_describe(same, tol)}: graph replay differs from eager")  # rule 9


def _sequence_verdict(case: CaseResult, all_groups: tuple[Group, ...], by_key: Mapping, n: int,
                      rules: Rules) -> Verdict:
    tolerances = rules.tolerances
    tol = tolerances.logprob_tol
    power_group = all_groups[power_request(case.scenario)]
    power = by_key[(POWER_CHECK.a, POWER_CHECK.b, power_group.request)]
    if not power.difference_shown:  # rule 5: the sequence cannot show that DeepStack reached the graph at all
        return Verdict(INCONCLUSIVE_NO_POWER,
                       f"{power_group.where(n)}{_describe(power, tol)}: zeroing DeepStack does not change the eager "
                       "answer to the sequence's image request, so the sequence proves nothing about DeepStack")
    reached = _path_verdict(case, all_groups, n, rules.backend)  # rule 5b: a family scenario must reach its path
    if reached is not None:
        return reached
    for group in all_groups:
        check = group.checks[0]
        c = by_key[(check.a, check.b, group.request)]
        if c.match:
            continue
        if group is power_group:
            dropped = compare(group.arms[check.a], group.arms[SEQUENCE_POWER_ARM], tolerances, group.request)
            if not dropped.difference_shown:
                which = "first request" if group is all_groups[0] else "first image request"
                return Verdict(FAIL_DEEPSTACK_DROPPED,
                               f"{group.where(n)}{c.a} vs {SEQUENCE_POWER_ARM} {tuple_text(dropped, tol)}: the graph "
                               f"answers the {case.scenario} sequence's {which} as if DeepStack were zero")
        spec = request_spec(case, group)
        if spec is not None and spec.proves is not None:
            return Verdict(FAIL_GRAPH_DIVERGES,
                           f"{group.where(n)}{_describe(c, tol)}: graph replay differs from eager on a request that "
                           f"reached the {case.scenario} scenario's path ({spec.proves})")
        if group is not all_groups[0]:
            return Verdict(FAIL_STALE_STATE,
                           f"{group.where(n)}{_describe(c, tol)}: after the requests before it, the graph "
                           "sequence answers differently from the eager one")
        # Nothing ran before the first request: no state can be stale.
        return Verdict(FAIL_GRAPH_DIVERGES,
                       f"{group.where(n)}{_describe(c, tol)}: graph replay differs from eager on the sequence's "
                       "first request, before any state could go stale")
    return Verdict(PASS, f"all {n} requests of the graph sequence answer as the eager sequence")


def overall_verdict(cases: tuple[CaseResult, ...]) -> Verdict:
    if len(cases) == 1:
        return cases[0].verdict
    verdicts = [(c.id, c.verdict) for c in cases]
    for wanted in (lambda code: code == ERROR, lambda code: code.startswith("FAIL_"),
                   lambda code: code in SETUP_FAULTS):
        hit = next(((cid, v) for cid, v in verdicts if wanted(v.code)), None)
        if hit:
            return Verdict(hit[1].code, f"{hit[0]}: {hit[1].reason}")
    passed = sum(v.code == PASS for _, v in verdicts)
    if passed:
        no_power = sum(v.code == INCONCLUSIVE_NO_POWER for _, v in verdicts)
        rest = f"; {no_power} without power (DeepStack did not change the eager answer)" if no_power else ""
        return Verdict(PASS, f"{passed} of {len(cases)} case(s) passed{rest}")
    case_id, first = verdicts[0]
    return Verdict(first.code, f"{case_id}: {first.reason}")


class NotJudged(ValueError):
    """A renderer was handed a run nobody judged: renderers show verdicts, only loading judges."""


def judged(run: RunResult) -> RunResult:
    """`run`, which must already be judged (`judge_run`): renderers take judged runs and never judge
    again, so a report cannot disagree with the verdict the run or the loader gave (design §3)."""
    if run.verdict is None or any(case.verdict is None for case in run.cases):
        raise NotJudged("a report was asked of a run that was not judged; judge_run() it where it is loaded")
    return run


def judge_run(run: RunResult) -> RunResult:
    if run.before_run is not None:  # nothing ran: the loader recomputed this verdict where it could
        return replace(run, verdict=run.before_run)
    rules = Rules.of(run)
    cases = tuple(judge_case(c, rules) for c in run.cases)
    verdict = overall_verdict(cases)
    if run.interrupted and verdict.code == PASS:  # what never ran cannot pass
        verdict = Verdict(INCOMPLETE, f"interrupted before the run finished ({verdict.reason})")
    unmerged = unmerged_note(run.config)  # a merge told to go without a shard: at best INCOMPLETE
    if unmerged and verdict.code in (PASS, INCONCLUSIVE_NO_POWER):
        verdict = Verdict(INCOMPLETE, f"{unmerged} ({verdict.reason})")
    if run.schema == SCHEMA_V1 and verdict.code == PASS:  # design §4b: never a PASS on an unchecked rule
        verdict = Verdict(INCONCLUSIVE_UNVERIFIED, f"a {SCHEMA_V1} file records no plan, so whether every planned "
                                                   f"case is in it cannot be checked ({verdict.reason})")
    return replace(run, cases=cases, verdict=verdict)


def exit_code(verdict: Verdict) -> int:
    return EXIT_CODES[verdict.code]
