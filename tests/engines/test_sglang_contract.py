"""Contract with the real SGLang release: every name the plugin hooks and every flag the launcher
passes exists in the sglang 0.5.23 wheel, with the layout parity relies on.

The wheel is read as files (zip + ast), never imported: SGLang needs a GPU stack. It is fetched
once with `pip download` into a cache folder outside the checkout (`PARITY_CACHE_DIR`, default
`~/.cache/parity`). The tests carry the `network` marker: the default suite deselects them (pytest
counts them as deselected), `.ci/run` runs them with `-m network`, and there an unreachable package
index fails them, never skips them.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import pytest

from parity.engines.sglang import versions as sglang_versions
from parity.arms import MODES
from parity.design import SERVER_PROFILES
from parity.engines.sglang import cpu_patches, deepstack_slot, planted, plugin, servers
from parity.engines.sglang import freshness as sglang_freshness

SGLANG_VERSION = sglang_versions.NEWEST.version  # what CI's SGLang stage installs
pytestmark = pytest.mark.network
_UNREACHABLE = ("NewConnectionError", "Max retries exceeded", "Temporary failure in name resolution",
                "Network is unreachable", "Connection refused", "ProxyError", "timed out")


# --- the wheel as source files -------------------------------------------------------------------------

def _cache_dir() -> Path:
    return Path(os.environ.get("PARITY_CACHE_DIR", Path.home() / ".cache" / "parity")) / "wheels"


def fetch_wheel() -> Path:
    folder = _cache_dir()
    cached = sorted(folder.glob(f"sglang-{SGLANG_VERSION}-*.whl"))
    if cached:
        return cached[0]
    folder.mkdir(parents=True, exist_ok=True)
    # The release ships one CPython 3.11 manylinux wheel; ask for exactly it, whatever runs pip.
    command = [sys.executable, "-m", "pip", "download", f"sglang=={SGLANG_VERSION}", "--no-deps",
               "--only-binary=:all:", "--python-version", "3.11", "--implementation", "cp",
               "--platform", "manylinux_2_34_x86_64", "--dest", str(folder), "--quiet",
               "--timeout", "30", "--retries", "1"]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    except subprocess.TimeoutExpired:
        pytest.fail("the package index did not answer within 10 minutes; cannot fetch sglang's wheel")
    output = done.stdout + done.stderr
    if done.returncode != 0 and any(marker in output for marker in _UNREACHABLE):
        pytest.fail(f"the package index cannot be reached, so sglang=={SGLANG_VERSION} cannot be checked")
    assert done.returncode == 0, f"pip download sglang=={SGLANG_VERSION} failed:\n{output[-2000:]}"
    return sorted(folder.glob(f"sglang-{SGLANG_VERSION}-*.whl"))[0]


@dataclass
class Source:
    """The wheel's Python files, parsed on demand."""

    wheel: zipfile.ZipFile

    def text(self, path: str) -> str | None:
        try:
            return self.wheel.read(path).decode()
        except KeyError:
            return None

    def tree(self, path: str) -> ast.Module | None:
        text = self.text(path)
        return ast.parse(text) if text is not None else None

    @cached_property
    def cli_flags(self) -> dict[str, ast.expr]:
        """Every `--flag` ServerArgs declares, with its field annotation (docs/engines/sglang-0.5.23.md §1.1: `_` becomes `-`)."""
        flags: dict[str, ast.expr] = {}
        for name in self.wheel.namelist():
            if name.startswith("sglang/srt/arg_groups/fields/") and name.endswith(".py"):
                flags.update(_field_flags(self.tree(name)))
        for node in ast.walk(self.tree("sglang/srt/server_args.py") or ast.Module(body=[], type_ignores=[])):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.startswith("--"):
                flags.setdefault(node.value, node)  # flags registered by hand (deprecated ones)
        return flags


def _field_flags(tree: ast.Module | None) -> dict[str, ast.expr]:
    flags: dict[str, ast.expr] = {}
    for cls in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)) if tree else ():
        for stmt in cls.body:
            if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
                names = _keyword_strings(stmt.annotation, "cli_name") or ["--" + stmt.target.id.replace("_", "-")]
                for flag in names + _keyword_strings(stmt.annotation, "aliases"):
                    flags[flag] = stmt.annotation
    return flags


