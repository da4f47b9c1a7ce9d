"""Runner bugs parity was never shown before (tests/mutants.py): each must be caught, none may PASS."""

import pytest

from parity.backends.transformers_backend import TransformersBackend
from parity.runner.graph_runner import PrefillGraphRunner
from parity.results import SCENARIOS
from parity.design import CORE_SCENARIOS
from tests.library_runs import library_run as _run
from tests.mutants import (
    EagerPathReplays, NeverReplays, NudgesEveryReplay, RefreshesAfterReplay, ReplaysInTheLargestBucket,
    ReplaysOnlyTheFirstPrefill, SkipsCopyWhenShapeRepeats,
)


@pytest.mark.parametrize("preset", ["tiny", "tiny_moe"])
@pytest.mark.parametrize("runner_class", [SkipsCopyWhenShapeRepeats, RefreshesAfterReplay])
def test_state_bugs_are_caught_by_scenario_all(request, preset, runner_class):
    run = _run(request.getfixturevalue(preset), runner_class, scenarios=SCENARIOS)
    verdicts = {case.scenario: case.verdict.code for case in run.cases}
    # Stale state, or, where the slot a request reads was left empty by the request before it, a drop
    # on the sequence's first request (nothing before it in the sequence, so not "stale state").
    assert verdicts["stream"] in ("FAIL_STALE_STATE", "FAIL_DEEPSTACK_DROPPED"), verdicts
    assert run.verdict.code.startswith("FAIL_")
    # The correct runner passes the very same plan: the failure is the bug's, not the plan's.
    assert _run(request.getfixturevalue(preset), scenarios=SCENARIOS).verdict.code == "PASS"


@pytest.mark.parametrize("runner_class, backend_class, repeat", [
    (NeverReplays, TransformersBackend, 1),
    (ReplaysOnlyTheFirstPrefill, TransformersBackend, 1),
    (ReplaysOnlyTheFirstPrefill, TransformersBackend, 2),  # the repeat of the replayed arm runs eager
    (PrefillGraphRunner, EagerPathReplays, 1),
])
@pytest.mark.parametrize("scenarios", [("four-arm",), SCENARIOS])
def test_a_path_that_did_not_run_as_labelled_never_passes(tiny, runner_class, backend_class, repeat, scenarios):
    run = _run(tiny, runner_class, backend_class, scenarios=scenarios, repeat=repeat)
    assert run.verdict.code == "INCONCLUSIVE_NOT_REPLAYED", run.verdict


@pytest.mark.parametrize("dtype_preset", ["tiny", "tiny_moe"])
def test_a_replay_nudged_by_1e4_fails_in_fp32(request, dtype_preset):
    """Every logprob moves by about 1e-4 and no token changes: fp32's tolerance sits where its noise
    is (docs/verdicts.md), so this is a FAIL, where the v2 tolerance of 1e-3 passed it."""
    run = _run(request.getfixturevalue(dtype_preset), NudgesEveryReplay)
    assert run.verdict.code.startswith("FAIL_"), run.verdict  # the freshness witness names the slot first
    graph_vs_eager = [c for c in run.cases[0].comparisons if c.a.startswith("bcg") and c.b.startswith("eager")]
    assert all(c.token_match for c in graph_vs_eager) and not any(c.match for c in graph_vs_eager)


@pytest.mark.parametrize("scenarios", [("four-arm",), CORE_SCENARIOS])
def test_a_replay_in_another_bucket_than_the_policy_is_an_error(tiny, scenarios):
    """Answers are right (padding is inert), but the runner chose the wrong bucket: a bug in choosing
    among buckets, which the evidence shows once the ladder is captured as a server has it."""
    run = _run(tiny, ReplaysInTheLargestBucket, scenarios=scenarios, fixtures=("quadrants", "mosaic"))
    assert run.verdict.code == "ERROR", run.verdict
    assert "in bucket 96, but the bucket policy assigns bucket 32" in run.verdict.reason
    # The same plan on the correct runner replays each prompt in its own bucket and passes.
    assert _run(tiny, scenarios=scenarios, fixtures=("quadrants", "mosaic")).verdict.code == "PASS"
