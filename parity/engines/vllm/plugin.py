"""parity's vLLM plugin: the `vllm.general_plugins` entry point that installs the tap (`tap.py`).

vLLM calls `register()` in every process that loads plugins: the API server, the engine core and
each worker (docs/engines/vllm-0.33.md §5.1). It does nothing unless `PARITY_VLLM_TAP` names a channel folder
or `PARITY_VLLM_FIX` asks for parity's DeepStack clear fix (`deepstack_clear.py`), so installing
parity next to a production server changes nothing. When set, it arranges for three
vLLM classes to be wrapped when their modules are imported, not before (parity/engines/after_import.py):
importing a model module may initialise CUDA, and only the process that runs the model imports these
at all. A module already imported is wrapped at once. Wrapping is idempotent.

A "plugin loaded" marker would prove nothing (the API server loads plugins too, and vLLM only
logs a plugin that fails to load): the proof that the tap works is a record written by the model
process for the request itself.

Standard library only at import time: vLLM imports this in every process.
"""

from __future__ import annotations

import functools
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Mapping

from parity.engines.after_import import after_import, around
from parity.engines.channel import TapChannel
from parity.engines.vllm import deepstack_clear, planted, versions

ENV_VAR = "PARITY_VLLM_TAP"
ENTRY_POINT_GROUP = "vllm.general_plugins"
ENTRY_POINT_NAME = "parity"
MODELS_PACKAGE = "vllm.model_executor.models."
# The methods that write a step's DeepStack: a buffered model's setter, MossAudio's attribute cache.
SETTERS = ("_set_deepstack_input_embeds", "_cache_deepstack_input_embeds")


@dataclass(frozen=True)
class Target:
    """A method of a vLLM class that the tap wraps."""

    module: str
    cls: str
    method: str
    wrapper: str | None  # the name of the wrapping function in parity.engines.vllm.tap (None: the fix's alone)
    fix_wrapper: str | None = None  # and in parity.engines.vllm.deepstack_clear (or `planted.NAME`), where the fix wraps it

    @property
    def of_a_model(self) -> bool:
        """A model class's method: wrapped only where that model's module is imported (the served one)."""
        return self.module.startswith(MODELS_PACKAGE)


# What the tap wraps in Model Runner V2, the same in every supported release (versions.py);
# tests/engines/test_vllm_real.py checks each one against the installed vLLM.
TARGETS = (
    Target("vllm.v1.worker.gpu.cudagraph_utils", "CudaGraphManager", "dispatch", "wrap_dispatch"),
    Target("vllm.v1.worker.gpu.cudagraph_utils", "CudaGraphManager", "capture", "wrap_capture"),
    # The freshness witness (freshness.py): the buffers the graphs read, a step's write window, its replay.
    Target("vllm.v1.worker.gpu.cudagraph_utils", "ModelCudaGraphManager", "capture", "wrap_model_capture"),
    Target("vllm.v1.worker.gpu.cudagraph_utils", "CudaGraphManager", "run_fullgraph", "wrap_replay"),
    Target("vllm.v1.worker.gpu.cudagraph_utils", "CudaGraphManager", "run_pw_graph", "wrap_replay"),
    Target("vllm.v1.worker.gpu.model_runner", "GPUModelRunner", "execute_model", "wrap_execute"),
    # Refresh bugs planted for the witness to catch (planted.py; test-only variants of the fix).
    Target("vllm.v1.worker.gpu.mm.rope", "RopeState", "prepare_positions", None, "planted.wrap_rope_positions"),
    Target("vllm.v1.worker.gpu.mm.encoder_runner", "EncoderRunner", "get_inputs_embeds", None,
           "planted.wrap_inputs_embeds"),
    Target("vllm.v1.worker.gpu.model_states.default", "DefaultModelState", "prepare_inputs_embeds", "wrap_step",
           "wrap_step"),
    # Every class that defines a DeepStack setter of its own (the audit lists them; the vLLM stage holds
    # this list to the installed registry): a subclass (Qwen3-VL-MoE, ClefOmni) inherits the wrapped one.
    *(Target(f"{MODELS_PACKAGE}{module}", cls, SETTERS[0], "wrap_setter", "wrap_setter")
      for module, cls in (("qwen3_vl", "Qwen3VLForConditionalGeneration"),
                          ("qwen3_omni_moe_thinker", "Qwen3OmniMoeThinkerForConditionalGeneration"),
                          ("cohere_compass", "CohereCompassForConditionalGeneration"))),
    # DeepStack kept as a per-step attribute (MossAudio's audio): the fix gives it a slot the graphs read.
    Target(f"{MODELS_PACKAGE}moss_audio", "MossAudioModel", "__init__", None, "wrap_attribute_owner"),
    Target(f"{MODELS_PACKAGE}moss_audio", "MossAudioModel", SETTERS[1], None, "wrap_attribute_setter"),
    Target(f"{MODELS_PACKAGE}moss_audio", "MossAudioModel", "forward", None, "wrap_attribute_forward"),
)

