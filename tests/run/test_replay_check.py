"""The graph path against eager on the very shape it replayed (design §6): bf16 with fp32's power.

A correct replay computes what an eager pass over its own padded inputs computes, within what that
eager pass's own repeats show (0 where the kernels are deterministic): in every dtype, every
scenario, the fixed runner never departs. Every planted runner bug departs, and is judged in bf16 and
fp16 exactly as in fp32; a bug whose answers move less than bf16's tolerance (which the token-level
comparison must excuse) is a FAIL too.
"""

from dataclasses import replace

import pytest

from parity.judge.metrics import auto_tolerances, compare
from parity.models import load_model
from parity.results import SCENARIOS
from parity.runner.graph_runner import PrefillGraphRunner, RunnerVariant
from tests.library_runs import library_run
from tests.mutants import NudgesEveryReplayInBf16, RefreshesAfterReplay, SkipsCopyWhenShapeRepeats

_LOADED = {}


def loaded(preset: str, dtype: str):
    """Each preset and dtype built once per test run."""
    if (preset, dtype) not in _LOADED:
        _LOADED[preset, dtype] = load_model(preset, device="cpu", dtype=dtype)
    return _LOADED[preset, dtype]


def _checks(run):
    """The replay checks of every graph arm that replayed (growth's long request runs eager)."""
    found = [arm for case in run.cases for arm in case.all_arms() if arm.mode == "bcg" and arm.evidence is not None]
    assert all((a.evidence.replay_check is not None) == (a.evidence.replayed_calls > 0) for a in found)
    return [a.evidence.replay_check for a in found if a.evidence.replay_check is not None]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("preset", ["tiny-qwen3-vl", "tiny-qwen3-vl-moe"])
def test_a_correct_replay_equals_eager_on_its_own_shape_in_every_scenario(preset, dtype):
    run = library_run(loaded(preset, dtype), scenarios=SCENARIOS, fixtures=("quadrants",))
    checks = _checks(run)
    assert run.verdict.code == "PASS", run.verdict
    assert checks and all(c.departure is None for c in checks)
    assert all(t.delta <= t.bound for c in checks for t in c.tensors)
    # The encoder graphs of `layout` are checked as well as every prefill, chunks and cache hits included.
    assert {t.tensor for c in checks for t in c.tensors} == {"logits", "hidden", "keys", "values", "encoder"}
    assert all(c.padding_noise is not None for c in checks if c.tensor("keys") is not None)


# Each bug, in the scenario that reaches it, and the verdict it gets in fp32 (docs/scenarios.md).
BUGS = [
    (RunnerVariant.LEGACY, PrefillGraphRunner, "four-arm", "FAIL_DEEPSTACK_DROPPED"),
    (RunnerVariant.NO_CLEAR, PrefillGraphRunner, "stream", "FAIL_STALE_STATE"),
    # Rows written from the wrong place of the prompt: the freshness witness names DeepStack first.
    (RunnerVariant.CHUNK_MISALIGNED, PrefillGraphRunner, "chunked", "FAIL_DEEPSTACK_DROPPED"),
    (RunnerVariant.PREFIX_OFFSET, PrefillGraphRunner, "prefix", "FAIL_DEEPSTACK_DROPPED"),
    (RunnerVariant.GROWTH_REBIND, PrefillGraphRunner, "growth", "FAIL_STALE_STATE"),
    (RunnerVariant.WARMUP_SPECIALIZED, PrefillGraphRunner, "warmup", "FAIL_DEEPSTACK_DROPPED"),
    # The grid the encoder graph froze at capture is another image's: the witness names it first.
    (RunnerVariant.LAYOUT_KEYED, PrefillGraphRunner, "layout", "FAIL_INPUT_NOT_FRESH"),
    (RunnerVariant.FIXED, SkipsCopyWhenShapeRepeats, "stream", "FAIL_STALE_STATE"),
    (RunnerVariant.FIXED, RefreshesAfterReplay, "stream", "FAIL_DEEPSTACK_DROPPED"),
]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("variant, runner_class, scenario, code", BUGS,
                         ids=[f"{v.value}-{c.__name__}" for v, c, _, _ in BUGS])
def test_every_planted_bug_fails_in_every_dtype_as_in_fp32(variant, runner_class, scenario, code, dtype):
    run = library_run(loaded("tiny-qwen3-vl", dtype), runner_class, scenarios=(scenario,), variant=variant)
    assert run.verdict.code == code, run.verdict
    departures = [c.departure for c in _checks(run) if c.departure is not None]
    assert departures and all(d.delta > d.bound for d in departures)


@pytest.mark.parametrize("preset", ["tiny-qwen3-vl", "tiny-qwen3-vl-moe"])
def test_a_bug_under_bf16s_tolerance_fails_on_the_replay_check_alone(preset):
    """Every replayed input off by 1/64: in bf16 the answers stay within the dtype's tolerance (the
    comparison without the check matches), but the replay departs from eager on its own shape (and
    the slot holds other values than the request supplied: the witness)."""
    run = library_run(loaded(preset, "bfloat16"), NudgesEveryReplayInBf16, max_new_tokens=20)
    assert run.verdict.code.startswith("FAIL_"), run.verdict
    case = run.cases[0]
    graph, eager = case.arm("bcg_normal"), case.arm("eager_normal")
    unchecked = replace(graph, evidence=replace(graph.evidence, replay_check=None))
    assert compare(unchecked, eager, auto_tolerances("bfloat16")).match  # what the answers alone show
    departure = graph.evidence.replay_check.departure
    assert departure is not None and departure.point == "embeddings" and departure.delta > departure.bound
    # The nudge is written into the embeddings' slot, so the freshness witness names it as well.
    assert "graph read input_embeds rows" in run.verdict.reason


def test_the_cli_names_the_request_row_and_point_of_a_departure(parity_cli):
    """The issue's bf16 PASS: the layout-keyed encoder graphs' flip was excused as a near-tie."""
    result, doc, out = parity_cli.run("--dtype", "bfloat16", "--scenario", "layout", "--runner", "layout-keyed")
    # The freshness witness names the stale grid of the encoder graph; the replay check, its departure.
    assert result.exit_code == 1 and doc["verdict"]["code"] == "FAIL_INPUT_NOT_FRESH"
    reason = doc["verdict"]["reason"]
    assert "request 2 of 3" in reason and "encoder 128 patches graph read grid_thw rows [0]" in reason, reason
    report = (out / "report.md").read_text()
    assert "REPLAY ≠ EAGER ON ITS OWN SHAPE" in report and "replay = eager on its own shape" in report
    assert "at row 0, first in the vision encoder's output" in report
