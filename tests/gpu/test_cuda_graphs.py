"""The real `torch.cuda.CUDAGraph` backend (marked `gpu`; skipped without CUDA, saying so).

What CPU CI cannot run: every embedded DeepStack preset in every dtype on CUDA graphs, with its
negative control; `--scenario all --fixture all` in one process (the H200's allocator assert);
graph pools across runners and recaptures. `scripts/gpu_check.sh` runs these with `-m gpu`.
"""

from __future__ import annotations

import pytest
import torch

from parity.models import load_model
from parity.runner.graph_runner import GraphBackend, PrefillGraphRunner, RunnerVariant
from tests.library_runs import library_run

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(),
                       reason="needs a CUDA device (tests marked gpu; scripts/gpu_check.sh runs them on a GPU host)"),
]

DEEPSTACK_PRESETS = ("tiny-qwen3-vl", "tiny-qwen3-vl-moe")
DTYPES = ("float32", "bfloat16", "float16")
_LOADED: dict[tuple[str, str], object] = {}


def on_cuda(preset: str, dtype: str):
    """Each preset and dtype built once per test run, on the GPU."""
    if (preset, dtype) not in _LOADED:
        _LOADED[preset, dtype] = load_model(preset, device="cuda", dtype=dtype)
    return _LOADED[preset, dtype]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("preset", DEEPSTACK_PRESETS)
def test_cuda_graphs_pass_the_fixed_runner_and_fail_the_legacy_one(preset, dtype):
    loaded = on_cuda(preset, dtype)
    fixed = library_run(loaded)
    assert fixed.config["graph_backend"] == GraphBackend.CUDA.value and fixed.verdict.code == "PASS", fixed.verdict
    assert library_run(loaded, variant=RunnerVariant.LEGACY).verdict.code == "FAIL_DEEPSTACK_DROPPED"


def test_a_preset_without_deepstack_has_no_power_on_cuda():
    assert library_run(on_cuda("tiny-qwen3-vl-nodeepstack", "float32")).verdict.code == "INCONCLUSIVE_NO_POWER"


@pytest.mark.parametrize("dtype", ("float32", "bfloat16"))
@pytest.mark.parametrize("preset", DEEPSTACK_PRESETS)
def test_scenario_all_on_every_fixture_runs_in_one_process(parity_cli, preset, dtype):
    """The H200's crash: half of `--scenario all` ended in CUDA's allocator assert."""
    result, doc, _ = parity_cli.run("--device", "cuda", "--model", preset, "--dtype", dtype, "--scenario", "all",
                                    "--fixture", "all", "--max-new-tokens", "8")
    assert result.exit_code == 0 and doc["verdict"]["code"] == "PASS", doc["verdict"]
    assert doc["config"]["graph_backend"] == "cuda"


@pytest.mark.parametrize("dtype", ("float32", "bfloat16"))
def test_requests_that_share_a_forward_on_cuda_graphs(dtype):
    """The batch scenario (issue 51) on real CUDA graphs: packed forwards replay the context graphs,
    whose mask keeps each request to its rows; the fix passes, each planted variant fails (the slot
    sized for one request refusing the batch), with poison as a second opinion."""
    loaded = on_cuda("tiny-qwen3-vl", dtype)
    fixed = library_run(loaded, scenarios=("batch",), poison=True)
    assert fixed.verdict.code == "PASS", fixed.verdict
    for variant, code in ((RunnerVariant.BATCH_OFFSET_ZERO, "FAIL_"), (RunnerVariant.BATCH_FIRST_ONLY, "FAIL_"),
                          (RunnerVariant.BATCH_SLOT_ONE, "ERROR")):
        verdict = library_run(loaded, scenarios=("batch",), variant=variant).verdict
        assert verdict.code.startswith(code), (variant, verdict)