# vLLM's model runners, by module: the tap wraps V2 only, so which one a server built is recorded
# where parity reads it (RUNNER_FILE), as evidence independent of vLLM's logging. V1 exists only in
# the releases whose table row names it (0.34 removed it).
RUNNERS = {"vllm.v1.worker.gpu.model_runner": "V2", **{r.v1_runner: "V1" for r in versions.RELEASES if r.v1_runner}}
RUNNER_FILE = "runner.jsonl"
RUNNER_FLAG = "__parity_runner__"

_TAP = None  # this process's StepTap, once activated
_FIX = None  # this process's DeepStackClear, when parity asked for the fix
_FIX_ASKED = False


def activate(environ: Mapping[str, str] = os.environ):
    """This process's tap (a `parity.engines.vllm.tap.StepTap`), or None when parity's variable is not set."""
    global _TAP
    folder = environ.get(ENV_VAR)
    if not folder:
        return None
    if _TAP is None:
        from parity.engines.vllm.tap import StepTap

        _TAP = StepTap(TapChannel(Path(folder)))
    return _TAP


def activate_fix(environ: Mapping[str, str] = os.environ):
    """This process's DeepStack clear fix (`deepstack_clear.py`), or None unless PARITY_VLLM_FIX asks
    for it; a refusal (another vLLM) is recorded in the channel folder for parity to read."""
    global _FIX, _FIX_ASKED
    if not _FIX_ASKED and environ.get(deepstack_clear.ENV_FIX):
        _FIX_ASKED = True  # once per process: a refusal is recorded once, however often vLLM registers
        folder = environ.get(ENV_VAR)
        _FIX = deepstack_clear.activate(environ, Path(folder) if folder else None)
    return _FIX


def register() -> None:
    """vLLM general-plugin entry point: inert unless PARITY_VLLM_TAP or PARITY_VLLM_FIX is set. vLLM
    may call it more than once in a process; each module is wrapped once, when it has executed (now,
    if it has)."""
    tap, fix = activate(), activate_fix()  # both: the fix must not depend on whether the tap is armed
    if tap is None and fix is None:
        return
    for name in dict.fromkeys(t.module for t in TARGETS):
        after_import(name, _wrapping(name))
    folder = os.environ.get(ENV_VAR)
    if folder:
        for name, runner in RUNNERS.items():
            after_import(name, _recording_runner(runner, folder))


@functools.lru_cache(maxsize=None)
def _recording_runner(runner: str, folder: str):
    """The patch that makes `GPUModelRunner.__init__` of `runner`'s module record its construction."""
    def patch(module: ModuleType) -> None:
        cls = getattr(module, "GPUModelRunner", None)
        if cls is None or getattr(cls.__init__, RUNNER_FLAG, False):
            return

        def record(original, runner_self, *args, **kwargs):
            with open(Path(folder) / RUNNER_FILE, "a", encoding="utf-8") as out:
                out.write(json.dumps({"runner": runner, "pid": os.getpid(), "class": type(runner_self).__name__}) + "\n")
            return original(runner_self, *args, **kwargs)

        cls.__init__ = around(cls.__init__, record, RUNNER_FLAG)

    return patch


def runners(folder: Path) -> list[dict]:
    """The model runners the server's processes built, as recorded (parity's side)."""
    try:
        lines = (folder / RUNNER_FILE).read_text(encoding="utf-8").splitlines()
    except FileNotFoundError:
        return []
    found = []
    for line in lines:
        try:
            found.append(json.loads(line))
        except ValueError:
            continue
    return found


@functools.lru_cache(maxsize=None)
def _wrapping(module_name: str):
    """The one patch of a target module (cached: registering twice registers it once)."""
    def patch(module: ModuleType) -> None:
        for target in TARGETS:
            if target.module == module_name:
                wrap(module, target, _TAP, _FIX)

    return patch


def wrap(module: ModuleType, target: Target, tap, fix=None) -> None:
    """Replace `target`'s method in `module` with the tap's wrapper around it (once); with the fix,
    the fix wraps the method first, so the tap records what the step reads after the fix."""
    from parity.engines.vllm import tap as taps

    original = getattr(getattr(module, target.cls, None), "__dict__", {}).get(target.method)
    if original is None:
        # Another vLLM than the tap knows: serve on, untapped; parity's probe then fails the run
        # with "the tap never fired", and this line in the server's log says why.
        print(f"parity: {target.module}.{target.cls}.{target.method} not found; the tap is not installed there "
              f"(parity's vLLM tap knows vLLM {versions.supported()})", file=sys.stderr, flush=True)
        return
    cls = getattr(module, target.cls)
    if fix is not None and target.fix_wrapper and not deepstack_clear.is_fixed(original):
        source, _, name = target.fix_wrapper.rpartition(".")
        fixed = getattr(planted if source == "planted" else deepstack_clear, name)(original, fix)
        if fixed is not original:  # a planted bug wraps only where its variant runs
            original = fixed
            setattr(cls, target.method, original)
            fix.installed(f"{target.cls}.{target.method}")
    if tap is not None and target.wrapper and not getattr(original, taps.WRAPPED_FLAG, False):
        setattr(cls, target.method, getattr(taps, target.wrapper)(original, tap))
