"""Backends by name: each turns `BackendOptions` into a `Backend` (see base.py)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from parity.backends.protocol import Backend
from parity.errors import UsageError

# Measured with scripts/bench_cpu.py: the embedded presets' matrices are so small that a second
# intra-op thread only adds synchronisation, and on a busy machine it waits for a core.
PRESET_THREADS = 1


@dataclass(frozen=True)
class BackendOptions:
    """What the backend needs: which model, where and how it runs."""

    name: str = "transformers"
    model: str = "tiny-qwen3-vl"
    device: str = "auto"
    dtype: str = "auto"
    seed: int | None = None  # embedded presets only: build with another seed
    threads: int | None = None  # CPU intra-op threads; None: parity's policy
    # transformers
    runner: str = "fixed"
    graph_backend: str = "auto"
    buckets: str | tuple[int, ...] = "auto"
    # sglang
    sglang_args: tuple[str, ...] = ()
    # vllm
    vllm_args: tuple[str, ...] = ()
    graph_mode: str = "full_and_piecewise"
    # the server backends (sglang, vllm)
    concurrent: bool = False
    gpus: tuple[int, ...] = ()
    ready_timeout: float = 1800.0
    mem_fraction: float = 0.70
    sglang_fix: str | None = None  # parity's DeepStack slot fix inside the servers


def apply_thread_policy(requested: int | None, embedded: bool) -> None:
    """--threads wins; else a thread count the user set in the environment stays; else one thread
    for the embedded presets (a default torch picks for big matrices, not for these)."""
    import torch

    if requested is not None:
        torch.set_num_threads(requested)
    elif embedded and not any(os.environ.get(v) for v in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")):
        torch.set_num_threads(PRESET_THREADS)


def _transformers(options: BackendOptions, max_new_tokens: int, run_dir: Path) -> Backend:
    from parity.backends.transformers_backend import TransformersBackend
    from parity.buckets import BucketPolicy
    from parity.graph_runner import RunnerVariant
    from parity.models import load_model
    from parity.presets import PRESETS

    apply_thread_policy(options.threads, options.model in PRESETS)
    loaded = load_model(options.model, device=options.device, dtype=options.dtype, seed=options.seed)
    buckets = BucketPolicy.parse(options.buckets, loaded.adapter.max_positions)
    try:
        return TransformersBackend(loaded, max_new_tokens=max_new_tokens, runner_variant=RunnerVariant(options.runner),
                                   graph_backend=options.graph_backend, buckets=buckets)
    except ValueError as err:  # e.g. --graph-backend cuda with the model on the CPU
        raise UsageError(str(err)) from None


def _served_checkpoint(options: BackendOptions) -> None:
    """A server backend serves a checkpoint: refuse what only an embedded preset can be."""
    from parity.presets import PRESETS

    if options.model in PRESETS:
        raise UsageError(f"{options.model!r} is an embedded preset, built in parity's process: it runs on the "
                         f"transformers backend; give --backend {options.name} a Qwen3-VL checkpoint id or path")
    if options.seed is not None:
        raise UsageError(f"--seed builds an embedded preset; the {options.name} backend serves checkpoints")


def _sglang(options: BackendOptions, max_new_tokens: int, run_dir: Path) -> Backend:
    from parity.presets import PRESETS
    from parity.engines.flags import flag_values
    from parity.engines.sglang.backend import create_sglang_backend

    # SGLang serves the embedded presets too, on the CPU from a cached checkpoint folder.
    device = "cpu" if options.device == "cpu" else "cuda"
    embedded = options.model in PRESETS
    if options.seed is not None and not embedded:
        raise UsageError(f"--seed builds an embedded preset ({', '.join(PRESETS)}); {options.model!r} is a checkpoint")
    sglang_args = options.sglang_args
    # The servers, not parity, load the weights. Explicit on a CPU and for presets: under `auto`
    # SGLang runs a float32 checkpoint in float16 (sglang-cpu.md).
    dtype = options.dtype if options.dtype != "auto" else ("float32" if device == "cpu" or embedded else None)
    if dtype is not None and flag_values(sglang_args, "--dtype") is None:
        sglang_args = (*sglang_args, "--dtype", dtype)
    return create_sglang_backend(model=options.model, seed=options.seed, max_new_tokens=max_new_tokens, run_dir=run_dir,
                                 sglang_args=sglang_args, concurrent=options.concurrent, gpus=options.gpus,
                                 ready_timeout=options.ready_timeout, mem_fraction=options.mem_fraction,
                                 device=device, graph_backend=options.graph_backend, fix=options.sglang_fix,
                                 threads=options.threads)


def _vllm(options: BackendOptions, max_new_tokens: int, run_dir: Path) -> Backend:
    from parity.engines.vllm.backend import create_vllm_backend

    _served_checkpoint(options)
    vllm_args = options.vllm_args
    if options.dtype != "auto":
        vllm_args = (*vllm_args, "--dtype", options.dtype)  # the servers, not parity, load the weights
    return create_vllm_backend(model=options.model, max_new_tokens=max_new_tokens, run_dir=run_dir,
                               vllm_args=vllm_args, graph_mode_name=options.graph_mode, buckets=options.buckets,
                               concurrent=options.concurrent, gpus=options.gpus,
                               ready_timeout=options.ready_timeout, mem_fraction=options.mem_fraction)


BACKENDS: dict[str, Callable[[BackendOptions, int, Path], Backend]] = {"transformers": _transformers,
                                                                      "sglang": _sglang, "vllm": _vllm}


def create_backend(options: BackendOptions, max_new_tokens: int, run_dir: Path) -> Backend:
    if options.name not in BACKENDS:
        raise UsageError(f"unknown backend {options.name!r}; known backends: {', '.join(BACKENDS)}")
    return BACKENDS[options.name](options, max_new_tokens, run_dir)
