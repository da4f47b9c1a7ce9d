"""Verdicts (design §3): per case from its arms, overall from the cases, and their exit codes."""

from __future__ import annotations

from dataclasses import dataclass, replace

from parity.arms import BCG_NORMAL, BCG_ZERO, EAGER_NORMAL, EAGER_ZERO
from parity.metrics import compare, first_divergence
from parity.results import ArmResult, CaseResult, Comparison, RunResult, Verdict

PASS = "PASS"
ERROR = "ERROR"
INCOMPLETE = "INCOMPLETE"
INCONCLUSIVE_NO_POWER = "INCONCLUSIVE_NO_POWER"
INCONCLUSIVE_NONDETERMINISTIC = "INCONCLUSIVE_NONDETERMINISTIC"
FAIL_CONTROL_DIVERGES = "FAIL_CONTROL_DIVERGES"
FAIL_DEEPSTACK_DROPPED = "FAIL_DEEPSTACK_DROPPED"
FAIL_GRAPH_DIVERGES = "FAIL_GRAPH_DIVERGES"
FAIL_STALE_STATE = "FAIL_STALE_STATE"

EXIT_CODES = {
    PASS: 0,
    FAIL_CONTROL_DIVERGES: 1,
    FAIL_DEEPSTACK_DROPPED: 1,
    FAIL_GRAPH_DIVERGES: 1,
    FAIL_STALE_STATE: 1,
    INCOMPLETE: 3,
    INCONCLUSIVE_NO_POWER: 3,
    INCONCLUSIVE_NONDETERMINISTIC: 3,
    ERROR: 4,
}
USAGE_EXIT = 2

# An arm reproduces itself when ids are equal and logprobs agree to this (design: noise floor).
REPEAT_TOL = 1e-6


@dataclass(frozen=True)
class Check:
    """One comparison of the experiment, what a correct runtime gives, and what it tests."""

    a: str
    b: str
    expect_match: bool
    meaning: str


FOUR_ARM_CHECKS = (
    Check(BCG_NORMAL, EAGER_NORMAL, True, "graph replay preserves semantics"),
    Check(BCG_NORMAL, BCG_ZERO, False, "graph replay sees DeepStack"),
    Check(BCG_ZERO, EAGER_ZERO, True, "control: graph and eager agree with DeepStack ablated"),
    Check(EAGER_ZERO, EAGER_NORMAL, False, "power: DeepStack changes the eager answer"),
)
REUSE_CHECKS = (
    Check(BCG_NORMAL, EAGER_NORMAL, True, "a follow-up request in the same bucket answers as eager"),
)
SCENARIO_ARMS = {"four-arm": (EAGER_NORMAL, EAGER_ZERO, BCG_NORMAL, BCG_ZERO), "reuse": (EAGER_NORMAL, BCG_NORMAL)}


def checks_for(scenario: str) -> tuple[Check, ...]:
    return REUSE_CHECKS if scenario == "reuse" else FOUR_ARM_CHECKS


def self_delta(arm: ArmResult) -> tuple[bool, float]:
    """(reproduced exactly, max |Δ logprob| over the arm's repeats)."""
    same, worst = True, 0.0
    for rep in arm.repeats:
        if first_divergence(arm.token_ids, rep.token_ids) is not None:
            same = False
        n = min(len(rep.token_logprobs), len(arm.token_logprobs))
        worst = max([worst] + [abs(arm.token_logprobs[i] - rep.token_logprobs[i]) for i in range(n)])
    return same and worst <= REPEAT_TOL, worst


def _describe(c: Comparison) -> str:
    return f"{c.a} vs {c.b} {c.tuple_text}"


def comparable_pairs(case: CaseResult) -> list[tuple[ArmResult, ArmResult]]:
    """The case's comparisons, in design order, where both arms exist and did not fail."""
    arms = {arm.name: arm for arm in case.arms if not arm.failed}
    return [(arms[c.a], arms[c.b]) for c in checks_for(case.scenario) if c.a in arms and c.b in arms]