def _inputs(adapter, tokens: int, seed: int):
    generator = torch.Generator(device=adapter.device).manual_seed(seed)
    embeds = torch.randn(tokens, adapter.hidden_size, generator=generator, device=adapter.device, dtype=adapter.dtype)
    positions = torch.arange(tokens, device=adapter.device).expand(3, -1).contiguous()
    deepstack = torch.randn(tokens, adapter.hidden_size * adapter.deepstack_count, generator=generator,
                            device=adapter.device, dtype=adapter.dtype)
    return embeds, positions, deepstack


def test_graph_pools_across_runners_recaptures_and_closes():
    """Runners one after another, a growth that recaptures every graph, lazily captured probe
    graphs: each replay answers as the body does eagerly on the same padded shape, and nothing
    trips CUDA's allocator."""
    adapter = on_cuda("tiny-qwen3-vl", "float32").adapter
    for _ in range(2):  # the second runner starts where the first one closed
        runner = PrefillGraphRunner(adapter.body, hidden_size=adapter.hidden_size, dtype=adapter.dtype,
                                    device=adapter.device, buckets=(8, 16), graph_backend=GraphBackend.CUDA)
        for tokens, seed in ((5, 0), (16, 1)):
            embeds, positions, deepstack = _inputs(adapter, tokens, seed)
            replayed = runner.replay(embeds, positions, deepstack)[0]
            points = runner.replay(embeds, positions, deepstack, probe=True)[3]  # a probe graph, its own pool
            with torch.inference_mode():
                eager = adapter.body(embeds, positions, deepstack)[0]
            assert (replayed - eager).abs().max() < 1e-3 and points.shape[0] == tokens
        grown = _inputs(adapter, 24, 2)
        runner.eager(*grown)  # past every bucket: the buffer grows, every graph is captured again
        assert runner.growths and runner.replay(*_inputs(adapter, 7, 3))[0].isfinite().all()
        runner.close()
        with pytest.raises(RuntimeError, match="closed"):
            runner.replay(*_inputs(adapter, 7, 3))


@pytest.mark.parametrize("dtype", ("float32", "bfloat16"))
def test_the_freshness_witness_watches_real_cuda_graphs(dtype):
    """On CUDA the witness watches capture and the writes between replays, never a replay: the fixed
    runner's every input is fresh, and each planted input variant is caught naming its input."""
    loaded = on_cuda("tiny-qwen3-vl", dtype)
    fixed = library_run(loaded, scenarios=("four-arm", "stream"))
    assert fixed.verdict.code == "PASS", fixed.verdict
    records = [r for case in fixed.cases for arm in case.all_arms() for r in arm.evidence.freshness]
    assert records and all(r.offending == 0 for r in records)
    assert {r.input for r in records} == {"input_embeds", "positions", "deepstack"}
    for variant, name in (("mrope-one-row", "positions"), ("mrope-stale", "positions"),
                          ("embeds-tail-kept", "input_embeds"), ("embeds-stale", "input_embeds")):
        verdict = library_run(loaded, variant=RunnerVariant(variant)).verdict
        assert verdict.code.startswith("FAIL_") and f"graph read {name} rows" in verdict.reason, (variant, verdict)


@pytest.mark.parametrize("dtype", ("float32", "bfloat16"))
def test_poison_on_real_cuda_graphs(dtype):
    """--poison on CUDA: the sentinel written before each refresh is gone from every row the fixed
    runner must write (its answers unchanged), and stays in the rows a stale variant skipped."""
    loaded = on_cuda("tiny-qwen3-vl", dtype)
    plain, poisoned = library_run(loaded), library_run(loaded, poison=True)
    assert poisoned.verdict.code == "PASS", poisoned.verdict
    for a, b in zip(plain.cases[0].all_arms(), poisoned.cases[0].all_arms()):
        assert a.token_ids == b.token_ids, a.name
    records = [r for arm in poisoned.cases[0].all_arms() for r in arm.evidence.freshness]
    assert records and all(r.poisoned == 0 for r in records)
    stale = library_run(loaded, variant=RunnerVariant("embeds-stale"), poison=True)
    record = next(r for r in stale.cases[0].arm("bcg_normal").evidence.freshness if r.input == "input_embeds")
    assert stale.verdict.code == "FAIL_STALE_STATE" and record.poisoned == record.rows > 0
