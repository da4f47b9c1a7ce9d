"""vLLM on a CPU, the parts that need no vLLM: the op stand-ins (against a dense attention, and
through the emulated graph), the start-up hook, the in-process gates on vLLM-shaped stand-ins, and
what parity gives a CPU server (flags, environment, the V1-fallback reason).

The real servers these parts make possible are tested in test_vllm_real_server.py (marker real_vllm).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

from parity.runner.emulated_graph import EmulatedGraph, graph
from parity.engines import standin_calls
from parity.engines.channel import TapChannel
from parity.engines.placement import Placement
from parity.engines.vllm import cpu_ops, cpu_patches, servers
from parity.errors import UsageError
from tests.engines.servers import REPO

# fp32 attention against a dense reference computed in another order: rounding only.
NOISE = 1e-5
BLOCK = 4


@pytest.fixture(scope="module", autouse=True)
def ops():
    cpu_ops.install(torch)
    return torch.ops._C


def paged(keys: list[torch.Tensor], values: list[torch.Tensor], blocks_per_request: int, kv_heads: int, size: int):
    """A KV cache (vLLM's CPU layout, key and value halves of one tensor) holding each request's
    keys and values, written through the stand-in, with a block table that interleaves requests."""
    count = len(keys)
    cache = torch.zeros(count * blocks_per_request + 1, kv_heads, 2 * BLOCK, size)
    key_cache, value_cache = cache.chunk(2, dim=2)
    table = torch.zeros(count, blocks_per_request, dtype=torch.int32)
    for r, (k, v) in enumerate(zip(keys, values)):
        table[r] = torch.arange(blocks_per_request) * count + r + 1  # block 0 stays unused
        slots = torch.tensor([int(table[r, i // BLOCK]) * BLOCK + i % BLOCK for i in range(k.shape[0])] + [-1])
        padded_k = torch.cat([k, torch.full_like(k[:1], 7.0)])  # the padding row (slot -1) must not land
        padded_v = torch.cat([v, torch.full_like(v[:1], 7.0)])
        torch.ops._C.cpu_attn_reshape_and_cache(padded_k, padded_v, key_cache, value_cache, slots, "vec", 1.0, 1.0,
                                                "auto")
    return key_cache, value_cache, table


def dense(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal attention of the last len(q) positions, queries aligned to the end (GQA by repetition)."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    offset = k.shape[0] - q.shape[0]
    mask = torch.arange(k.shape[0])[None, :] > (torch.arange(q.shape[0])[:, None] + offset)
    weights = torch.softmax(scores.masked_fill(mask, float("-inf")), dim=-1)
    return torch.einsum("hqk,khd->qhd", weights, v)


def attend(query, key_cache, value_cache, starts, lengths, table, output=None, **overrides):
    output = torch.zeros_like(query) if output is None else output
    args = dict(scale=0.25, causal=True, alibi_slopes=None, sliding_window=-1, softcap=0.0, s_aux=None,
                dynamic_causal=None, kv_cache_dtype="auto")
    args.update(overrides)
    torch.ops._C.cpu_attention_with_kv_cache(
        query, key_cache, value_cache, output, starts, lengths, args["scale"], args["causal"], args["alibi_slopes"],
        args["sliding_window"], table, args["softcap"], torch.zeros(1), args["s_aux"], args["dynamic_causal"], 1.0,
        1.0, args["kv_cache_dtype"])
    return output


def batch(seed: int, seq_lens=(9, 5), query_lens=(9, 1), heads=4, kv_heads=2, size=8):
    gen = torch.Generator().manual_seed(seed)
    keys = [torch.randn(n, kv_heads, size, generator=gen) for n in seq_lens]
    values = [torch.randn(n, kv_heads, size, generator=gen) for n in seq_lens]
    queries = [torch.randn(n, heads, size, generator=gen) for n in query_lens]
    return keys, values, queries


def test_the_paged_attention_equals_dense_causal_attention_per_request() -> None:
    keys, values, queries = batch(0)  # a 9-token prefill and a 1-token decode step, GQA 4:2
    key_cache, value_cache, table = paged(keys, values, 3, 2, 8)
    starts = torch.tensor([0, 9, 10], dtype=torch.int32)
    out = attend(torch.cat(queries), key_cache, value_cache, starts, torch.tensor([9, 5], dtype=torch.int32), table)
    expected = torch.cat([dense(q, k, v, 0.25) for q, k, v in zip(queries, keys, values)])
    assert (out - expected).abs().max() < NOISE


def test_padding_slots_are_not_written_and_padded_requests_are_skipped() -> None:
    keys, values, queries = batch(1, seq_lens=(6,), query_lens=(6,))
    key_cache, value_cache, table = paged(keys, values, 2, 2, 8)
    assert not (key_cache == 7.0).any() and not (value_cache == 7.0).any()
    query = torch.cat([queries[0], torch.randn(2, 4, 8)])  # two padded rows of a captured bucket
    out = attend(query, key_cache, value_cache, torch.tensor([0, 6, 6], dtype=torch.int32),
                 torch.tensor([6, 0], dtype=torch.int32), torch.cat([table, table]), output=torch.full_like(query, 3.0))
    assert (out[:6] - dense(queries[0], keys[0], values[0], 0.25)).abs().max() < NOISE
    assert (out[6:] == 3.0).all()  # rows past the last request's tokens are left as they were


def test_the_attention_reads_its_bounds_at_replay_as_a_graph_capable_kernel_does() -> None:
    """Captured once, replayed after the metadata tensors changed in place: the answer is the new
    batch's, not the captured one's (what lets the CPU builder claim graph support)."""
    keys, values, queries = batch(2, seq_lens=(8, 8), query_lens=(8, 8))
    key_cache, value_cache, table = paged(keys, values, 2, 2, 8)
    query, output = torch.cat(queries), torch.zeros(16, 4, 8)
    starts, lengths = torch.tensor([0, 8, 16], dtype=torch.int32), torch.tensor([8, 8], dtype=torch.int32)
    captured = EmulatedGraph()
    with graph(captured):
        attend(query, key_cache, value_cache, starts, lengths, table, output=output)
    starts.copy_(torch.tensor([0, 3, 4], dtype=torch.int32))  # now a 3-token chunk and a decode step
    lengths.copy_(torch.tensor([3, 8], dtype=torch.int32))
    output.zero_()
    captured.replay()
    assert (output[:3] - dense(queries[0][:3], keys[0][:3], values[0][:3], 0.25)).abs().max() < NOISE
    assert (output[3:4] - dense(query[3:4], keys[1], values[1], 0.25)).abs().max() < NOISE  # row 3 of the buffer
    recorded = [op.func.name() for op in captured._ops]
    assert recorded.count("_C::cpu_attention_with_kv_cache") == 1  # re-run whole, never its internals
    assert not any("softmax" in name or "matmul" in name for name in recorded)


@pytest.mark.parametrize("override, named", [
    ({"alibi_slopes": torch.ones(4)}, "alibi_slopes"), ({"softcap": 30.0}, "softcap"),
    ({"sliding_window": 4}, "sliding_window"), ({"s_aux": torch.zeros(4)}, "s_aux"),
    ({"kv_cache_dtype": "fp8_e4m3"}, "kv_cache_dtype=fp8_e4m3")])
def test_what_the_standin_cannot_compute_is_logged_and_raised_never_approximated(tmp_path: Path, monkeypatch,
                                                                                 override, named) -> None:
    calls = tmp_path / "calls.jsonl"
    monkeypatch.setenv(cpu_ops.ENV_CALLS, str(calls))
    keys, values, queries = batch(3, seq_lens=(4,), query_lens=(4,))
    key_cache, value_cache, table = paged(keys, values, 1, 2, 8)
    with pytest.raises(standin_calls.StandinCalled, match="cpu_attention_with_kv_cache"):
        attend(queries[0], key_cache, value_cache, torch.tensor([0, 4], dtype=torch.int32),
               torch.tensor([4], dtype=torch.int32), table, **override)
    problem = cpu_ops.call_log(calls).problem()
    assert f"torch.ops._C.cpu_attention_with_kv_cache ({named}) was called" in problem and "vLLM" in problem


def test_the_weak_reference_is_an_alias_and_the_memory_env_a_no_op() -> None:
    tensor = torch.arange(6.0)
    alias = torch.ops._C.weak_ref_tensor(tensor)
    alias[0] = 5.0
    assert tensor[0] == 5.0 and alias.untyped_storage().data_ptr() == tensor.untyped_storage().data_ptr()
    assert torch.ops._C.init_cpu_memory_env([0]) is None


# --- the start-up hook and the gates ------------------------------------------------------------------

PROBE = """
import json, sys, torch
out = {"ops": hasattr(torch.ops._C, "cpu_attention_with_kv_cache"),
       "graph": torch.cuda.CUDAGraph.__name__, "context": getattr(torch.cuda.graph, "__module__", "")}
import vllm.triton_utils.importing as importing
out["triton"] = importing.HAS_TRITON
print(json.dumps(out))
"""


def hook_probe(tmp_path: Path, env: dict[str, str]) -> dict:
    fake = tmp_path / "fake" / "vllm" / "triton_utils"
    fake.mkdir(parents=True, exist_ok=True)
    for folder in (fake.parent, fake):
        (folder / "__init__.py").write_text("")
    (fake / "importing.py").write_text("HAS_TRITON = False\n")
    path = os.pathsep.join([str(servers.STANDIN_DIR), str(REPO), str(tmp_path / "fake")])
    done = subprocess.run([sys.executable, "-c", PROBE], env={**os.environ, "PYTHONPATH": path, **env},
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_the_hook_opens_the_gates_only_when_parity_asks(tmp_path: Path) -> None:
    plain = hook_probe(tmp_path, {})
    assert plain == {"ops": False, "graph": "CUDAGraph", "context": "torch.cuda.graphs", "triton": False}
    eager = hook_probe(tmp_path, {cpu_patches.ENV_CPU: "1"})
    assert eager == {"ops": True, "graph": "CUDAGraph", "context": "torch.cuda.graphs", "triton": True}
    graphs = hook_probe(tmp_path, {cpu_patches.ENV_CPU: "1", cpu_patches.ENV_GRAPH: cpu_patches.GRAPH_EMULATED})
    assert graphs == {"ops": True, "graph": "EngineEmulatedGraph", "context": "parity.runner.emulated_graph", "triton": True}


def fake_platform_module() -> types.ModuleType:
    class CpuPlatform:
        @classmethod
        def check_and_update_config(cls, vllm_config):  # what vLLM's CPU platform does
            vllm_config.compilation_config.cudagraph_capture_sizes = []
            vllm_config.compilation_config.mode = "DYNAMO_TRACE_ONCE"

        @classmethod
        def support_static_graph_mode(cls):
            return False

        @classmethod
        def opaque_attention_op(cls):
            return True

    return types.SimpleNamespace(CpuPlatform=CpuPlatform)


@pytest.mark.parametrize("compiled", [False, True])
def test_the_platform_gate_keeps_the_capture_sizes_and_calls_attention_directly(monkeypatch, compiled) -> None:
    """Whole graphs need attention as a direct call; vLLM's piecewise compile (kept with dynamo's
    eager backend when parity asks) splits at the opaque op and keeps the compile mode."""
    if compiled:
        monkeypatch.setenv(cpu_patches.ENV_COMPILE, cpu_patches.COMPILE_EAGER)
    module = fake_platform_module()
    cpu_patches.cpu_platform_graphs(module)
    cpu_patches.cpu_platform_graphs(module)  # applied twice: wrapped once
    config = types.SimpleNamespace(compilation_config=types.SimpleNamespace(
        cudagraph_capture_sizes=[1, 8, 16], mode="VLLM_COMPILE", backend="eager"))
    module.CpuPlatform.check_and_update_config(config)
    assert config.compilation_config.cudagraph_capture_sizes == [1, 8, 16]
    assert (config.compilation_config.mode == "VLLM_COMPILE") is compiled
    assert module.CpuPlatform.support_static_graph_mode() and module.CpuPlatform.opaque_attention_op() is compiled


def test_the_worker_captures_before_serving_only_when_its_manager_has_graphs_to_capture(monkeypatch) -> None:
    workspace = types.SimpleNamespace(made=[], is_workspace_manager_initialized=lambda: bool(workspace.made),
                                      init_workspace_manager=lambda device: workspace.made.append(device))
    monkeypatch.setitem(sys.modules, "vllm.v1.worker.workspace", workspace)
    monkeypatch.setitem(sys.modules, "vllm.v1.worker", types.SimpleNamespace(workspace=workspace))
    order = []

    class CPUWorker:
        device = "cpu"

        def __init__(self, needs: bool) -> None:
            self.model_runner = types.SimpleNamespace(
                cudagraph_manager=types.SimpleNamespace(needs_capture=lambda: needs),
                capture_model=lambda: order.append(("capture", torch.accelerator.get_memory_info())))

        def compile_or_warm_up_model(self):
            order.append("warm up")
            return "times"

    module = types.SimpleNamespace(CPUWorker=CPUWorker)
    cpu_patches.worker_captures(module)
    assert CPUWorker(True).compile_or_warm_up_model() == "times"
    assert order == [("capture", (0, 0)), "warm up"] and workspace.made == ["cpu"]
    order.clear()
    CPUWorker(False).compile_or_warm_up_model()
    assert order == ["warm up"]


# --- what parity gives a CPU server ---------------------------------------------------------------------

def cpu_settings(tmp_path: Path, **kwargs) -> servers.VllmSettings:
    return servers.VllmSettings(model="/ckpt", max_new_tokens=8, run_dir=tmp_path, device="cpu",
                                graph_backend="emulated", **kwargs)


def test_a_cpu_server_gets_the_hook_v2_and_no_compile_and_its_gpu_twin_none_of_it(tmp_path: Path) -> None:
    channel = TapChannel(tmp_path / "tap")
    settings = cpu_settings(tmp_path, graph_mode="full")
    env = servers.server_env(settings, channel, Placement(None, 0.7), tmp_path / "calls.jsonl")
    assert env["PYTHONPATH"].split(os.pathsep)[0] == str(servers.STANDIN_DIR)
    assert env["TRITON_INTERPRET"] == "1"  # V2's Triton kernels on CPU tensors (its variable: per release, below)
    assert env[cpu_patches.ENV_GRAPH] == "emulated" and env[cpu_ops.ENV_CALLS] == str(tmp_path / "calls.jsonl")
    flags = servers.server_flags(settings, "bcg", 0.7, (8, 16))
    assert "-cc.mode=none" in flags and "--kernel-config.enable_jit_warmup=false" in flags
    assert flags[flags.index("--kv-cache-memory-bytes") + 1] == str(servers.CPU_KV_CACHE_BYTES)
    eager = servers.server_flags(settings, "eager", 0.7, (8, 16))
    assert [f for f in flags if not f.startswith("-cc.cudagraph_mode")] == \
        [f for f in eager if not f.startswith("-cc.cudagraph_mode")]
    gpu = servers.VllmSettings(model="/ckpt", max_new_tokens=8, run_dir=tmp_path)
    gpu_env = servers.server_env(gpu, channel, Placement(None, 0.7))
    assert "PYTHONPATH" not in gpu_env and cpu_patches.ENV_CPU not in gpu_env
    assert "-cc.mode=none" not in servers.server_flags(gpu, "bcg", 0.7, (8,))
    given = cpu_settings(tmp_path, vllm_args=("--kv-cache-memory-bytes", "1G"))
    assert servers.server_flags(given, "bcg", 0.7, (8,)).count("--kv-cache-memory-bytes") == 1


V1_PROBE = """
import json
from parity.engines.vllm import plugin
plugin.register()
from vllm.v1.worker.gpu_model_runner import GPUModelRunner as V1
from vllm.v1.worker.gpu.model_runner import GPUModelRunner as V2
class CPUModelRunner(V1):
    pass
