"""What the command line asks of a backend (`BackendOptions`), and parity's CPU thread policy."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Mapping

# Measured with scripts/bench_cpu.py: the embedded presets' matrices are so small that a second
# intra-op thread only adds synchronisation, and on a busy machine it waits for a core.
PRESET_THREADS = 1


@dataclass(frozen=True)
class BackendOptions:
    """What the backend needs: which model, where and how it runs. `engine` holds the options only
    one backend has (`registry.own_options`), by their click names."""

    name: str = "transformers"
    model: str = "tiny-qwen3-vl"
    device: str = "auto"
    dtype: str = "auto"
    seed: int | None = None  # embedded presets only: build with another seed
    threads: int | None = None  # CPU intra-op threads; None: parity's policy
    runner: str = "fixed"  # the in-process graph runner's variant
    poison: bool = False  # the in-process runner's slots get a sentinel before every refresh
    graph_backend: str = "auto"
    buckets: str | tuple[int, ...] = "auto"
    chunk_size: int | None = None  # the chunked scenario's chunk, in tokens; None: the backend's default
    # the server backends
    concurrent: bool = False
    gpus: tuple[int, ...] = ()
    ready_timeout: float = 1800.0
    mem_fraction: float = 0.70
    engine: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))

    def own(self, name: str, default: Any = None) -> Any:
        return self.engine.get(name, default)

    @property
    def server(self) -> dict[str, Any]:
        """The `ServerSettings` fields these options give a server engine."""
        chunk = {} if self.chunk_size is None else {"chunk_size": self.chunk_size}
        return {"model": self.model, "concurrent": self.concurrent, "gpus": tuple(self.gpus),
                "ready_timeout": self.ready_timeout, "mem_fraction": self.mem_fraction, **chunk}


def apply_thread_policy(requested: int | None, embedded: bool) -> None:
    """--threads wins; else a thread count the user set in the environment stays; else one thread
    for the embedded presets (a default torch picks for big matrices, not for these)."""
    import torch

    if requested is not None:
        torch.set_num_threads(requested)
    elif embedded and not any(os.environ.get(v) for v in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")):
        torch.set_num_threads(PRESET_THREADS)
