"""parity against real SGLang 0.5.23 servers on this CPU: SGLang's own breakable prefill runner,
capturing and replaying through parity's emulated graph (docs/sglang-runbook.md, "On a CPU").

Marked `real_sglang`; skipped, with the reason, where SGLang 0.5.23 is not installed. `.ci/run`
runs them as its second stage, in an SGLang environment outside the repository. Each run starts
two real servers, one after the other (about 1.5-3 minutes each on 2 cores): the released runner
(the drop), the runner with parity's DeepStack slot fix over every scenario, and the test-only
variant of the fix that never clears its slot.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from parity.arms import BCG_NORMAL, BCG_ZERO, EAGER_NORMAL, EAGER_ZERO
from parity.engines.sglang import deepstack_slot
from tests.engines.servers import SGLANG_VERSION, installed

_FOUND = installed("sglang")

pytestmark = [
    pytest.mark.real_sglang,
    pytest.mark.skipif(_FOUND != SGLANG_VERSION, reason=(
        f"SGLang {SGLANG_VERSION} is not installed here (found: {_FOUND or 'none'}); .ci/run and "
        "scripts/setup_sglang_env.sh set up an environment that has it")),
]
MAX_NEW_TOKENS = 8
# fp32 on one machine: a correct replay differs from eager by rounding only (docs/engines/sglang-cpu.md: 1e-6);
# the padded bucket changes matmul shapes, so not bit-for-bit. The drop moves logprobs by ~0.1.
NOISE = 1e-5


def parity_run(out: Path, *args: str):
    from click.testing import CliRunner

    from parity.cli import cli

    result = CliRunner().invoke(cli, ["run", "--backend", "sglang", "--device", "cpu", "--out", str(out),
                                      "--no-plot", "--max-new-tokens", str(MAX_NEW_TOKENS), *args],
                                catch_exceptions=False, prog_name="parity")
    doc = json.loads((out / "results.json").read_text()) if (out / "results.json").exists() else None
    return result, doc


def arms_of(case: dict) -> dict:
    return case["arms"]


def assert_no_server_left() -> None:
    import subprocess

    found = subprocess.run(["pgrep", "-f", "sglang.launch_server"], capture_output=True, text=True).stdout.split()
    assert not found, f"SGLang servers left running: {found}"


@pytest.fixture(scope="module")
def released(tmp_path_factory):
    out = tmp_path_factory.mktemp("released")
    return (out, *parity_run(out))


@pytest.fixture(scope="module")
def fixed_all(tmp_path_factory):
    out = tmp_path_factory.mktemp("fixed")
    return (out, *parity_run(out, "--scenario", "all", "--sglang-fix", deepstack_slot.FIX))


def test_released_0_5_23_drops_deepstack_in_its_own_replayed_prefill(released) -> None:
    out, result, doc = released
    assert result.exit_code == 1, result.output[-3000:]
    assert doc["verdict"]["code"] == "FAIL_DEEPSTACK_DROPPED", doc["verdict"]
    arms = arms_of(doc["cases"][0])
    for name in (BCG_NORMAL, BCG_ZERO):  # evidence that the prefill replayed, from the model process
        evidence = arms[name]["evidence"]
        assert evidence["prefill_replayed"] is True and evidence["buckets"] and evidence["tap_calls"] > 0, evidence
        assert arms[name]["deepstack_record"]["nonzero_rows"] > 0
    assert all(arms[n]["evidence"]["replayed_calls"] == 0 for n in (EAGER_NORMAL, EAGER_ZERO))
    assert len({a["deepstack_record"]["sha256"] for a in arms.values()}) == 1  # the same DeepStack in every arm
    assert arms[BCG_NORMAL]["token_ids"] == arms[BCG_ZERO]["token_ids"] == arms[EAGER_ZERO]["token_ids"]
    assert arms[EAGER_NORMAL]["token_ids"] != arms[EAGER_ZERO]["token_ids"]  # DeepStack matters in eager
    config = doc["config"]
    assert config["sglang_graph_backend"] == "emulated" and config["sglang_fix"] is None
    assert config["sglang_server_dtype"] == {"eager": "torch.float32", "bcg": "torch.float32"}
    assert all("sglang::scheduler" in p[0] for p in config["sglang_tap_processes"].values())
    assert doc["environment"]["sglang"] == SGLANG_VERSION
    log = (out / "sglang-bcg.log").read_text()
    assert "Capture target prefill CUDA graph end" in log and "cpu graph: True" in log  # SGLang's own words
    assert "stand-in op" not in log and not list(out.glob("*.standin-calls.jsonl"))  # no stub ever called
    assert "localization is not available on the sglang backend" in result.output
    assert_no_server_left()


def test_the_fix_plugin_passes_every_scenario(fixed_all) -> None:
    out, result, doc = fixed_all
    assert result.exit_code == 0, result.output[-3000:]
    assert doc["verdict"]["code"] == "PASS", doc["verdict"]
    assert [c["verdict"]["code"] for c in doc["cases"]] == ["PASS", "PASS", "PASS"]
    four = arms_of(doc["cases"][0])
    assert four[BCG_NORMAL]["token_ids"] == four[EAGER_NORMAL]["token_ids"]
    assert four[BCG_NORMAL]["evidence"]["prefill_replayed"] is True
    (slot,) = doc["config"]["sglang_fix_slots"]["bcg"]
    assert slot["variant"] == deepstack_slot.FIX and slot["slot"][1] == 64 * 3  # hidden x DeepStack blocks
    assert slot["slot"][0] == doc["config"]["sglang_prefill_buckets"]["max"]
    assert_no_server_left()


def test_text_only_and_zero_deepstack_replays_equal_eager(fixed_all) -> None:
    _, _, doc = fixed_all
    stream = next(c for c in doc["cases"] if c["scenario"] == "stream")
    checked = 0
    for request in stream["requests"]:
        arms = {a["mode"]: a for a in request["arms"].values()}
        if request["fixture"] is not None and arms["bcg"]["deepstack"] != "zero":
            continue
        bcg, eager = arms["bcg"], arms["eager"]
        assert bcg["evidence"]["prefill_replayed"] is True, request["label"]
        assert bcg["token_ids"] == eager["token_ids"], request["label"]
        assert max(abs(a - b) for a, b in zip(bcg["token_logprobs"], eager["token_logprobs"])) <= NOISE
        checked += 1
    assert checked >= 2  # the text-only request and the zero-DeepStack image request


def _stream_with(variant: str, tmp_path: Path):
    """One stream case on real CPU servers whose bcg server runs the fix's test-only `variant`."""
    from parity.arms import select_arms
    from parity.backends.options import BackendOptions
    from parity.engines.registry import create_backend
    from parity.experiment import run_experiment
    from parity.planning import CaseSpec, RunSpec
    from parity.fixtures import builtin_fixture, default_prompts
    from parity.results import STREAM

    fixture = builtin_fixture("rgb-stripes")
    spec = RunSpec(model="tiny-qwen3-vl", arms=select_arms("all"), cases=(CaseSpec(fixture, default_prompts(fixture)[0]),),
                   scenarios=(STREAM,), max_new_tokens=MAX_NEW_TOKENS)
    backend = create_backend(BackendOptions(name="sglang", device="cpu", engine={"sglang_fix": variant}), MAX_NEW_TOKENS, tmp_path)
    try:
        result = run_experiment(spec, backend, warn=lambda _: None)
    finally:
        backend.close()
    assert result.config["sglang_fix_slots"]["bcg"][0]["variant"] == variant
    assert_no_server_left()
    (case,) = result.cases
    return case


def test_a_slot_that_is_never_cleared_leaks_into_the_stream(tmp_path: Path) -> None:
    case = _stream_with(deepstack_slot.NO_CLEAR, tmp_path)
    assert case.verdict.code == "FAIL_STALE_STATE", case.verdict.reason
    # Every image prefill overwrites its whole bucket; the first request with none keeps the rows.
    assert "(text only)" in case.verdict.reason, case.verdict.reason


def test_a_refresh_skipped_for_a_repeated_shape_is_caught_back_to_back(tmp_path: Path) -> None:
    """Issue 21: the stream's normal and zeroed requests of one image are back to back on the graph
    server (scoring comes after the sequence), so a refresh skipped for a repeated shape is reached."""
    case = _stream_with(deepstack_slot.SKIP_SAME_SHAPE, tmp_path)
    assert case.verdict.code == "FAIL_STALE_STATE", case.verdict.reason
    assert "request 2 of 5 (image, DeepStack zeroed)" in case.verdict.reason, case.verdict.reason
