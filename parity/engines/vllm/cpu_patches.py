"""What parity changes, in-process, in the vLLM servers it starts on a CPU (docs/engines/vllm-cpu.md).

Installed by parity's start-up hook (parity/engines/vllm/standin/sitecustomize.py) in every server
process, only when parity sets `PARITY_VLLM_CPU`; no vLLM file is edited. Each change is applied
right after its module executes (parity/engines/after_import.py), so a later `from X import f`
binds the changed name. Always (§2):

- the CPU build's compiled ops answer from torch-native stand-ins (`cpu_ops.py`), and the CPU attention
  backend takes the KV block sizes the stand-in attention pages at (any; declared as GPU attention's
  multiples of 16, where vLLM's C++ kernel wanted 32: the prefix profile's blocks, design §10);
- Triton counts as present (`HAS_TRITON`), so vLLM keeps Model Runner V2, the runner parity's tap
  wraps, instead of falling back to V1; parity runs the servers with `TRITON_INTERPRET=1`, so V2's
  Triton kernels run on CPU tensors.

With `PARITY_VLLM_GRAPH=emulated`, vLLM's own `CudaGraphManager` (FULL) and breakable wrapper
capture and replay through parity's emulated graph (§3, gates 6-13):

1. the CPU platform supports static graphs, keeps the capture sizes it was given, and calls
   attention directly (not through the opaque op, whose body reads a forward context that a
   replay does not have), so the recorder sees attention's own ops on the persistent metadata;
2. the CPU attention builder claims graph support for every batch: the stand-in attention reads
   every bound from tensors when it runs, as FA3 does;
3. the CPU worker captures (it never calls `capture_model`), with a workspace manager and CPU
   stand-ins for the streams, the pool and `torch.cuda.graph`; `torch.cuda.CUDAGraph` is the
   emulation (parity/runner/emulated_graph.py).

With `PARITY_VLLM_COMPILE=eager` as well, the piecewise modes replay (§6, 15-17): vLLM's own
piecewise compile is kept (the platform would turn it into a whole-model trace), its
`CUDAGraphWrapper` pieces capture through the same emulation, attention stays the opaque op they
split at, and a graph replays under the forward context it captured in (`graphs_keep_forward_context`).
"""

from __future__ import annotations

import contextlib
import os
import threading
import types
from typing import Any, Mapping

from parity.engines.after_import import after_import, around

ENV_CPU = "PARITY_VLLM_CPU"
ENV_GRAPH = "PARITY_VLLM_GRAPH"
GRAPH_EMULATED = "emulated"
ENV_COMPILE = "PARITY_VLLM_COMPILE"
COMPILE_EAGER = "eager"
PATCHED = "__parity_vllm_cpu__"

TRITON_IMPORTING = "vllm.triton_utils.importing"
CPU_PLATFORM = "vllm.platforms.cpu"
CPU_ATTENTION = "vllm.v1.attention.backends.cpu_attn"
CPU_WORKER = "vllm.v1.worker.cpu_worker"
GRAPH_MANAGER = "vllm.v1.worker.gpu.cudagraph_utils"
GRAPH_WRAPPER = "vllm.compilation.cuda_graph"
FORWARD_CONTEXT = "vllm.forward_context"
STANDIN_BLOCK_MULTIPLE = 16  # what GPU attention takes; the stand-in attention pages at any size


# The line a server's log shows when a patch target is not where parity expects it: a vLLM newer than
# the releases parity knows (versions.py). The backend puts it first in the run's error.
MISSING = "parity: a vLLM patch target is missing:"


class MissingTarget(AttributeError):
    """A module parity patches lacks what the patch changes: another vLLM than parity knows."""


