"""What each mode's SGLang server is: its settings, command-line flags, GPU placement and environment.

Eager and bcg servers differ only in the arms' `--cuda-graph-backend-prefill` value; everything
else is the determinism set of docs/engines/sglang-0.5.23.md §7 plus the user's `--sglang-arg`s. The facts
parity needs from those user flags (prefill buckets, GPUs per server, context length, dtype) are
read here once, the way SGLang 0.5.23 resolves them.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

from parity.arms import MODES, load_arms
from parity.runner.buckets import SGLANG_MAX_PREFILL_BUCKET, prefill_bucket_ladder, smallest_fitting
from parity.design import CHUNKED, PAGE_TOKENS, PREFIX
from parity.errors import UsageError
from parity.engines.flags import flag_values, int_flag
from parity.engines.flags import split_user_args as split_args
from parity.engines.placement import LaunchPlan, Placement, plan_placement
from parity.engines.settings import ServerSettings
from parity.engines.startup import standin_env
from parity.engines.sglang import cpu_patches, deepstack_slot, kernel_standin, plugin

LAUNCH_MODULE = ("-m", "sglang.launch_server")
# Same kernels, same seed (docs/engines/sglang-0.5.23.md §7).
DETERMINISM_FLAGS = (
    "--attention-backend", "fa3",
    "--enable-deterministic-inference",
    "--random-seed", "0",
)
# On a CPU (docs/engines/sglang-cpu.md): SGLang's CPU engine with torch_native attention, which refuses the
# deterministic flag (its eager path is deterministic on a CPU without it); a bounded KV pool
# (--mem-fraction-static applies to RAM there: the defaults reserve 14 GB).
CPU_FLAGS = (
    "--device", "cpu",
    "--attention-backend", "torch_native",
    "--random-seed", "0",
)
# The serving features of a profile (design.Serving.server_profile), for the server's whole life. No
# prefix reuse except where the scenario is about it: a cached image prefix skips DeepStack.
NO_PREFIX_CACHE = ("--disable-radix-cache",)
CHUNK_FLAG = "--chunked-prefill-size"
CACHE_FLUSH_PATH = "/flush_cache"
CPU_MAX_TOTAL_TOKENS = 4096
# SGLang 0.5.23 scales a video's frames up to 128x28x28 pixels before the model's processor sees
# them (qwen_vl.py::preprocess_video, VIDEO_MIN_PIXELS); a CPU server lowers that floor to one
# 28 px patch, so the embedded presets' small frames reach their processor at their own size (as
# the prompt lengths parity plans its buckets with assume). A user's --mm-process-config wins.
MM_PROCESS_FLAG = "--mm-process-config"
CPU_MM_PROCESS_CONFIG = '{"video": {"min_pixels": 784}}'
BUCKET_FLAGS = ("--cuda-graph-bs-prefill", "--cuda-graph-max-bs-prefill")
MEM_FRACTION_FLAG = "--mem-fraction-static"
MODEL_FLAG = "--model-path"
# User flags that would make the servers differ in more than the mode, or fight the launcher.
RESERVED_FLAGS = (
    "--cuda-graph-backend-prefill", "--disable-prefill-cuda-graph", "--disable-cuda-graph",
    "--cuda-graph-config", "--model-path", "--host", "--port", "--mem-fraction-static", "--device",
)
# Above this a server keeps too little for activations and graph capture to start reliably.
MAX_MEM_FRACTION = 0.95


# --- the user's flags ----------------------------------------------------------------------------------

def split_user_args(values: Sequence[str]) -> tuple[str, ...]:
    """`--sglang-arg "--tp-size 2"` and `--sglang-arg --tp-size --sglang-arg 2` mean the same."""
    return split_args(values, "--sglang-arg", RESERVED_FLAGS, "parity sets it so the eager and bcg servers "
                      "differ only in the prefill CUDA-graph backend")


def _int_flag(args: Sequence[str], *names: str) -> int | None:
    return int_flag(args, "--sglang-arg", *names)


@dataclass(frozen=True)
class ServerFacts:
    """What the user's `--sglang-arg`s decide for parity, resolved as SGLang 0.5.23 does."""

    prefill_buckets: tuple[int, ...]  # what the bcg server captures (docs/engines/sglang-0.5.23.md §1.1)
    max_replay_tokens: int | None  # --cuda-graph-max-seq-len-prefill: longer prefills run eager
    gpus_per_server: int  # tp x pp x dp
    context_length: int | None
    dtype: str | None
    tp_size: int = 1  # ranks that run every request, each with its own tap (design §8)

    @property
    def max_bucket(self) -> int | None:
        return max(self.prefill_buckets, default=None)

    def bucket_of(self, num_tokens: int) -> int | None:
        if num_tokens <= 0 or (self.max_replay_tokens is not None and num_tokens > self.max_replay_tokens):
            return None
        return smallest_fitting(self.prefill_buckets, num_tokens)

    @classmethod
    def parse(cls, args: Sequence[str]) -> "ServerFacts":
        listed = flag_values(args, "--cuda-graph-bs-prefill")
        if listed is not None:
            try:
                buckets = tuple(sorted({int(v) for v in listed}))
            except ValueError:
                raise UsageError(f"--sglang-arg --cuda-graph-bs-prefill needs integers, got {' '.join(listed)}") from None
            if not buckets or min(buckets) <= 0:
                raise UsageError("--sglang-arg --cuda-graph-bs-prefill needs positive token counts")
        else:
            buckets = prefill_bucket_ladder(_max_prefill_bs(args))
        # `--tp` and `--dp` are argparse's abbreviations of --tp-size and --dp-size (SGLang 0.5.23 has no
        # other flag they could stand for; `--pp` is ambiguous there, and SGLang refuses it).
        sizes = [_int_flag(args, "--tp-size", "--tensor-parallel-size", "--tp"),
                 _int_flag(args, "--pp-size", "--pipeline-parallel-size"),
                 _int_flag(args, "--dp-size", "--data-parallel-size", "--dp")]
        gpus = 1
        for size in sizes:
            gpus *= size if size is not None else 1
        dtype = flag_values(args, "--dtype")
        return cls(
            prefill_buckets=buckets,
            max_replay_tokens=_int_flag(args, "--cuda-graph-max-seq-len-prefill"),
            gpus_per_server=gpus,
            tp_size=sizes[0] or 1,
            context_length=_int_flag(args, "--context-length"),
            dtype=dtype[0] if dtype else None,
        )


