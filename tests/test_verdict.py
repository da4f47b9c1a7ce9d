"""One test per row of design §3, plus the overall rules, on synthetic arms."""


from parity.arms import BCG_NORMAL, EAGER_NORMAL
from parity.results import Repeat
from parity.verdict import EXIT_CODES, exit_code
from tests.helpers_runs import NORMAL_IDS, fixed_arms, four_arms, legacy_arms, make_arm, make_case, make_run

OTHER_IDS = (31, 32, 33, 34, 35)


def verdict_of(arms, scenario="four-arm", tol=0.25):
    run = make_run([make_case(arms, scenario=scenario, case_id="reuse/rgb-stripes/describe" if scenario == "reuse" else "rgb-stripes/describe")], logprob_tol=tol)
    return run.cases[0].verdict


def test_row1_failed_arm_is_error():
    arms = list(fixed_arms())
    arms[2] = make_arm(BCG_NORMAL, [], error="server died")
    v = verdict_of(arms)
    assert v.code == "ERROR" and "bcg_normal" in v.reason and "server died" in v.reason
    arms[2] = make_arm(BCG_NORMAL, [], error="server exited with 1\n--- log tail ---\nCUDA out of memory")
    assert verdict_of(arms).reason == "arm bcg_normal failed: server exited with 1"
    assert EXIT_CODES["ERROR"] == 4


def test_row2_missing_arm_is_incomplete():
    v = verdict_of(fixed_arms()[:2])
    assert v.code == "INCOMPLETE" and "bcg_normal" in v.reason and EXIT_CODES[v.code] == 3


def test_error_wins_over_incomplete():
    assert verdict_of([make_arm(EAGER_NORMAL, [], error="boom")]).code == "ERROR"


def test_row3_no_power():
    v = verdict_of(four_arms(NORMAL_IDS, bcg_zero=NORMAL_IDS, eager_zero=NORMAL_IDS))
    assert v.code == "INCONCLUSIVE_NO_POWER" and "eager_zero_deepstack vs eager_normal" in v.reason


def test_row4_control_diverges():
    v = verdict_of(four_arms(NORMAL_IDS, bcg_zero=OTHER_IDS))
    assert v.code == "FAIL_CONTROL_DIVERGES" and "(1, False, 0.000)" in v.reason


def test_row5_deepstack_dropped():
    v = verdict_of(legacy_arms())
    assert v.code == "FAIL_DEEPSTACK_DROPPED" and "bcg_normal vs bcg_zero_deepstack" in v.reason


def test_row6_pass():
    v = verdict_of(fixed_arms())
    assert v.code == "PASS" and "bcg_normal vs eager_normal (19, True, 0.000)" in v.reason


def test_row7_graph_diverges():
    v = verdict_of(four_arms(OTHER_IDS))
    assert v.code == "FAIL_GRAPH_DIVERGES"


def test_logprob_tolerance_decides_match():
    arms = list(fixed_arms())
    arms[2] = make_arm(BCG_NORMAL, NORMAL_IDS, logprobs=[-0.1, -0.1, -0.5, -0.1, -0.1])
    assert verdict_of(arms, tol=0.25).code == "FAIL_GRAPH_DIVERGES"
    assert verdict_of(arms, tol=0.5).code == "PASS"


def test_nondeterministic_arm_is_inconclusive_after_error_and_incomplete():
    arms = list(fixed_arms())
    arms[0] = make_arm(EAGER_NORMAL, NORMAL_IDS, repeats=[OTHER_IDS])
    v = verdict_of(arms)
    assert v.code == "INCONCLUSIVE_NONDETERMINISTIC" and EXIT_CODES[v.code] == 3
    noisy_logprob = Repeat(NORMAL_IDS, (-0.1, -0.1, -0.1, -0.1, -0.1 + 1e-3))
    arms[0] = make_arm(EAGER_NORMAL, NORMAL_IDS, repeats=[noisy_logprob])
    assert verdict_of(arms).code == "INCONCLUSIVE_NONDETERMINISTIC"
    arms[0] = make_arm(EAGER_NORMAL, NORMAL_IDS, repeats=[NORMAL_IDS])
    assert verdict_of(arms).code == "PASS"
    assert verdict_of(arms[:3]).code == "INCOMPLETE"


def test_reuse_pass_and_stale_state():
    ok = [make_arm(EAGER_NORMAL, NORMAL_IDS), make_arm(BCG_NORMAL, NORMAL_IDS)]
    assert verdict_of(ok, scenario="reuse").code == "PASS"
    stale = [make_arm(EAGER_NORMAL, NORMAL_IDS), make_arm(BCG_NORMAL, OTHER_IDS)]
    v = verdict_of(stale, scenario="reuse")
    assert v.code == "FAIL_STALE_STATE" and exit_code(v) == 1
    assert verdict_of(ok[:1], scenario="reuse").code == "INCOMPLETE"


def _case(arms, case_id):
    return make_case(arms, case_id=case_id)


def test_overall_error_then_first_fail_then_pass_then_first_case():
    error = _case([make_arm(EAGER_NORMAL, [], error="x")], "a/1")
    fail_drop = _case(legacy_arms(), "b/1")
    fail_graph = _case(four_arms(OTHER_IDS), "c/1")
    passed = _case(fixed_arms(), "d/1")
    no_power = _case(four_arms(NORMAL_IDS, bcg_zero=NORMAL_IDS, eager_zero=NORMAL_IDS), "e/1")
    incomplete = _case(fixed_arms()[:1], "f/1")
    assert make_run([passed, fail_drop, error]).verdict.code == "ERROR"
    run = make_run([passed, fail_graph, fail_drop])
    assert run.verdict.code == "FAIL_GRAPH_DIVERGES" and run.verdict.reason.startswith("c/1: ")
    assert make_run([no_power, passed]).verdict.code == "PASS"
    assert make_run([incomplete, no_power]).verdict.code == "INCOMPLETE"
    assert make_run([no_power, incomplete]).verdict.code == "INCONCLUSIVE_NO_POWER"


def test_stored_verdicts_are_ignored_when_rejudged():
    from dataclasses import replace

    from parity.results import Verdict
    from parity.verdict import judge_run

    run = make_run([make_case(legacy_arms())])
    forged = replace(run, verdict=Verdict("PASS", "forged"),
                     cases=tuple(replace(c, verdict=Verdict("PASS", "forged")) for c in run.cases))
    assert judge_run(forged).verdict.code == "FAIL_DEEPSTACK_DROPPED"
