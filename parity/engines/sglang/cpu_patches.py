"""What parity changes, in-process, in the SGLang 0.5.23 servers it starts on a CPU (docs/engines/sglang-cpu.md).

Installed by parity's stand-in `sitecustomize` (parity/engines/sglang/standin/) in every server process,
only when parity sets `PARITY_SGLANG_CPU`; no SGLang file is edited. Always:

- `torch.ops.sgl_kernel` answers from the kernel stand-in (parity/engines/sglang/kernel_standin.py);
- videos decode with decord when it is installed: SGLang's decoder prefers torchcodec whenever it
  imports, and torchcodec imports on a machine without FFmpeg's shared libraries, then fails on
  the first video (`srt/utils/video_decoder.py`, docs/engines/sglang-cpu.md).

With `PARITY_SGLANG_GRAPH=emulated`, SGLang's own breakable prefill runner captures and replays
on the CPU:

1. keep the prefill graph: `handle_attention_backend_compatibility` declares the prefill graph
   off for `torch_native`; that one declaration is dropped, so the prefill backend the command
   line asked for stays (decode stays off, as SGLang declares);
2. `torch.cuda.CUDAGraph` is parity's emulation (parity/runner/emulated_graph.py, its engine
   form: the pool rule only), which SGLang's breakable capture looks up for every segment;
3. `torch.cpu.graph_pool_handle` exists (SGLang asks the device module for a pool handle);
4. `get_current_device_stream_fast` returns the CPU stream (a bare `torch.get_device_module()` is
   CUDA on this wheel, with no driver).

And always, in the eager server too (so that both arms compute MoE alike):

5. the unquantized MoE on a CPU without AMX runs SGLang's own `fused_moe_forward_native` (each
   token's experts gathered, one einsum: no host read, no shape that depends on the routing), the
   form SGLang installs itself under torch.compile, instead of `moe_forward_native`. That one sorts
   the tokens by expert and loops over `tokens_per_expert.cpu()`, counts read on the host: an
   emulated graph (like a real one) records the loop as captured, so a replay routed the live
   tokens by the capture's counts, and every MoE run on this CPU failed its self-check (0.01-0.02
   in fp32; docs/engines/sglang-cpu.md, "MoE presets").

A change to a module is applied right after the module executes (parity/engines/after_import.py),
so a later `from X import f` binds the changed name.
"""

from __future__ import annotations

import types
from typing import Any, Mapping

from parity.engines.after_import import after_import

ENV_CPU = "PARITY_SGLANG_CPU"
ENV_GRAPH = "PARITY_SGLANG_GRAPH"
GRAPH_EMULATED = "emulated"

ATTENTION_HOOK = "sglang.srt.arg_groups.attention_hook"
ATTENTION_COMPATIBILITY_SOURCE = "_handle_attention_backend_compatibility"
DEVICE_UTILS = "sglang.srt.utils.common"
STREAM_FUNCTION = "get_current_device_stream_fast"
DISABLED = "disabled"
VIDEO_DECODER = "sglang.srt.utils.video_decoder"
MOE_METHODS = "sglang.srt.layers.quantization.unquant"
MOE_NATIVE = "sglang.srt.layers.moe.fused_moe_native"


# --- the changes ----------------------------------------------------------------------------------------

def keep_prefill_graph(module: types.ModuleType) -> None:
    """Drop the torch_native declaration that turns a requested prefill graph off (change 1)."""
    declare = module.declare_resolution
    resolving_view = module.resolving_view

    def declare_resolution(server_args: Any, source: str, **fields: Any) -> None:
        config = fields.get("cuda_graph_config")
        if source == ATTENTION_COMPATIBILITY_SOURCE and config is not None:
            asked = resolving_view(server_args).cuda_graph_config.prefill.backend
            if config.prefill.backend == DISABLED and asked != DISABLED:
                return  # the prefill backend stays what the command line asked for
        declare(server_args, source, **fields)

    module.declare_resolution = declare_resolution


def cpu_stream(module: types.ModuleType) -> None:
    """`get_current_device_stream_fast` on the CPU stream (change 4)."""
    import torch

    def get_current_device_stream_fast():
        return torch.cpu.current_stream()

    setattr(module, STREAM_FUNCTION, get_current_device_stream_fast)


def decode_with_decord(module: types.ModuleType) -> None:
    import importlib.util

    if importlib.util.find_spec("decord") is not None:
        module._BACKEND = "decord"  # read by VideoDecoderWrapper at each construction


def capturable_moe(module: types.ModuleType) -> None:
    """The CPU's unquantized MoE as one gather and einsum, without AMX (change 5)."""
    import importlib

    methods = module.UnquantizedFusedMoEMethod
    original = methods.forward_cpu
    if getattr(original, "__parity_moe__", False):
        return

    def forward_cpu(self, layer, dispatch_output):
        if module.use_intel_amx_backend(layer):  # sgl_kernel's fused experts: no host-side loop
            return original(self, layer, dispatch_output)
        return importlib.import_module(MOE_NATIVE).fused_moe_forward_native(layer, dispatch_output)

    forward_cpu.__parity_moe__ = True
    methods.forward_cpu = methods.forward_native = forward_cpu  # the class aliases one to the other


def install_emulated_graphs(torch_module: Any) -> None:
    from parity.runner.emulated_graph import EngineEmulatedGraph, graph_pool_handle

    torch_module.cuda.CUDAGraph = EngineEmulatedGraph  # change 2
    torch_module.cpu.graph_pool_handle = graph_pool_handle  # change 3
    after_import(ATTENTION_HOOK, keep_prefill_graph)
    after_import(DEVICE_UTILS, cpu_stream)


def install(environ: Mapping[str, str]) -> None:
    import torch

    from parity.engines.sglang.kernel_standin import install_ops

    install_ops(torch)
    after_import(VIDEO_DECODER, decode_with_decord)
    after_import(MOE_METHODS, capturable_moe)
    if environ.get(ENV_GRAPH) == GRAPH_EMULATED:
        install_emulated_graphs(torch)