def _keyword_strings(node: ast.AST, keyword: str) -> list[str]:
    for call in (n for n in ast.walk(node) if isinstance(n, ast.Call)):
        for kw in call.keywords:
            if kw.arg == keyword:
                return [c.value for c in ast.walk(kw.value) if isinstance(c, ast.Constant) and isinstance(c.value, str)]
    return []


def _literal_strings(annotation: ast.expr) -> set[str]:
    literals: set[str] = set()
    for sub in (n for n in ast.walk(annotation) if isinstance(n, ast.Subscript)):
        if isinstance(sub.value, ast.Name) and sub.value.id == "Literal":
            literals |= {c.value for c in ast.walk(sub.slice) if isinstance(c, ast.Constant)}
    return literals


def _module_path(dotted: str) -> str:
    return dotted.replace(".", "/") + ".py"


def _function(tree: ast.Module, name: str) -> ast.FunctionDef | None:
    return next((n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == name), None)


def _class(tree: ast.Module, name: str) -> ast.ClassDef | None:
    return next((n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == name), None)


# --- the checks (each returns the problems it found; empty means the contract holds) ---------------------

def check_hook_target(src: Source, target: str, positions: tuple[tuple[int, str], ...], key: str) -> list[str]:
    """The function exists, its parameters sit where the hook reads them, its dict gets `key`,
    and its in-package callers pass that dict positionally at the same index."""
    module, _, name = target.rpartition(".")
    tree = src.tree(_module_path(module))
    if tree is None:
        return [f"module {module} is not in the wheel"]
    function = _function(tree, name)
    if function is None:
        return [f"{target} is not defined"]
    params = [a.arg for a in function.args.args]
    problems = [f"{target} parameter {index} is {params[index] if index < len(params) else None!r}, "
                f"hook expects {expected!r}"
                for index, expected in positions if index >= len(params) or params[index] != expected]
    dict_name = params[plugin.KWARGS_ARG[0]] if len(params) > plugin.KWARGS_ARG[0] else None
    if not any(isinstance(n, ast.Subscript) and isinstance(n.value, ast.Name) and n.value.id == dict_name
               and isinstance(n.slice, ast.Constant) and n.slice.value == key and isinstance(n.ctx, ast.Store)
               for n in ast.walk(function)):
        problems.append(f"{target} never stores {key!r} into its {dict_name!r} dict")
    calls = [n for n in ast.walk(tree)
             if isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id == name]
    if not calls:
        problems.append(f"nothing in {module} calls {name}")
    for call in calls:
        if len(call.args) <= plugin.KWARGS_ARG[0] and plugin.KWARGS_ARG[1] not in {k.arg for k in call.keywords}:
            problems.append(f"a call of {name} at line {call.lineno} does not pass the kwargs dict "
                            "where the hook reads it")
    return problems


def check_replay_marker(src: Source, runner_module: str, name: str) -> list[str]:
    """BCG installs a function called `name` as the LM instance's forward before the eager outer forward."""
    tree = src.tree(_module_path(runner_module))
    if tree is None:
        return [f"module {runner_module} is not in the wheel"]
    defined = any(isinstance(n, ast.FunctionDef) and n.name == name for n in ast.walk(tree))
    installed = any(isinstance(n, ast.Assign) and isinstance(n.value, ast.Name) and n.value.id == name
                    and any(isinstance(t, ast.Attribute) and t.attr == "forward" for t in n.targets)
                    for n in ast.walk(tree))
    return [] if defined and installed else [f"{runner_module} no longer installs {name} as the LM's forward"]


def check_dataclass_field(src: Source, module: str, cls_name: str, field: str) -> list[str]:
    tree = src.tree(_module_path(module))
    cls = _class(tree, cls_name) if tree else None
    if cls is None:
        return [f"{module}.{cls_name} is not defined"]
    names = {s.target.id for s in cls.body if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)}
    return [] if field in names else [f"{module}.{cls_name} has no field {field!r}"]