def _max_prefill_bs(args: Sequence[str]) -> int:
    # memory_hook: an explicit max wins; else chunked_prefill_size (8192 on an H100/H200), capped
    # by --max-total-tokens.
    explicit = _int_flag(args, "--cuda-graph-max-bs-prefill")
    if explicit is not None:
        return explicit
    chunked = _int_flag(args, "--chunked-prefill-size")
    max_bs = chunked if chunked is not None else SGLANG_MAX_PREFILL_BUCKET
    total = _int_flag(args, "--max-total-tokens")
    return min(max_bs, total) if total is not None else max_bs


# --- settings and flags ----------------------------------------------------------------------------------

GpuMemory = Callable[[Sequence[int] | None, int], "tuple[float, float] | None"]


@dataclass(frozen=True)
class SglangSettings(ServerSettings):
    launch_command: tuple[str, ...] = (sys.executable, *LAUNCH_MODULE)
    sglang_args: tuple[str, ...] = ()
    gpu_memory: GpuMemory | None = None  # (free, total) of a server's GPUs; tests substitute it

    @property
    def facts(self) -> ServerFacts:
        return ServerFacts.parse(self.sglang_args)


def buckets_given(args: Sequence[str]) -> bool:
    return flag_values(args, *BUCKET_FLAGS) is not None


def mode_flags(mode: str) -> tuple[str, ...]:
    """The server flags every arm of `mode` declares (arms/*.json `backends.sglang.server_args`)."""
    declared = {tuple(arm.backend_settings("sglang").get("server_args", ()))
                for arm in load_arms().values() if arm.mode == mode}
    if len(declared) != 1:
        raise UsageError(f"the arms of mode {mode!r} declare {len(declared)} different SGLang server "
                         f"flag sets; one server per mode needs exactly one: {sorted(declared)}")
    return declared.pop()


def profile_flags(profile: str | None, chunk_size: int) -> tuple[str, ...]:
    if profile == PREFIX:  # radix matches rounded down to pages: a hit can end inside the image
        return ("--page-size", str(PAGE_TOKENS))
    return (*NO_PREFIX_CACHE, *((CHUNK_FLAG, str(chunk_size)) if profile == CHUNKED else ()))


