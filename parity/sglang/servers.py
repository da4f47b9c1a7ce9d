"""What each mode's SGLang server is: its settings, command-line flags, GPU placement and environment.

Eager and bcg servers differ only in the arms' `--cuda-graph-backend-prefill` value; everything
else is the determinism set of sglang-0.5.23.md §7 plus the user's `--sglang-arg`s.
"""

from __future__ import annotations

import os
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from parity.arms import load_arms
from parity.errors import UsageError
from parity.sglang import launcher, plugin

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
DEFAULT_MAX_PREFILL_BUCKET = 8192  # chunked_prefill_size on an H100/H200 (§1.1)


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


@dataclass(frozen=True)
class Placement:
    """Where one server runs: its GPUs (None: inherit) and its share of GPU memory."""

    gpus: tuple[int, ...] | None
    mem_fraction: float


def split_user_args(values: Sequence[str]) -> tuple[str, ...]:
    """`--sglang-arg "--tp-size 2"` and `--sglang-arg --tp-size --sglang-arg 2` mean the same."""
    args = tuple(token for value in values for token in shlex.split(value))
    clashes = sorted({a.split("=", 1)[0] for a in args} & set(RESERVED_FLAGS))
    if clashes:
        raise UsageError(f"--sglang-arg may not set {', '.join(clashes)}: parity sets it so the eager and "
                         "bcg servers differ only in the prefill CUDA-graph backend")
    return args


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


def placements(settings: SglangSettings, modes: Sequence[str]) -> dict[str, Placement]:
    """Sequential: every server gets all given GPUs. Concurrent: split the GPUs when there are
    enough, else share them and split the memory fraction, so both servers get equal shares."""
    gpus = settings.gpus or None
    if not settings.concurrent or len(modes) < 2:
        return {mode: Placement(gpus, settings.mem_fraction) for mode in modes}
    if gpus is not None and len(gpus) >= len(modes):
        per = len(gpus) // len(modes)
        return {mode: Placement(gpus[i * per:(i + 1) * per], settings.mem_fraction) for i, mode in enumerate(modes)}
    return {mode: Placement(gpus, settings.mem_fraction / len(modes)) for mode in modes}


def prefill_buckets(max_tokens: int) -> tuple[int, ...]:
    """SGLang 0.5.23's prefill capture sizes (`generate_prefill_cuda_graph_batch_sizes`)."""
    sizes = [*range(4, 33, 4), *range(48, 257, 16), *range(288, 513, 32), *range(576, 1025, 64),
             *range(1280, 4097, 256), *range(4608, max_tokens + 1, 512)]
    return tuple(s for s in sizes if s <= max_tokens)


def server_env(channel: plugin.TapChannel, placement: Placement) -> dict[str, str]:
    env = {plugin.ENV_VAR: str(channel.folder.resolve())}
    whitelist = os.environ.get("SGLANG_PLUGINS", "")
    if whitelist.strip():  # unset means "load all"; a set whitelist must name parity too
        names = [n.strip() for n in whitelist.split(",") if n.strip()]
        env["SGLANG_PLUGINS"] = ",".join(dict.fromkeys([*names, plugin.ENTRY_POINT_NAME]))
    if placement.gpus is not None:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(str(g) for g in placement.gpus)
    return env