def check_plugin_api(src: Source, group: str) -> list[str]:
    problems = []
    tree = src.tree("sglang/srt/plugins/__init__.py")
    groups = {t.id: n.value.value for n in ast.walk(tree) if isinstance(n, ast.Assign)
              for t in n.targets if isinstance(t, ast.Name) and isinstance(n.value, ast.Constant)} if tree else {}
    if groups.get("GENERAL_PLUGINS_GROUP") != group:
        found = groups.get("GENERAL_PLUGINS_GROUP")
        problems.append(f"SGLang's general plugin group is {found!r}, parity uses {group!r}")
    registry = src.tree("sglang/srt/plugins/hook_registry.py")
    hook_type = _class(registry, "HookType") if registry else None
    members = {t.id for s in (hook_type.body if hook_type else []) if isinstance(s, ast.Assign) for t in s.targets
               if isinstance(t, ast.Name)}
    if "AFTER" not in members:
        problems.append("hook_registry.HookType has no AFTER")
    hook_registry = _class(registry, "HookRegistry") if registry else None
    register = next((f for f in (hook_registry.body if hook_registry else []) if isinstance(f, ast.FunctionDef)
                     and f.name == "register"), None)
    if register is None or [a.arg for a in register.args.args][:4] != ["cls", "target", "hook", "hook_type"]:
        problems.append("HookRegistry.register(target, hook, hook_type) is gone")
    if "hook(result, *args, **kwargs)" not in (src.text("sglang/srt/plugins/hook_registry.py") or ""):
        problems.append("AFTER hooks are no longer called as hook(result, *args, **kwargs)")
    return problems


def check_flags(src: Source, flags: tuple[str, ...]) -> list[str]:
    """Every `--flag` exists; a value that follows it is one of the field's Literal choices, if any."""
    problems = []
    for i, flag in enumerate(flags):
        if not flag.startswith("--"):
            continue
        annotation = src.cli_flags.get(flag)
        if annotation is None:
            problems.append(f"SGLang {SGLANG_VERSION} has no flag {flag}")
            continue
        value = flags[i + 1] if i + 1 < len(flags) and not flags[i + 1].startswith("--") else None
        choices = _literal_strings(annotation) if isinstance(annotation, ast.expr) else set()
        if value is not None and choices and value not in choices:
            problems.append(f"{flag} {value}: not one of {sorted(choices)}")
    return problems


def check_list_member(src: Source, module: str, name: str, value: str) -> list[str]:
    """`value` appears in the module-level list literal `name` (choices kept outside the field)."""
    tree = src.tree(_module_path(module))
    for node in (tree.body if tree else []):
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in node.targets):
            members = {c.value for c in ast.walk(node.value) if isinstance(c, ast.Constant)}
            return [] if value in members else [f"{value!r} is not in {module}.{name}"]
    return [f"{module}.{name} is not defined"]


def check_callable(src: Source, target: str, params: tuple[str, ...]) -> list[str]:
    """`module.function` or `module.Class.method` exists and its first parameters are `params`."""
    parts = target.split(".")
    for split in (len(parts) - 1, len(parts) - 2):  # module.function, then module.Class.method
        tree = src.tree(_module_path(".".join(parts[:split])))
        if tree is None:
            continue
        owner = tree if split == len(parts) - 1 else _class(tree, parts[split])
        found = next((f for f in (owner.body if owner else []) if isinstance(f, ast.FunctionDef)
                      and f.name == parts[-1]), None)
        if found is None:
            return [f"{target} is not defined"]
        names = tuple(a.arg for a in found.args.args)[:len(params)]
        return [] if names == params else [f"{target} takes {names}, the hook expects {params}"]
    return [f"no module of {target} is in the wheel"]


def check_text(src: Source, module: str, *needles: str) -> list[str]:
    text = src.text(_module_path(module))
    if text is None:
        return [f"module {module} is not in the wheel"]
    return [f"{module} no longer contains {n!r}" for n in needles if n not in text]


def check_routes(src: Source, routes: tuple[str, ...]) -> list[str]:
    text = src.text("sglang/srt/entrypoints/http_server.py") or ""
    return [f"the HTTP server has no route {route}" for route in routes if f'"{route}"' not in text]


# --- tests -----------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def src() -> Source:
    return Source(zipfile.ZipFile(fetch_wheel()))


HOOK_POSITIONS = (plugin.INPUT_IDS_ARG, plugin.FORWARD_BATCH_ARG, plugin.LANGUAGE_MODEL_ARG, plugin.KWARGS_ARG)
RUNNER = "sglang.srt.model_executor.runner.prefill_cuda_graph_runner"


def test_hook_target_and_argument_layout(src: Source) -> None:
    assert check_hook_target(src, plugin.HOOK_TARGET, HOOK_POSITIONS, plugin.DEEPSTACK_KEY) == []


def test_replay_marker_and_raw_row_field(src: Source) -> None:
    assert check_replay_marker(src, RUNNER, plugin.REPLAY_FORWARD_NAME) == []
    for field in (plugin.RAW_LENGTHS_FIELD, plugin.FORWARD_MODE_FIELD):
        assert check_dataclass_field(src, "sglang.srt.model_executor.forward_batch_info", "ForwardBatch", field) == []


