"""SGLang on a CPU, the parts that need no SGLang: the kernel stand-in, the in-process changes, the
CPU servers' flags and environment, parity's DeepStack slot contract, and what parity checks about
a CPU server (driven through tests/sglang_standin.py, a stand-in, not SGLang).

tests/engines/test_sglang_real_server.py runs the same against real SGLang 0.5.23 servers where installed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import types
from pathlib import Path

import pytest
import torch

from parity.errors import BackendUnavailableError, UsageError
from parity.engines import after_import, fix_records, standin_calls
from parity.engines.settings import resolve_graph_backend
from parity.engines.sglang import versions as sglang_versions
from parity.engines.sglang import backend as sglang_backend
from parity.engines.sglang import cpu_patches, deepstack_slot, kernel_standin, server_checks, servers
from parity.engines.sglang.plugin import TapChannel
from tests.engines.servers import REPO, SGLANG_STANDIN, assert_nothing_left
from tests.engines.runs import four_arms, make_backend, run



# --- the kernel stand-in ------------------------------------------------------------------------------

def test_the_ops_namespace_answers_cpu_ops_and_keeps_probed_names_absent(tmp_path: Path, monkeypatch) -> None:
    ops = kernel_standin.OpsNamespace()
    assert callable(ops.fused_sigmoid_mul_cpu) and ops.fused_sigmoid_mul_cpu is ops.fused_sigmoid_mul_cpu
    for absent in ("convert_weight_packed", "fused_qk_norm_cpu", "fused_qk_norm_rope_cpu", "gdn_attention",
                   "gptq_marlin_repack", "__wrapped__"):
        assert not hasattr(ops, absent), absent  # present, they would switch SGLang onto other paths
    calls = tmp_path / "calls.jsonl"
    monkeypatch.setenv(kernel_standin.ENV_CALLS, str(calls))
    with pytest.raises(standin_calls.StandinCalled, match="fused_sigmoid_mul_cpu"):
        ops.fused_sigmoid_mul_cpu(torch.ones(2))
    (call,) = standin_calls.read_calls(calls)
    assert call.op == "torch.ops.sgl_kernel.fused_sigmoid_mul_cpu" and call.pid == os.getpid()
    problem = kernel_standin.call_log(calls).problem()
    assert "stand-in op torch.ops.sgl_kernel.fused_sigmoid_mul_cpu was called" in problem
    assert kernel_standin.call_log(tmp_path / "none.jsonl").problem() is None


_IN_SERVER = textwrap.dedent("""
    import json, sys, torch
    out = {"ops_cpu": hasattr(torch.ops.sgl_kernel, "rotate_input_ids_cpu"),
           "ops_probed": hasattr(torch.ops.sgl_kernel, "convert_weight_packed"),
           "graph": torch.cuda.CUDAGraph.__name__, "pool": hasattr(torch.cpu, "graph_pool_handle")}
    import sgl_kernel
    from sgl_kernel.scalar_type import scalar_types
    out["standin"] = getattr(sgl_kernel, "__parity_standin__", False)
    out["real_file"] = scalar_types == "from the real package"
    out["version"] = sgl_kernel.__version__
    from sgl_kernel.elementwise import silu_and_mul  # every other submodule: a module of stubs
    try:
        silu_and_mul(1)
    except NotImplementedError as err:
        out["called"] = str(err)
    print(json.dumps(out))
""")


def _fake_real_sgl_kernel(root: Path) -> Path:
    """A package shaped like the registry's sgl_kernel: its __init__ needs libcuda, two files are plain."""
    package = root / "sgl_kernel"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("raise ImportError('libcuda.so.1: cannot open shared object file')\n")
    (package / "scalar_type.py").write_text("scalar_types = 'from the real package'\n")
    (package / "version.py").write_text("__version__ = '0.4.10'\n")
    return root


def _python(code: str, env: dict, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], env=env, cwd=cwd, capture_output=True, text=True, timeout=300)