def target(module: types.ModuleType, path: str) -> Any:
    """`module.<path>` (dotted attributes), or `MissingTarget` naming it, the installed vLLM and the
    releases parity supports, instead of a traceback deep in vLLM's start-up."""
    found: Any = module
    for part in path.split("."):
        if not hasattr(found, part):
            from parity.engines.fix_records import installed_version
            from parity.engines.vllm import versions

            raise MissingTarget(f"{MISSING} {module.__name__}.{path} (vLLM {installed_version('vllm')}; parity supports "
                                f"{versions.supported()}: README, \"Following a new engine release\")")
        found = getattr(found, part)
    return found


def mark_triton_present(module: types.ModuleType) -> None:
    target(module, "HAS_TRITON")
    module.HAS_TRITON = True


# --- the graph gates -----------------------------------------------------------------------------------

def cpu_platform_graphs(module: types.ModuleType) -> None:
    """Static graphs supported, the capture sizes kept, attention called directly (change 1)."""
    platform = target(module, "CpuPlatform")
    target(module, "CpuPlatform.check_and_update_config")
    if getattr(platform.check_and_update_config, PATCHED, False):
        return

    compiled = os.environ.get(ENV_COMPILE) == COMPILE_EAGER

    def check_and_update_config(original, cls, vllm_config):
        config = vllm_config.compilation_config
        sizes, mode, backend = list(config.cudagraph_capture_sizes or ()), config.mode, config.backend
        original(cls, vllm_config)
        config.cudagraph_capture_sizes = sizes
        if compiled:  # vLLM's piecewise compile, with dynamo's eager backend instead of inductor
            config.mode, config.backend = mode, backend

    checked = around(platform.check_and_update_config.__func__, check_and_update_config, PATCHED)
    platform.check_and_update_config = classmethod(checked)
    platform.support_static_graph_mode = classmethod(lambda cls: True)
    # Piecewise graphs split at the opaque attention op, which runs eagerly between them; whole
    # graphs need attention as a direct call, whose ops the recorder sees.
    platform.opaque_attention_op = classmethod(lambda cls: compiled)
    platform.get_static_graph_wrapper_cls = classmethod(lambda cls: "vllm.compilation.cuda_graph.CUDAGraphWrapper")


def standin_block_sizes(module: types.ModuleType) -> None:
    """The CPU attention backend takes multiples of 16 tokens per KV block (change 0b)."""
    from vllm.v1.attention.backend import MultipleOf

    target(module, "CPUAttentionBackend.get_supported_kernel_block_sizes")
    module.CPUAttentionBackend.get_supported_kernel_block_sizes = staticmethod(
        lambda kv_cache_spec=None: [MultipleOf(STANDIN_BLOCK_MULTIPLE)])


def attention_graph_support(module: types.ModuleType) -> None:
    """The CPU attention builder supports graphs of any batch (change 2)."""
    from vllm.v1.attention.backend import AttentionCGSupport

    target(module, "CPUAttentionMetadataBuilder")._cudagraph_support = AttentionCGSupport.ALWAYS


@contextlib.contextmanager
def _no_device_memory():
    """`torch.accelerator.get_memory_info` answers zeros while capturing: the CUDA wheel's accelerator
    is CUDA, which has no driver here, and capture only logs the figure."""
    import torch

    original = torch.accelerator.get_memory_info
    torch.accelerator.get_memory_info = lambda *args, **kwargs: (0, 0)
    try:
        yield
    finally:
        torch.accelerator.get_memory_info = original


def worker_captures(module: types.ModuleType) -> None:
    """The CPU worker captures its graphs before serving, as the GPU worker does (change 3)."""
    worker = target(module, "CPUWorker")
    if getattr(target(module, "CPUWorker.compile_or_warm_up_model"), PATCHED, False):
        return

    def compile_or_warm_up_model(original, self):
        from vllm.v1.worker import workspace

        runner = self.model_runner
        manager = getattr(runner, "cudagraph_manager", None)
        if manager is not None and manager.needs_capture():
            if not workspace.is_workspace_manager_initialized():
                workspace.init_workspace_manager(self.device)
            with _no_device_memory():
                runner.capture_model()
        return original(self)

    worker.compile_or_warm_up_model = around(worker.compile_or_warm_up_model, compile_or_warm_up_model, PATCHED)