def test_entry_point_group_and_hook_api(src: Source) -> None:
    assert check_plugin_api(src, plugin.ENTRY_POINT_GROUP) == []
    assert "SGLANG_PLUGINS" in (src.text("sglang/srt/environ.py") or "")


def test_launcher_flags_exist(src: Source) -> None:
    settings = servers.SglangSettings(model="Qwen/Qwen3-VL-8B-Instruct", max_new_tokens=20, run_dir=Path("."))
    for mode in MODES:
        assert check_flags(src, servers.server_flags(settings, mode, 0.7)) == []
    assert check_flags(src, ("--host", "127.0.0.1", "--port", "30000", "--cuda-graph-max-bs-prefill", "512")) == []
    # The flags parity reads from --sglang-arg (servers.ServerFacts) exist under these names.
    assert check_flags(src, ("--cuda-graph-bs-prefill", "--cuda-graph-max-seq-len-prefill", "--chunked-prefill-size",
                             "--max-total-tokens", "--tp-size", "--tensor-parallel-size", "--pp-size",
                             "--pipeline-parallel-size", "--dp-size", "--data-parallel-size", "--context-length",
                             "--dtype")) == []
    assert check_routes(src, ("/ready", "/generate", "/server_info")) == []
    fa3 = servers.DETERMINISM_FLAGS[servers.DETERMINISM_FLAGS.index("--attention-backend") + 1]
    assert check_list_member(src, "sglang.srt.arg_groups.choices", "DETERMINISTIC_ATTENTION_BACKEND_CHOICES", fa3) == []


def test_response_fields_parity_reads(src: Source) -> None:
    text = src.text("sglang/srt/managers/tokenizer_manager.py") or ""
    for field in ("output_ids", "output_token_logprobs", "output_top_logprobs"):
        assert f'"{field}"' in text, field


# Negative controls: the checks must catch a misspelling, or the passes above prove nothing.

def test_misspelled_hook_target_is_caught(src: Source) -> None:
    problems = check_hook_target(src, "sglang.srt.managers.mm_utils.prepare_mm_input", HOOK_POSITIONS,
                                 plugin.DEEPSTACK_KEY)
    assert problems == ["sglang.srt.managers.mm_utils.prepare_mm_input is not defined"]
    assert check_hook_target(src, "sglang.srt.managers.mm_util.prepare_mm_inputs", HOOK_POSITIONS,
                             plugin.DEEPSTACK_KEY) == ["module sglang.srt.managers.mm_util is not in the wheel"]


def test_wrong_layout_key_and_marker_are_caught(src: Source) -> None:
    assert check_hook_target(src, plugin.HOOK_TARGET, ((2, "kwargs"),), plugin.DEEPSTACK_KEY)
    assert check_hook_target(src, plugin.HOOK_TARGET, HOOK_POSITIONS, "input_deepstack_embed")
    assert check_replay_marker(src, RUNNER, "replay_layers_forward")
    assert check_dataclass_field(src, "sglang.srt.model_executor.forward_batch_info", "ForwardBatch",
                                 "extend_seq_len_cpu")


def test_misspelled_group_flag_and_value_are_caught(src: Source) -> None:
    assert check_plugin_api(src, "sglang.srt.plugin")
    assert check_flags(src, ("--cuda-graph-backend-prefil", "breakable")) == [
        f"SGLang {SGLANG_VERSION} has no flag --cuda-graph-backend-prefil"]
    assert check_flags(src, ("--cuda-graph-backend-prefill", "breakabel"))
    assert check_routes(src, ("/readyz",))
    assert check_list_member(src, "sglang.srt.arg_groups.choices", "DETERMINISTIC_ATTENTION_BACKEND_CHOICES", "fa33")


# --- SGLang on a CPU: what the in-process changes and the fix plugin rely on ---------------------------------

FIX_PARAMS = {  # what each of the fix's hooks reads from the call it wraps
    "capture": ("self",),
    "run_forward": ("self", "forward_batch", "num_tokens"),
    "layer_kwargs": ("layer_model", "forward_batch", "pp_proxy_tensors"),
    "fill": ("self", "args", "layer_kwargs", "static_num_tokens"),
    "positions": ("self", "forward_batch"),
}