CPUModelRunner("config"); V2("config")
"""


def test_the_runner_a_server_built_is_recorded_and_v1_is_an_error_naming_it(tmp_path: Path) -> None:
    from parity.engines.vllm import plugin
    from parity.engines.vllm.backend import VllmBackend

    for name, text in {"vllm/__init__.py": "", "vllm/v1/__init__.py": "", "vllm/v1/worker/__init__.py": "",
                       "vllm/v1/worker/gpu/__init__.py": "",
                       "vllm/v1/worker/gpu_model_runner.py": "class GPUModelRunner:\n    def __init__(self, c): pass\n",
                       "vllm/v1/worker/gpu/model_runner.py": "class GPUModelRunner:\n    def __init__(self, c): pass\n"
                       }.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    channel = tmp_path / "tap"
    channel.mkdir()
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}:{REPO}", plugin.ENV_VAR: str(channel)}
    done = subprocess.run([sys.executable, "-c", V1_PROBE], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert [(r["runner"], r["class"]) for r in plugin.runners(channel)] == [("V1", "CPUModelRunner"),
                                                                           ("V2", "GPUModelRunner")]
    server = types.SimpleNamespace(channel=TapChannel(channel))
    assert VllmBackend.started_problem(None, server).startswith("vLLM built its V1 model runner (CPUModelRunner")
    (channel / plugin.RUNNER_FILE).write_text(json.dumps({"runner": "V2", "pid": 1, "class": "CPUModelRunner"}) + "\n")
    assert VllmBackend.started_problem(None, server) is None


@pytest.mark.parametrize("args, message", [
    (("--graph-backend", "cuda"), "--graph-backend cuda with --device cpu"),
    (("--concurrent",), "one after the other"),
])
def test_cpu_choices_that_cannot_work_are_refused_before_anything_starts(parity_cli, args, message) -> None:
    result = parity_cli("run", "--backend", "vllm", "--device", "cpu", *args)
    assert result.exit_code == 2 and message in result.output


def test_an_embedded_preset_on_a_gpu_is_refused_with_the_way_to_serve_it(tmp_path: Path) -> None:
    from parity.backends.options import BackendOptions
    from parity.engines.vllm.backend import from_options

    options = BackendOptions(name="vllm", model="tiny-qwen3-vl", device="cuda")
    with pytest.raises(UsageError, match="serves it with --device cpu"):
        from_options(options, 8, tmp_path)


def test_piecewise_modes_get_vllms_compile_with_the_eager_backend_and_whole_graph_modes_none(tmp_path) -> None:
    for mode in ("full_and_piecewise", "piecewise"):
        settings = cpu_settings(tmp_path, graph_mode=mode)
        flags = servers.server_flags(settings, "bcg", 0.7, (8,))
        assert "-cc.mode=VLLM_COMPILE" in flags and "-cc.backend=eager" in flags and "-cc.mode=none" not in flags
        env = servers.server_env(settings, TapChannel(tmp_path / "tap"), Placement(None, 0.7))
        assert env[cpu_patches.ENV_COMPILE] == cpu_patches.COMPILE_EAGER
        assert servers.server_flags(settings, "eager", 0.7, (8,)).count("-cc.mode=VLLM_COMPILE") == 1  # both alike
    for mode in ("full", "breakable"):
        settings = cpu_settings(tmp_path, graph_mode=mode)
        assert "-cc.mode=none" in servers.server_flags(settings, "bcg", 0.7, (8,))
        env = servers.server_env(settings, TapChannel(tmp_path / "tap"), Placement(None, 0.7))
        assert env[cpu_patches.ENV_COMPILE] == ""


def test_a_graph_replays_under_the_forward_context_it_captured_in_when_none_is_set(monkeypatch) -> None:
    """vLLM's opaque attention reads the forward context when it runs; a FULL replay sets none, so
    the emulated graph replays under the one that was set while it captured (and under the current
    one when there is one)."""
    import contextlib

    state = {"context": None, "replayed_under": []}

    @contextlib.contextmanager
    def set_forward_context(value):
        previous, state["context"] = state["context"], value
        try:
            yield value
        finally:
            state["context"] = previous

    module = types.SimpleNamespace(
        set_forward_context=set_forward_context, get_forward_context=lambda: state["context"],
        is_forward_context_available=lambda: state["context"] is not None, override_forward_context=set_forward_context)
    monkeypatch.setattr(torch.cuda, "CUDAGraph", torch.cuda.CUDAGraph)  # restored after the test
    cpu_patches.graphs_keep_forward_context(module)
    source, out = torch.ones(3), torch.zeros(3)
    captured = torch.cuda.CUDAGraph()
    with graph(captured):
        with module.set_forward_context("capture-time metadata"):
            out.copy_(source * 2)
    original_replay = EmulatedGraph.replay
    monkeypatch.setattr(EmulatedGraph, "replay",
                        lambda self: (state["replayed_under"].append(state["context"]), original_replay(self)))
    source.fill_(5.0)
    captured.replay()  # no context set: the captured one
    with module.set_forward_context("current"):
        captured.replay()
    assert state["replayed_under"] == ["capture-time metadata", "current"] and out.tolist() == [10.0] * 3
    assert state["context"] is None

