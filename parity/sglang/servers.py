"""What each mode's SGLang server is: its settings, command-line flags, GPU placement and environment.

Eager and bcg servers differ only in the arms' `--cuda-graph-backend-prefill` value; everything
else is the determinism set of sglang-0.5.23.md §7 plus the user's `--sglang-arg`s. The facts
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
from parity.buckets import SGLANG_MAX_PREFILL_BUCKET, prefill_bucket_ladder, smallest_fitting
from parity.errors import UsageError
from parity.serving import launcher
from parity.serving.flags import flag_values, int_flag
from parity.serving.flags import split_user_args as split_args
from parity.serving.placement import LaunchPlan, Placement, plan_placement
from parity.sglang import plugin

LAUNCH_MODULE = ("-m", "sglang.launch_server")
# Same kernels, same seed, no prefix reuse (a cached image prefix would skip DeepStack), §7.
DETERMINISM_FLAGS = (
    "--attention-backend", "fa3",
    "--enable-deterministic-inference",
    "--random-seed", "0",
    "--disable-radix-cache",
)
MEM_FRACTION_FLAG = "--mem-fraction-static"
MODEL_FLAG = "--model-path"
# User flags that would make the servers differ in more than the mode, or fight the launcher.
RESERVED_FLAGS = (
    "--cuda-graph-backend-prefill", "--disable-prefill-cuda-graph", "--disable-cuda-graph",
    "--cuda-graph-config", "--model-path", "--host", "--port", "--mem-fraction-static",
)
DEFAULT_MEM_FRACTION = 0.70
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

    prefill_buckets: tuple[int, ...]  # what the bcg server captures (sglang-0.5.23.md §1.1)
    max_replay_tokens: int | None  # --cuda-graph-max-seq-len-prefill: longer prefills run eager
    gpus_per_server: int  # tp x pp x dp
    context_length: int | None
    dtype: str | None

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
        sizes = [_int_flag(args, "--tp-size", "--tensor-parallel-size"),
                 _int_flag(args, "--pp-size", "--pipeline-parallel-size"),
                 _int_flag(args, "--dp-size", "--data-parallel-size")]
        gpus = 1
        for size in sizes:
            gpus *= size if size is not None else 1
        dtype = flag_values(args, "--dtype")
        return cls(
            prefill_buckets=buckets,
            max_replay_tokens=_int_flag(args, "--cuda-graph-max-seq-len-prefill"),
            gpus_per_server=gpus,
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
class SglangSettings:
    model: str
    max_new_tokens: int
    run_dir: Path
    sglang_args: tuple[str, ...] = ()
    concurrent: bool = False
    gpus: tuple[int, ...] = ()
    mem_fraction: float = DEFAULT_MEM_FRACTION
    ready_timeout: float = 1800.0
    launch_command: tuple[str, ...] = (sys.executable, *LAUNCH_MODULE)
    stop_grace: float = launcher.STOP_GRACE_S
    ready_poll: float = launcher.POLL_S
    gpu_memory: GpuMemory | None = None  # (free, total) of a server's GPUs; tests substitute it

    @property
    def facts(self) -> ServerFacts:
        return ServerFacts.parse(self.sglang_args)


def mode_flags(mode: str) -> tuple[str, ...]:
    """The server flags every arm of `mode` declares (arms/*.json `backends.sglang.server_args`)."""
    declared = {tuple(arm.backend_settings("sglang").get("server_args", ()))
                for arm in load_arms().values() if arm.mode == mode}
    if len(declared) != 1:
        raise UsageError(f"the arms of mode {mode!r} declare {len(declared)} different SGLang server "
                         f"flag sets; one server per mode needs exactly one: {sorted(declared)}")
    return declared.pop()


def server_flags(settings: SglangSettings, mode: str, mem_fraction: float) -> tuple[str, ...]:
    # User flags last: they may add anything not reserved, in both servers alike.
    return (MODEL_FLAG, settings.model, *DETERMINISM_FLAGS, MEM_FRACTION_FLAG, f"{mem_fraction:.4g}",
            *mode_flags(mode), *settings.sglang_args)


# --- placement: which GPUs, how much memory, in which order -------------------------------------------

def plan_launch(settings: SglangSettings, modes: Sequence[str] = MODES) -> LaunchPlan:
    """The servers' GPUs, memory and start order (`parity.serving.placement.plan_placement`)."""
    return plan_placement(settings.gpus, settings.facts.gpus_per_server, settings.concurrent, settings.mem_fraction,
                          modes, "SGLang", "--sglang-arg")


def fraction_for_share(share: float, memory: tuple[float, float] | None) -> float:
    """The --mem-fraction-static that gives a server `share` of its GPU's total memory, given
    (free, total) when it starts. Unknown memory: assume the earlier server took exactly its
    share, which errs towards less (the free memory also lost its graphs and activations)."""
    if memory is None:
        return share / (1.0 - share)
    free, total = memory
    return share * total / free if free > 0 else float("inf")


def server_env(channel: plugin.TapChannel, placement: Placement) -> dict[str, str]:
    env = {plugin.ENV_VAR: str(channel.folder.resolve())}
    whitelist = os.environ.get("SGLANG_PLUGINS", "")
    if whitelist.strip():  # unset means "load all"; a set whitelist must name parity too
        names = [n.strip() for n in whitelist.split(",") if n.strip()]
        env["SGLANG_PLUGINS"] = ",".join(dict.fromkeys([*names, plugin.ENTRY_POINT_NAME]))
    if placement.gpus is not None:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(str(g) for g in placement.gpus)
    return env