def test_the_fix_plugin_hooks_exist_with_their_parameters(src: Source) -> None:
    for key, target in deepstack_slot.TARGETS.items():
        assert check_callable(src, target, FIX_PARAMS[key]) == [], key
    # Capture binds through the kwargs builder, replay refreshes where the input_embeds slot is filled.
    assert check_text(src, deepstack_slot.RUNNER_MODULE, "_build_layer_model_forward_kwargs(",
                      "self._fill_input_embeds_slot(args, layer_kwargs, static_num_tokens)",
                      "num_deepstack_embeddings", "def _uses_eager_prefill_tail") == []


def test_the_freshness_witness_and_the_planted_refreshes_hook_what_exists(src: Source) -> None:
    witness = {"capture_one_shape": ("self", "size"), "execute": ("self", "forward_batch"),
               "fill": ("self", "args", "layer_kwargs", "static_num_tokens")}
    for key, target in sglang_freshness.TARGETS.items():
        assert check_callable(src, target, witness[key]) == [], key
    assert check_callable(src, planted.TARGETS["fill_from"], ("self", "forward_batch")) == []
    assert check_callable(src, planted.TARGETS["load_batch"], ("self", "forward_batch")) == []
    # What the witness reads: the registry's slots, the backend's replay of a bucket, the prefix variant's label.
    assert check_text(src, deepstack_slot.RUNNER_MODULE, "self.backend.replay(shape_key, static_forward_batch",
                      "def _chunked_prefix_variant(", "self.buffer_registry.fill_from(",
                      "def capture_one_shape(self, size: int, *, prefix_num_chunks: int = 0)") == []
    assert check_text(src, "sglang.srt.model_executor.cuda_graph_buffer_registry", "def slot_names(",
                      "def get_slot(", "padded_num_tokens: int,", "skip_slots: frozenset = frozenset(),") == []


def test_what_the_family_scenarios_read_is_there(src: Source) -> None:
    # The warm-up proof (buckets captured at start-up), the prefix cache's emptying and its count.
    assert check_callable(src, plugin.CAPTURE_TARGET, ("self",)) == []
    assert check_text(src, deepstack_slot.RUNNER_MODULE, f"self.{plugin.CAPTURED_FIELD} = ") == []
    assert check_routes(src, (servers.CACHE_FLUSH_PATH,)) == []
    assert check_text(src, "sglang.srt.managers.tokenizer_manager", '"cached_tokens"') == []


def test_what_the_cpu_changes_replace_is_still_there(src: Source) -> None:
    assert check_text(src, cpu_patches.ATTENTION_HOOK, f'"{cpu_patches.ATTENTION_COMPATIBILITY_SOURCE}"',
                      'attention_backend == "torch_native"', "declare_resolution", "resolving_view") == []
    assert check_callable(src, f"{cpu_patches.DEVICE_UTILS}.{cpu_patches.STREAM_FUNCTION}", ()) == []
    breakable = "sglang.srt.model_executor.runner_backend_utils.breakable_cuda_graph.breakable_cuda_graph"
    assert check_text(src, breakable, "else torch.cuda.CUDAGraph", "graph.capture_begin(", "graph.capture_end()") == []
    assert check_text(src, "sglang.srt.model_executor.runner_utils.pool", "device_module.graph_pool_handle()") == []


def test_cpu_server_flags_exist(src: Source) -> None:
    settings = servers.SglangSettings(model="/ckpt", max_new_tokens=20, run_dir=Path("."), device="cpu",
                                      graph_backend="emulated")
    for mode in MODES:
        for profile in SERVER_PROFILES:  # each family scenario's servers (design §10)
            assert check_flags(src, servers.server_flags(settings, mode, 0.7, profile)) == []
    assert "SGLANG_USE_CPU_ENGINE" in (src.text("sglang/srt/utils/common.py") or "")


def test_misspelled_fix_targets_and_cpu_names_are_caught(src: Source) -> None:
    assert check_callable(src, f"{deepstack_slot.RUNNER_CLASS}._fill_input_embed_slot", ()) == [
        f"{deepstack_slot.RUNNER_CLASS}._fill_input_embed_slot is not defined"]
    assert check_callable(src, deepstack_slot.TARGETS["run_forward"], ("self", "num_tokens"))
    assert check_callable(src, "sglang.srt.no_such_module.f", ()) == ["no module of sglang.srt.no_such_module.f is in the wheel"]
    assert check_text(src, cpu_patches.ATTENTION_HOOK, '"_handle_attention_backend_compat"')