def test_the_standin_folder_turns_a_server_process_into_a_cpu_one(tmp_path: Path) -> None:
    real = _fake_real_sgl_kernel(tmp_path / "site")
    shadowed = tmp_path / "shadowed"
    shadowed.mkdir()
    (shadowed / "sitecustomize.py").write_text("import os; os.environ['SHADOWED_RAN'] = '1'\n")
    calls = tmp_path / "calls.jsonl"
    path = os.pathsep.join([str(kernel_standin.STANDIN_DIR), str(REPO), str(real), str(shadowed)])
    env = {**os.environ, "PYTHONPATH": path, cpu_patches.ENV_CPU: "1", cpu_patches.ENV_GRAPH: "emulated",
           kernel_standin.ENV_CALLS: str(calls)}
    done = _python(_IN_SERVER + "import os; print(os.environ.get('SHADOWED_RAN'))", env, tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.strip().splitlines()
    out = json.loads(lines[-2])
    assert out == {"ops_cpu": True, "ops_probed": False, "graph": "EngineEmulatedGraph", "pool": True, "standin": True,
                   "real_file": True, "version": "0.4.10", "called": out["called"]}
    assert "sgl_kernel.elementwise.silu_and_mul" in out["called"] and lines[-1] == "1"  # the shadowed hook ran too
    assert [c.op for c in standin_calls.read_calls(calls)] == ["sgl_kernel.elementwise.silu_and_mul"]


def test_without_parity_variables_the_standin_folder_changes_nothing(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(kernel_standin.STANDIN_DIR), str(REPO)])}
    env.pop(cpu_patches.ENV_CPU, None)
    code = "import torch; print(hasattr(torch.ops.sgl_kernel, 'rotate_input_ids_cpu'), torch.cuda.CUDAGraph.__name__)"
    done = _python(code, env, tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["False", "CUDAGraph"]


# --- the in-process changes ------------------------------------------------------------------------------

def test_a_change_is_applied_right_after_its_module_executes(tmp_path: Path, monkeypatch) -> None:
    (tmp_path / "parity_probe_target.py").write_text("def f():\n    return 'original'\n")
    monkeypatch.syspath_prepend(str(tmp_path))

    def patch(module: types.ModuleType) -> None:
        module.f = lambda: "changed"

    try:
        cpu_patches.after_import("parity_probe_target", patch)  # the shared finder's
        from parity_probe_target import f  # a later `from X import f` binds the changed name

        assert f() == "changed"
    finally:
        sys.meta_path[:] = [m for m in sys.meta_path if m is not after_import.FINDER]
        after_import.FINDER.patches.pop("parity_probe_target", None)
        sys.modules.pop("parity_probe_target", None)


def _attention_hook_module(asked_prefill: str) -> tuple[types.ModuleType, list]:
    """An object shaped like SGLang's attention_hook namespace, recording what it is asked to declare."""
    declared = []
    config = lambda prefill, decode: types.SimpleNamespace(  # noqa: E731
        prefill=types.SimpleNamespace(backend=prefill), decode=types.SimpleNamespace(backend=decode))
    module = types.ModuleType("attention_hook")
    module.declare_resolution = lambda args, source, **fields: declared.append((source, fields))
    module.resolving_view = lambda args: types.SimpleNamespace(cuda_graph_config=config(asked_prefill, "full"))
    module.make = config
    return module, declared


def test_keeping_the_prefill_graph_drops_only_the_declaration_that_turns_it_off() -> None:
    source = cpu_patches.ATTENTION_COMPATIBILITY_SOURCE
    module, declared = _attention_hook_module("breakable")
    cpu_patches.keep_prefill_graph(module)
    module.declare_resolution(None, source, cuda_graph_config=module.make("breakable", "disabled"))
    module.declare_resolution(None, source, cuda_graph_config=module.make("disabled", "disabled"))
    module.declare_resolution(None, "another_handler", cuda_graph_config=module.make("disabled", "full"))
    assert [(s, f["cuda_graph_config"].prefill.backend) for s, f in declared] == [
        (source, "breakable"), ("another_handler", "disabled")]  # decode off stays; others untouched
    # An eager server asked for no prefill graph: nothing to keep, both declarations stand.
    module, declared = _attention_hook_module("disabled")
    cpu_patches.keep_prefill_graph(module)
    module.declare_resolution(None, source, cuda_graph_config=module.make("disabled", "disabled"))
    assert len(declared) == 1


@pytest.mark.parametrize("has_decord", [True, False])
def test_videos_decode_with_decord_when_it_is_installed(monkeypatch, has_decord) -> None:
    import importlib.util

    found = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: (object() if has_decord else None) if name == "decord" else found(name, *a))
    decoder = types.ModuleType(cpu_patches.VIDEO_DECODER)
    decoder._BACKEND = "torchcodec"
    cpu_patches.decode_with_decord(decoder)
    assert decoder._BACKEND == ("decord" if has_decord else "torchcodec")