class _CaptureContext:
    def __init__(self, stream: Any) -> None:
        self.stream = stream


def cpu_streams(module: types.ModuleType) -> None:
    """The graph manager's stream look-ups answer the CPU stream (change 3)."""
    import torch

    target(module, "current_stream")  # both modules bind it; the manager's also binds graph_capture

    @contextlib.contextmanager
    def graph_capture(device: Any = None, stream: Any = None):
        # 0.33 calls graph_capture(device=...); 0.34 graph_capture(device, stream) with the manager's
        # capture stream (versions.py): the CPU has one stream either way.
        yield _CaptureContext(stream or torch.cpu.current_stream())

    module.graph_capture = graph_capture
    module.current_stream = torch.cpu.current_stream


_CAPTURING = threading.local()  # the ForwardContextGraph capturing in this thread, if any


def graphs_keep_forward_context(module: types.ModuleType) -> None:
    """The emulated graph keeps the forward context set while it captured, for a replay that has none.

    With vLLM's piecewise compile attention is the opaque op, which reads the forward context when
    it runs. A FULL replay (`run_fullgraph`) sets none; a real graph's attention kernel reads the
    metadata tensors it captured, which the runner refreshes before the replay. Replaying under the
    captured context gives the op exactly those: the captured metadata, whose tensors are the
    persistent buffers, their Python numbers frozen at capture as in a real graph."""
    import torch

    from parity.runner.emulated_graph import EngineEmulatedGraph

    original_set = target(module, "set_forward_context")
    for name in ("override_forward_context", "is_forward_context_available"):
        target(module, name)

    @contextlib.contextmanager
    def set_forward_context(*args: Any, **kwargs: Any):
        with original_set(*args, **kwargs) as context:
            graph = getattr(_CAPTURING, "graph", None)
            if graph is not None and graph.context is None:
                graph.context = module.get_forward_context()
            yield context

    class ForwardContextGraph(EngineEmulatedGraph):
        context = None

        def capture_begin(self, pool: Any = None, capture_error_mode: str = "global") -> None:
            _CAPTURING.graph = self
            super().capture_begin(pool, capture_error_mode)

        def capture_end(self) -> None:
            _CAPTURING.graph = None
            super().capture_end()

        def replay(self) -> None:
            if self.context is None or module.is_forward_context_available():
                super().replay()
                return
            with module.override_forward_context(self.context):
                super().replay()

    module.set_forward_context = set_forward_context
    torch.cuda.CUDAGraph = ForwardContextGraph


def install_emulated_graphs(torch_module: Any) -> None:
    from parity.runner.emulated_graph import EngineEmulatedGraph, graph, graph_pool_handle

    torch_module.cuda.CUDAGraph = EngineEmulatedGraph
    if os.environ.get(ENV_COMPILE) == COMPILE_EAGER:
        after_import(FORWARD_CONTEXT, graphs_keep_forward_context)
    torch_module.cuda.graph = graph
    torch_module.cpu.graph_pool_handle = graph_pool_handle
    after_import(CPU_PLATFORM, cpu_platform_graphs)
    after_import(CPU_ATTENTION, attention_graph_support)
    after_import(CPU_WORKER, worker_captures)
    after_import(GRAPH_MANAGER, cpu_streams)
    after_import(GRAPH_WRAPPER, cpu_streams)


def install(environ: Mapping[str, str]) -> None:
    import torch

    from parity.engines.vllm import cpu_ops

    cpu_ops.install(torch)
    after_import(CPU_ATTENTION, standin_block_sizes)
    after_import(TRITON_IMPORTING, mark_triton_present)
    if environ.get(ENV_GRAPH) == GRAPH_EMULATED:
        install_emulated_graphs(torch)
