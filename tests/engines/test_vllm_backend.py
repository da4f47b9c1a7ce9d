"""The vLLM backend driven by the experiment, against tests/vllm_standin.py (a stand-in, not vLLM).

What a run on real servers must give, shown with the stand-in (whose engine keeps DeepStack as
vLLM 0.33 does and runs parity's real tap wrappers): every scenario passes in vLLM's default
mode; `--graph-mode full` and breakable graphs leak an image's DeepStack into the next text-only
request, caught by the leak witness and FAIL_STALE_STATE naming the request and the rows; a
graph that drops DeepStack fails the four arms; evidence comes from the engine's own dispatch
decision per step (a graph server whose prefills ran eager is never a PASS); a tap that never
fires is an error; teacher forcing through prompt logprobs; and nothing is left running.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from parity.engines.vllm import backend as vllm_backend
from parity.media.catalog import builtin_fixture
from parity.design import CORE_SCENARIOS as SCENARIOS  # what the stand-in servers serve
from parity.results import FOUR_ARM, REUSE, STREAM, RunResult, write_results
from parity.trust.loader import load_results
from parity.judge.verdict import judge_run
from tests.engines.runs import run
from tests.engines.servers import VLLM_STANDIN as STANDIN
from tests.engines.servers import assert_nothing_left, standin_identity
from tests.engines.vllm_standin import ByteProcessor, model_config

MAX_NEW_TOKENS = 4


def make_backend(run_dir: Path, *standin_args: str, graph_mode: str = "full_and_piecewise",
                 **kwargs) -> vllm_backend.VllmBackend:
    """Two servers on their own (pretend) GPUs by default: their start-ups overlap, the suite stays fast."""
    kwargs.setdefault("concurrent", True)
    if kwargs["concurrent"]:
        kwargs.setdefault("gpus", (0, 1))
    return vllm_backend.create_vllm_backend(
        model="tiny-standin", max_new_tokens=MAX_NEW_TOKENS, run_dir=run_dir, graph_mode_name=graph_mode,
        ready_timeout=60.0, processor=ByteProcessor(), model_config=model_config(), stop_grace=5.0, ready_poll=0.05,
        identity=standin_identity,
        launch_command=[sys.executable, str(STANDIN), *standin_args], **kwargs)


def by_scenario(result: RunResult) -> dict:
    return {case.scenario: case for case in result.cases}


# --- vLLM's default mode: nothing to find ------------------------------------------------------------------

def test_every_scenario_passes_in_the_default_mode_with_evidence_from_dispatch(tmp_path: Path) -> None:
    backend = make_backend(tmp_path)
    result = run(backend, SCENARIOS)
    assert result.verdict.code == "PASS", [(c.id, c.verdict.reason) for c in result.cases]
    arms = {arm.name: arm for arm in by_scenario(result)[FOUR_ARM].arms}
    for name, arm in arms.items():
        bcg, evidence = name.startswith("bcg"), arm.evidence
        assert evidence.inconsistency() is None and evidence.leak is None
        assert evidence.prefill_replayed is bcg and (evidence.replayed_calls > 0) is bcg, (name, evidence)
        assert evidence.tap_calls >= 2  # the generation's prefill and every scoring prefill carry image rows
        assert arm.deepstack_record.nonzero_rows == 16 and arm.deepstack_record.replay is bcg
        if bcg:  # PIECEWISE prefills in their ladder buckets, and FULL decode steps: every step replayed
            assert min(evidence.buckets) >= arm.deepstack_record.shape[0] and max(evidence.buckets) <= evidence.max_bucket
            assert evidence.replayed_calls == evidence.lm_calls
    # The eager and graph servers were handed the same DeepStack rows.
    assert len({arm.deepstack_record.sha256 for arm in arms.values()}) == 1
    config = result.config
    assert (config["engine"], config["graph_mode"], config["engine_version"]) == ("vllm", "full_and_piecewise",
                                                                                  "0.33.0+standin")
    assert config["graph_cudagraph_modes"] == {"eager": "NONE", "bcg": "FULL_AND_PIECEWISE"}
    assert backend.launch_count == 2 and set(config["vllm_tap_processes"]) == {"eager", "bcg"}
    for mode, flags in config["vllm_servers"].items():  # one flag differs, and the capture sizes cover the prompts
        other = config["vllm_servers"]["bcg" if mode == "eager" else "eager"]
        assert [f for f in flags if f not in other] == [f"-cc.cudagraph_mode={config['graph_cudagraph_modes'][mode]}"]
    assert config["vllm_capture_sizes"]["max"] >= max(a.evidence.prompt_tokens for a in arms.values())
    write_results(result, tmp_path / "results.json")
    assert judge_run(load_results(tmp_path / "results.json")).verdict.code == "PASS"
    assert_nothing_left(tmp_path)


# --- the leak -----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("graph_mode", ["full", "breakable"])
def test_a_whole_forward_replay_leaks_deepstack_into_the_next_text_request(tmp_path: Path, graph_mode: str) -> None:
    result = run(make_backend(tmp_path, graph_mode=graph_mode), SCENARIOS)
    cases = by_scenario(result)
    assert cases[FOUR_ARM].verdict.code == "PASS", cases[FOUR_ARM].verdict.reason  # no drop: image rows are fresh
    reuse, stream = cases[REUSE].verdict, cases[STREAM].verdict
    assert reuse.code == stream.code == result.verdict.code == "FAIL_STALE_STATE"
    assert reuse.reason.startswith("request 2 of 2 (follow-up (text only)): arm bcg_normal received 16 DeepStack row(s) "
                                   "left in the engine's buffer by request 1 (primer (image))"), reuse.reason
    assert "request 4 of 5 (text only)" in stream.reason and "by request 3 (twin image" in stream.reason, stream.reason
    text_only = cases[STREAM].requests[3]
    leak = {a.name: a.evidence.leak for a in text_only.arms}
    assert leak["eager_normal"] is None and leak["bcg_normal"].rows == 16
    assert leak["bcg_normal"].source_sha256 == builtin_fixture("rgb-stripes").twin().sha256
    from parity.reporting.report import render_markdown

    report = render_markdown(result)  # the leaked answer differs too; the engine's graphs cannot be probed per layer
    assert "LEAK WITNESS: 16 stale DeepStack row(s)" in report and "not available on the vllm backend" in report
    # The witness stands in the file, and a re-judged file says the same.
    write_results(result, tmp_path / "results.json")
    assert judge_run(load_results(tmp_path / "results.json")).cases[1].verdict == cases[REUSE].verdict
    assert_nothing_left(tmp_path)


@pytest.mark.parametrize("graph_mode", ["full", "breakable"])
def test_the_clear_fix_passes_where_the_released_engine_leaks(tmp_path: Path, graph_mode: str) -> None:
    released = run(make_backend(tmp_path / "released", graph_mode=graph_mode), SCENARIOS)
    fixed = run(make_backend(tmp_path / "fixed", graph_mode=graph_mode, fix="deepstack-clear"), SCENARIOS)
    assert released.verdict.code == "FAIL_STALE_STATE"  # negative control: the same plan, the fix left out
    assert fixed.verdict.code == "PASS", fixed.verdict.reason
    assert all(a.evidence.leak is None for c in fixed.cases for a in c.all_arms())
    # The eager server answers the same with or without the fix (it clears in Python anyway).
    for before, after in zip(released.cases, fixed.cases):
        for b, a in zip(before.all_arms(), after.all_arms()):
            if b.mode == "eager":
                assert b.token_ids == a.token_ids, (before.id, b.name)
    config = fixed.config
    assert config["vllm_fix"] == "deepstack-clear" and config["vllm_server_env"]["bcg"]["PARITY_VLLM_FIX"]
    notes = {r["note"] for records in config["vllm_fix_records"].values() for r in records}
    assert notes == {"wrapped DefaultModelState.prepare_inputs_embeds",
                     "wrapped Qwen3VLForConditionalGeneration._set_deepstack_input_embeds"}
    assert_nothing_left(tmp_path / "released")
    assert_nothing_left(tmp_path / "fixed")


def test_the_fix_refuses_another_vllm_and_an_unknown_variant(tmp_path: Path) -> None:
    from parity.engines import fix_records
    from parity.engines.vllm import deepstack_clear
    from parity.errors import UsageError

    env = {deepstack_clear.ENV_FIX: "deepstack-clear"}
    assert deepstack_clear.activate({}, tmp_path) is None and not fix_records.read_records(tmp_path)
    assert deepstack_clear.activate(env, tmp_path, version=lambda: "0.35.0") is None
    (refused,) = fix_records.read_records(tmp_path)
    assert refused.refused and "validated on vLLM 0.33.0, 0.34.0, this is vLLM 0.35.0" in refused.note
    for version in ("0.33.0", "0.34.0"):  # every release it was validated on
        assert deepstack_clear.activate(env, tmp_path, version=lambda: version) is not None
    with pytest.raises(UsageError, match="unknown vLLM fix"):
        make_backend(tmp_path, fix="deepstack-everything")


def test_an_engine_that_clears_after_every_replay_passes_in_full_mode(tmp_path: Path) -> None:
    # Negative control: the same FULL replays with the clear restored show no leak.
    result = run(make_backend(tmp_path, "--standin-fixed-clear", graph_mode="full"), (REUSE, STREAM))
    assert result.verdict.code == "PASS", result.verdict.reason
    assert_nothing_left(tmp_path)


# --- the drop, not replayed, a silent tap ------------------------------------------------------------------

def test_a_graph_that_drops_deepstack_fails_the_four_arms(tmp_path: Path) -> None:
    result = run(make_backend(tmp_path, "--standin-drop-deepstack"))
    assert result.verdict.code == "FAIL_DEEPSTACK_DROPPED", result.verdict.reason
    assert_nothing_left(tmp_path)


def test_full_mode_whose_prefills_run_eager_is_never_a_pass(tmp_path: Path) -> None:
    result = run(make_backend(tmp_path, "--standin-full-prefill-eager", graph_mode="full"))
    assert result.verdict.code == "INCONCLUSIVE_NOT_REPLAYED", result.verdict.reason
    assert "vLLM's dispatcher decided NONE" in result.verdict.reason
    bcg = {arm.name: arm for arm in result.cases[0].arms}["bcg_normal"].evidence
    assert bcg.prefill_replayed is False and bcg.replayed_calls > 0 and bcg.buckets == ()  # only decode replayed
    assert_nothing_left(tmp_path)


def test_capture_sizes_too_small_for_the_prompt_are_not_replayed(tmp_path: Path) -> None:
    backend = make_backend(tmp_path, buckets=(8, 16))
    assert backend.bucket_of(16) == 16 and backend.bucket_of(17) is None
    result = run(backend)
    assert result.verdict.code == "INCONCLUSIVE_NOT_REPLAYED", result.verdict.reason
    assert "largest captured bucket: 16" in result.verdict.reason
    assert_nothing_left(tmp_path)


def test_a_server_whose_dispatch_is_not_wrapped_is_an_error(tmp_path: Path) -> None:
    result = run(make_backend(tmp_path, "--standin-no-dispatch-hook"))
    assert result.verdict.code == "ERROR" and "not vLLM's dispatch decision" in result.verdict.reason
    assert_nothing_left(tmp_path)