def server_flags(settings: SglangSettings, mode: str, mem_fraction: float, profile: str | None = None) -> tuple[str, ...]:
    # User flags last: they may add anything not reserved, in both servers alike.
    served = profile_flags(profile, settings.chunk_size)
    if settings.on_cpu:
        defaults = {"--max-total-tokens": str(CPU_MAX_TOTAL_TOKENS), MM_PROCESS_FLAG: CPU_MM_PROCESS_CONFIG}
        unset = tuple(item for flag, value in defaults.items() if flag_values(settings.sglang_args, flag) is None
                      for item in (flag, value))
        return (MODEL_FLAG, settings.model, *CPU_FLAGS, *served, *unset, MEM_FRACTION_FLAG, f"{mem_fraction:.4g}",
                *mode_flags(mode), *settings.sglang_args)
    return (MODEL_FLAG, settings.model, *DETERMINISM_FLAGS, *served, MEM_FRACTION_FLAG, f"{mem_fraction:.4g}",
            *mode_flags(mode), *settings.sglang_args)


# --- placement: which GPUs, how much memory, in which order -------------------------------------------

def plan_launch(settings: SglangSettings, modes: Sequence[str] = MODES) -> LaunchPlan:
    """The servers' GPUs, memory and start order (`parity.engines.placement.plan_placement`)."""
    return plan_placement(settings.gpus, settings.facts.gpus_per_server, settings.concurrent, settings.mem_fraction,
                          modes, "SGLang", "--sglang-arg")


def check_gpu_count(facts: ServerFacts, gpus: Sequence[int], present: int | None, visible: int | None) -> None:
    """Before any launch: each server needs tp x pp x dp GPUs (`plan_launch` checks --gpus gives
    them), and the machine must have them; `present` counts nvidia-smi's GPUs (what --gpus indexes),
    `visible` those a server without --gpus can use. None: the machine cannot tell; not checked."""
    need = facts.gpus_per_server
    if gpus and present is not None and max(gpus) >= present:
        raise UsageError(f"--gpus {','.join(map(str, gpus))}: this machine has {present} GPU(s) "
                         f"(indexes 0 to {present - 1})")
    if not gpus and visible is not None and visible < need:
        raise UsageError(f"each SGLang server needs {need} GPUs (tensor x pipeline x data parallel sizes in "
                         f"--sglang-arg) but {visible} {'is' if visible == 1 else 'are'} visible "
                         "(CUDA_VISIBLE_DEVICES, else nvidia-smi)")


def fraction_for_share(share: float, memory: tuple[float, float] | None) -> float:
    """The --mem-fraction-static that gives a server `share` of its GPU's total memory, given
    (free, total) when it starts. Unknown memory: assume the earlier server took exactly its
    share, which errs towards less (the free memory also lost its graphs and activations)."""
    if memory is None:
        return share / (1.0 - share)
    free, total = memory
    return share * total / free if free > 0 else float("inf")


def server_env(channel: plugin.TapChannel, placement: Placement, settings: SglangSettings | None = None,
               standin_calls: Path | None = None) -> dict[str, str]:
    env = {plugin.ENV_VAR: str(channel.folder.resolve())}
    if settings is not None and settings.fix:
        env[deepstack_slot.ENV_FIX] = settings.fix
    if settings is not None and settings.on_cpu:
        env.update(cpu_env(settings, standin_calls or channel.folder / "standin-calls.jsonl"))
    whitelist = os.environ.get("SGLANG_PLUGINS", "")
    if whitelist.strip():  # unset means "load all"; a set whitelist must name parity too
        names = [n.strip() for n in whitelist.split(",") if n.strip()]
        env["SGLANG_PLUGINS"] = ",".join(dict.fromkeys([*names, plugin.ENTRY_POINT_NAME]))
    if placement.gpus is not None:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(str(g) for g in placement.gpus)
    return env


def cpu_env(settings: SglangSettings, standin_calls: Path) -> dict[str, str]:
    """A CPU server's environment: SGLang's CPU engine, parity's stand-in folder first on its own
    PYTHONPATH (never parity's), the graph emulation when asked, and capped threads."""
    return {
        **standin_env(kernel_standin.STANDIN_DIR, settings.threads),
        "SGLANG_USE_CPU_ENGINE": "1",
        cpu_patches.ENV_CPU: "1",
        cpu_patches.ENV_GRAPH: settings.graph_backend,
        kernel_standin.ENV_CALLS: str(standin_calls.resolve()),
    }