def judge_case(case: CaseResult, logprob_tol: float) -> CaseResult:
    """Recompute the case's comparisons and verdict from its arms alone."""
    needed = SCENARIO_ARMS[case.scenario]
    arms = {a.name: a for a in case.arms}
    comparisons = tuple(compare(a, b, logprob_tol) for a, b in comparable_pairs(case))
    return replace(case, comparisons=comparisons, verdict=_case_verdict(case.scenario, needed, arms, comparisons))


def _case_verdict(scenario: str, needed, arms: dict[str, ArmResult], comparisons) -> Verdict:
    failed = [n for n in needed if n in arms and arms[n].failed]
    if failed:
        first = arms[failed[0]]
        # One line: a server's log tail stays in the arm's error, shown in the report.
        return Verdict(ERROR, f"arm {first.name} failed: {first.error.strip().splitlines()[0] if first.error.strip() else 'no message'}")
    missing = [n for n in needed if n not in arms]
    if missing:
        return Verdict(INCOMPLETE, f"arm(s) not run: {', '.join(missing)}")
    deltas = {n: self_delta(arms[n]) for n in needed}
    noisy = [(n, worst) for n, (reproduced, worst) in deltas.items() if not reproduced]
    if noisy:
        name, worst = noisy[0]
        return Verdict(INCONCLUSIVE_NONDETERMINISTIC,
                       f"arm {name} does not reproduce itself (self-delta {worst:.3g} > {REPEAT_TOL:g} or ids differ)")
    by_pair = {(c.a, c.b): c for c in comparisons}
    if scenario == "reuse":
        c = by_pair[(BCG_NORMAL, EAGER_NORMAL)]
        if c.match:
            return Verdict(PASS, f"{_describe(c)}: the follow-up request answers as eager")
        return Verdict(FAIL_STALE_STATE, f"{_describe(c)}: state left by the earlier request changed the answer")
    power = by_pair[(EAGER_ZERO, EAGER_NORMAL)]
    if power.match:
        return Verdict(INCONCLUSIVE_NO_POWER,
                       f"{_describe(power)}: zeroing DeepStack does not change the eager answer, so nothing can be proven")
    control = by_pair[(BCG_ZERO, EAGER_ZERO)]
    if not control.match:
        return Verdict(FAIL_CONTROL_DIVERGES, f"{_describe(control)}: graph and eager differ even with DeepStack ablated")
    sees = by_pair[(BCG_NORMAL, BCG_ZERO)]
    if sees.match:
        return Verdict(FAIL_DEEPSTACK_DROPPED,
                       f"{_describe(sees)}: graph replay answers as if DeepStack were zero")
    same = by_pair[(BCG_NORMAL, EAGER_NORMAL)]
    if same.match:
        return Verdict(PASS, f"{_describe(same)}: graph replay answers as eager and sees DeepStack")
    return Verdict(FAIL_GRAPH_DIVERGES, f"{_describe(same)}: graph replay differs from eager")


def overall_verdict(cases: tuple[CaseResult, ...]) -> Verdict:
    if len(cases) == 1:
        return cases[0].verdict
    verdicts = [(c.id, c.verdict) for c in cases]
    for code_test in (lambda code: code == ERROR, lambda code: code.startswith("FAIL_")):
        hit = next(((cid, v) for cid, v in verdicts if code_test(v.code)), None)
        if hit:
            return _tagged(*hit, len(cases))
    passed = [cid for cid, v in verdicts if v.code == PASS]
    if passed:
        return Verdict(PASS, f"{len(passed)} of {len(cases)} case(s) passed"
                       + ("" if len(passed) == len(cases) else "; the others are inconclusive or incomplete"))
    return _tagged(*verdicts[0], len(cases))


def _tagged(case_id: str, verdict: Verdict, n_cases: int) -> Verdict:
    return verdict if n_cases == 1 else Verdict(verdict.code, f"{case_id}: {verdict.reason}")


def judge_run(run: RunResult) -> RunResult:
    cases = tuple(judge_case(c, run.logprob_tol) for c in run.cases)
    return replace(run, cases=cases, verdict=overall_verdict(cases))


def exit_code(verdict: Verdict) -> int:
    return EXIT_CODES[verdict.code]
