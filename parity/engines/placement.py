"""Where each mode's server runs: its GPUs, its share of GPU memory, and the order servers start in."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

from parity.errors import UsageError


@dataclass(frozen=True)
class Placement:
    """Where one server runs: its GPUs (None: inherit) and its share of GPU memory.

    `share` is set when the server shares its GPUs with one started before it. An engine that
    sizes its memory from what is free when it starts (SGLang 0.5.23, docs/engines/sglang-0.5.23.md §8) works
    out its fraction then, from the memory the first one left, to get `share` of the GPU's total;
    an engine whose fraction is of the total (vLLM's --gpu-memory-utilization) uses `mem_fraction`.
    """

    gpus: tuple[int, ...] | None
    mem_fraction: float
    share: float | None = None


@dataclass(frozen=True)
class LaunchPlan:
    """Concurrent servers: each stage starts together once the previous stage is ready."""

    stages: tuple[tuple[str, ...], ...]
    placements: Mapping[str, Placement]


def plan_placement(gpus_given: Sequence[int], per_server: int, concurrent: bool, mem_fraction: float,
                   modes: Sequence[str], engine: str, arg_option: str) -> LaunchPlan:
    """Sequential: every server gets all given GPUs. Concurrent: a set of GPUs per server, started
    in parallel, where `--gpus` has enough; else both on the same GPUs, one after the other, each
    with half the memory fraction. Anything else cannot work and is refused before any start.

    `per_server` is the GPUs one server needs (its parallel sizes, read from `arg_option`)."""
    gpus = tuple(gpus_given) or None
    if len(set(gpus_given)) != len(gpus_given):
        raise UsageError(f"--gpus lists a GPU twice: {','.join(map(str, gpus_given))}")
    if gpus is not None and len(gpus) < per_server:
        raise UsageError(f"each {engine} server needs {per_server} GPUs (tensor x pipeline x data parallel sizes in "
                         f"{arg_option}) but --gpus gives {len(gpus)}")
    if not concurrent or len(modes) < 2:
        return LaunchPlan(tuple((m,) for m in modes), {m: Placement(gpus, mem_fraction) for m in modes})
    if gpus is not None and len(gpus) >= per_server * len(modes):
        where = {m: Placement(gpus[i * per_server:(i + 1) * per_server], mem_fraction) for i, m in enumerate(modes)}
        return LaunchPlan((tuple(modes),), where)
    if gpus is not None and len(gpus) != per_server:
        raise UsageError(f"--concurrent with --gpus {','.join(map(str, gpus))}: give {per_server} GPU(s) for both "
                         f"servers to share, or {per_server * len(modes)} for one set per server")
    share = mem_fraction / len(modes)
    first, *later = modes
    where = {first: Placement(gpus, share), **{m: Placement(gpus, share, share=share) for m in later}}
    return LaunchPlan(tuple((m,) for m in modes), where)