def test_the_device_stream_is_the_cpu_stream() -> None:
    module = types.ModuleType("common")
    cpu_patches.cpu_stream(module)
    assert module.get_current_device_stream_fast() == torch.cpu.current_stream()


def _expert_loop(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """moe_forward_native's shape: tokens sorted by expert, each expert's run sized by counts read on the host."""
    order = ids.argsort()
    counts = torch.bincount(ids, minlength=weights.shape[0]).tolist()
    outputs, start = [], 0
    for expert, count in enumerate(counts):
        if count:
            outputs.append(x[order[start:start + count]] @ weights[expert])
        start += count
    out = torch.empty_like(x)
    out[order] = torch.cat(outputs)
    return out


def _gathered(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """fused_moe_forward_native's shape: each token's expert gathered, one einsum."""
    return torch.einsum("ti,tio->to", x, weights[ids])


@pytest.mark.parametrize("moe, replays_right", [(_expert_loop, False), (_gathered, True)])
def test_a_captured_expert_loop_replays_the_capture_s_routing(moe, replays_right) -> None:
    """Why MoE runs on SGLang's CPU servers failed their self-check: a graph captured over
    moe_forward_native keeps the capture's counts per expert, so a replay routes the live tokens by
    them; SGLang's gathered form has no routing-dependent shape (cpu_patches change 5)."""
    from parity.runner.emulated_graph import EngineEmulatedGraph, graph

    generator = torch.Generator().manual_seed(0)
    weights, x = torch.randn(4, 3, 3, generator=generator), torch.randn(6, 3, generator=generator)
    ids = torch.tensor([0, 0, 1, 1, 2, 3])
    captured = EngineEmulatedGraph()
    with graph(captured):
        out = moe(x, ids, weights)
    ids.copy_(torch.tensor([3, 3, 3, 0, 0, 2]))  # the next batch routes otherwise: same shapes
    captured.replay()
    assert torch.allclose(out, _gathered(x, ids, weights), atol=1e-5) == replays_right


def _unquant_module(amx: bool) -> types.ModuleType:
    module = types.ModuleType(cpu_patches.MOE_METHODS)

    class UnquantizedFusedMoEMethod:
        def forward_cpu(self, layer, dispatch_output):
            return "moe_forward_native"

        forward_native = forward_cpu

    module.UnquantizedFusedMoEMethod = UnquantizedFusedMoEMethod
    module.use_intel_amx_backend = lambda layer: amx
    return module


@pytest.mark.parametrize("amx", [False, True])
def test_the_cpu_moe_runs_sglang_s_gathered_form_unless_amx_kernels_serve_it(monkeypatch, amx) -> None:
    native = types.ModuleType(cpu_patches.MOE_NATIVE)
    native.fused_moe_forward_native = lambda layer, dispatch_output: "fused_moe_forward_native"
    monkeypatch.setitem(sys.modules, cpu_patches.MOE_NATIVE, native)
    module = _unquant_module(amx)
    cpu_patches.capturable_moe(module)
    cpu_patches.capturable_moe(module)  # applied twice: wrapped once
    method = module.UnquantizedFusedMoEMethod()
    expected = "moe_forward_native" if amx else "fused_moe_forward_native"
    assert method.forward_cpu(None, None) == method.forward_native(None, None) == expected


# --- CPU servers: flags, environment, choices -------------------------------------------------------------

def cpu_settings(tmp_path: Path, *args: str, **kwargs) -> servers.SglangSettings:
    return servers.SglangSettings(model="/ckpt", max_new_tokens=8, run_dir=tmp_path, sglang_args=args,
                                  device="cpu", graph_backend="emulated", **kwargs)


def test_cpu_servers_get_the_cpu_engine_flags_and_a_bounded_pool(tmp_path: Path) -> None:
    for mode, backend in (("eager", "disabled"), ("bcg", "breakable")):
        flags = servers.server_flags(cpu_settings(tmp_path, "--dtype", "float32"), mode, 0.7)
        joined = " ".join(flags)
        assert "--device cpu --attention-backend torch_native" in joined and "fa3" not in joined
        assert "--enable-deterministic-inference" not in flags  # SGLang refuses it with torch_native
        assert f"--cuda-graph-backend-prefill {backend}" in joined and "--max-total-tokens 4096" in joined
        config = flags[flags.index("--mm-process-config") + 1]
        assert json.loads(config) == {"video": {"min_pixels": 784}}  # frames reach the processor at their own size
    own = '{"video": {"min_pixels": 4096}}'
    flags = servers.server_flags(cpu_settings(tmp_path, "--max-total-tokens", "2048", "--mm-process-config", own),
                                 "bcg", 0.7)
    assert flags.count("--max-total-tokens") == 1 and "2048" in flags
    assert flags.count("--mm-process-config") == 1 and own in flags
    gpu = servers.SglangSettings(model="/ckpt", max_new_tokens=8, run_dir=tmp_path)
    assert "--device" not in servers.server_flags(gpu, "bcg", 0.7)
    assert "--mm-process-config" not in servers.server_flags(gpu, "bcg", 0.7)  # SGLang's own defaults on a GPU
    with pytest.raises(UsageError, match="--device"):
        servers.split_user_args(["--device cpu"])


def test_the_standin_is_on_the_servers_path_only(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("PYTHONPATH", "/users/own")
    channel = TapChannel(tmp_path / "tap")
    env = servers.server_env(channel, servers.Placement(None, 0.7), cpu_settings(tmp_path, threads=2,
                             fix=deepstack_slot.FIX), tmp_path / "calls.jsonl")
    assert env["PYTHONPATH"] == os.pathsep.join([str(kernel_standin.STANDIN_DIR), "/users/own"])
    assert env["SGLANG_USE_CPU_ENGINE"] == "1" and env[cpu_patches.ENV_GRAPH] == "emulated"
    assert env["OMP_NUM_THREADS"] == env["OPENBLAS_NUM_THREADS"] == "2"
    assert env[deepstack_slot.ENV_FIX] == "deepstack-slot"
    assert str(kernel_standin.STANDIN_DIR) not in os.environ["PYTHONPATH"]  # parity's own process: untouched
    assert not (kernel_standin.STANDIN_DIR / "sgl_kernel" / "__init__.py").read_text().count("import torch")
    gpu = servers.server_env(channel, servers.Placement(None, 0.7),
                             servers.SglangSettings(model="/ckpt", max_new_tokens=8, run_dir=tmp_path))
    assert "PYTHONPATH" not in gpu and cpu_patches.ENV_CPU not in gpu


@pytest.mark.parametrize("device, asked, resolved", [
    ("cpu", "auto", "emulated"), ("cpu", "emulated", "emulated"), ("cuda", "auto", "cuda"), ("cuda", "cuda", "cuda")])
def test_the_graph_backend_follows_the_device(device, asked, resolved) -> None:
    assert resolve_graph_backend("sglang", device, asked) == resolved


def test_choices_that_cannot_work_on_a_cpu_are_refused(tmp_path: Path, tiny_parts, monkeypatch) -> None:
    for device, asked in (("cpu", "cuda"), ("cuda", "emulated")):
        with pytest.raises(UsageError, match="--graph-backend"):
            resolve_graph_backend("sglang", device, asked)
    with pytest.raises(UsageError, match="one after the other"):
        make_backend(tmp_path, tiny_parts, device="cpu")  # make_backend asks for --concurrent
    with pytest.raises(UsageError, match="unknown SGLang fix"):
        make_backend(tmp_path, tiny_parts, concurrent=False, fix="deepstack-slots")
    monkeypatch.setattr(deepstack_slot, "installed_sglang", lambda: "0.5.24")
    with pytest.raises(BackendUnavailableError, match="validated on SGLang 0.5.23's prefill.*has SGLang 0.5.24"):
        server_checks.check_fix_version(deepstack_slot.FIX)
    server_checks.check_fix_version(None)


def test_on_a_cpu_only_the_buckets_the_run_needs_are_captured(tmp_path: Path, tiny_parts) -> None:
    backend = make_backend(tmp_path, tiny_parts, concurrent=False, device="cpu")
    backend.prepare(("eager", "bcg"), [39, 12])
    assert backend.server_facts.max_bucket == 64  # 39 + 6 teacher-forced tokens, with room for them twice
    assert backend.server_facts.prefill_buckets[:3] == (4, 8, 12)  # the ladder below it, as a server has it
    given = make_backend(tmp_path, tiny_parts, concurrent=False, device="cpu",
                         sglang_args=("--cuda-graph-bs-prefill", "64"))
    given.prepare(("eager", "bcg"), [39])
    assert given.server_facts.prefill_buckets == (64,)


def test_presets_are_saved_once_as_checkpoint_folders(tmp_path: Path, tiny) -> None:
    from parity.models.preset_checkpoint import saved_preset
    from transformers import AutoConfig

    folder = saved_preset("tiny-qwen3-vl", root=tmp_path)
    assert folder.parent == tmp_path / "checkpoints" and (folder / "model.safetensors").is_file()
    config = AutoConfig.from_pretrained(folder)
    assert config.vision_config.deepstack_visual_indexes == tiny.adapter.model.config.vision_config.deepstack_visual_indexes
    stamp = (folder / "config.json").stat().st_mtime_ns
    assert saved_preset("tiny-qwen3-vl", root=tmp_path) == folder and (folder / "config.json").stat().st_mtime_ns == stamp
    assert saved_preset("tiny-qwen3-vl", seed=1, root=tmp_path) != folder
    assert not [p for p in folder.parent.iterdir() if p.name.startswith(".")]  # no staging folder left


# --- the fix in the server -------------------------------------------------------------------------------

def test_the_fix_is_off_unless_asked_and_refuses_other_versions(tmp_path: Path, monkeypatch) -> None:
    assert deepstack_slot.activate({}, tmp_path) is None and not fix_records.read_records(tmp_path)
    monkeypatch.setattr(deepstack_slot, "installed_sglang", lambda: "0.5.24")
    assert deepstack_slot.activate({deepstack_slot.ENV_FIX: deepstack_slot.FIX}, tmp_path) is None
    assert deepstack_slot.activate({deepstack_slot.ENV_FIX: "slot"}, tmp_path) is None
    refused = fix_records.read_records(tmp_path)
    assert [r.refused for r in refused] == [True, True]
    assert "this is SGLang 0.5.24" in refused[0].note and "unknown variant 'slot'" in refused[1].note
    problem, _ = server_checks.fix_problem(tmp_path, deepstack_slot.FIX, "eager")
    assert "refused to install: validated on SGLang 0.5.23" in problem
    monkeypatch.setattr(deepstack_slot, "installed_sglang", lambda: "0.5.23")
    fix = deepstack_slot.activate({deepstack_slot.ENV_FIX: deepstack_slot.NO_CLEAR}, None)
    assert fix is not None and not fix.clears


def test_a_bcg_server_without_a_slot_fails_the_fix_check(tmp_path: Path) -> None:
    record = fix_records.FixRecord(1, deepstack_slot.FIX, None, None, "no slot: the model has 0 DeepStack blocks")
    fix_records.append_record(tmp_path, record)
    problem, records = server_checks.fix_problem(tmp_path, deepstack_slot.FIX, "bcg")
    assert "has no DeepStack slot: no slot: the model has 0 DeepStack blocks" in problem and len(records) == 1
    assert server_checks.fix_problem(tmp_path, deepstack_slot.FIX, "eager")[0] is None
    assert server_checks.fix_problem(tmp_path, None, "bcg") == (None, [])
    fix_records.append_record(tmp_path, fix_records.FixRecord(2, deepstack_slot.FIX, (64, 192), "torch.float32", "",
                                                              captures=3, reads=3))
    assert server_checks.fix_problem(tmp_path, deepstack_slot.FIX, "bcg")[0] is None
    assert fix_records.FixRecord.from_json(json.loads(json.dumps(record.to_json()))) == record


def test_the_dtype_check_compares_what_the_model_runs_in() -> None:
    assert server_checks.dtype_problem("torch.float16", "float32") == (
        "the model runs in torch.float16, not the float32 parity asked for with --dtype")
    assert server_checks.dtype_problem("torch.float32", "float32") is None
    assert server_checks.dtype_problem("torch.float16", None) is None


# --- a CPU server's checks, against the stand-in server ----------------------------------------------------

@pytest.fixture(scope="module")
def tiny_parts():
    from parity.models.tiny import build_config, build_processor, build_tokenizer
    from parity.presets import PRESETS

    tokenizer = build_tokenizer()
    return build_processor(tokenizer), build_config(PRESETS["tiny-qwen3-vl"], tokenizer)


@pytest.mark.parametrize("when", ["startup", "request"])
def test_a_standin_op_called_in_the_server_is_an_error_naming_it(tmp_path: Path, tiny_parts, when) -> None:
    backend = make_backend(tmp_path, tiny_parts, "--standin-kernel-call", "sgl_kernel.rotary_embedding_cpu",
                           "--standin-kernel-call-on", when, concurrent=False, device="cpu")
    result = run(backend)
    assert result.verdict.code == "ERROR", result.verdict.reason
    for arm in four_arms(result).values():
        assert "stand-in op sgl_kernel.rotary_embedding_cpu was called" in arm.error, arm.error
    assert "BCG replay fault" not in four_arms(result)["bcg_normal"].error  # the op is the cause, not the graph
    assert_nothing_left(tmp_path)


@pytest.mark.skipif(deepstack_slot.installed_sglang() in sglang_versions.fix_accepted(),
                    reason="the fix installs in SGLang 0.5.23; its refusal needs another version")
def test_a_fix_that_refuses_to_install_in_the_server_is_an_error(tmp_path: Path, tiny_parts) -> None:
    result = run(make_backend(tmp_path, tiny_parts, concurrent=False, device="cpu", fix=deepstack_slot.FIX))
    assert result.verdict.code == "ERROR", result.verdict.reason
    assert "deepstack-slot fix refused to install: validated on SGLang 0.5.23" in four_arms(result)["bcg_normal"].error
    assert result.config["sglang_fix"] == "deepstack-slot"
    assert_nothing_left(tmp_path)


def test_another_launch_command_through_the_variable_skips_the_sglang_checks(parity_cli, tmp_path: Path, tiny) -> None:
    # No SGLang needed: the variable names the stand-in server, the preset is served from its folder.

    image_token = tiny.adapter.processor.tokenizer.convert_tokens_to_ids(tiny.adapter.processor.image_token)
    launch = f"{sys.executable} {SGLANG_STANDIN} --standin-image-token-id {image_token} --standin-deepstack-replay"
    result = parity_cli("run", "--backend", "sglang", "--device", "cpu", "--max-new-tokens", "4", "--no-plot",
                        "--out", str(tmp_path / "run"), "--sglang-arg", "--cuda-graph-max-bs-prefill 256",
                        env={sglang_backend.LAUNCH_COMMAND_ENV: launch, "PARITY_CACHE_DIR": str(tmp_path / "cache")})
    assert result.exit_code == 0, result.output[-2000:]
    doc = json.loads((tmp_path / "run" / "results.json").read_text())
    assert doc["verdict"]["code"] == "PASS" and doc["config"]["model"] == "tiny-qwen3-vl"
    assert (doc["config"]["sglang_device"], doc["config"]["sglang_graph_backend"]) == ("cpu", "emulated")
    assert doc["environment"]["gpu"] is None
    served = doc["config"]["sglang_servers"]["bcg"]
    assert served[served.index("--model-path") + 1].startswith(str(tmp_path / "cache" / "checkpoints"))
    assert "--dtype" in served and served[served.index("--dtype") + 1] == "float32"  # explicit on a CPU
    assert "torch_native" in served and "--enable-deterministic-inference" not in served
    assert_nothing_left(tmp_path / "run")
