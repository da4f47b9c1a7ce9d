"""Backends by name: each turns a model name and options into a `Backend` (see base.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from parity.backends.base import Backend
from parity.errors import UsageError


def _transformers(*, model: str, device: str, dtype: str, max_new_tokens: int, runner: str,
                  graph_backend: str, buckets: tuple[int, ...], **_sglang_only) -> Backend:
    from parity.backends.transformers_backend import TransformersBackend
    from parity.graph_runner import RunnerVariant
    from parity.models import load_model

    loaded = load_model(model, device=device, dtype=dtype)
    try:
        return TransformersBackend(loaded, max_new_tokens=max_new_tokens, runner_variant=RunnerVariant(runner),
                                   graph_backend=graph_backend, buckets=buckets)
    except ValueError as err:  # e.g. --graph-backend cuda with the model on the CPU
        raise UsageError(str(err)) from None


def _sglang(*, model: str, dtype: str, max_new_tokens: int, run_dir: Path, sglang_args: tuple[str, ...],
            concurrent: bool, gpus: tuple[int, ...], ready_timeout: float, mem_fraction: float,
            **_transformers_only) -> Backend:
    from parity.models.tiny import PRESETS
    from parity.sglang.backend import create_sglang_backend

    if model in PRESETS:
        raise UsageError(f"{model!r} is an embedded preset, built in parity's process: it runs on the "
                         "transformers backend; give --backend sglang a Qwen3-VL checkpoint id or path")
    if dtype != "auto":
        sglang_args = (*sglang_args, "--dtype", dtype)  # the servers, not parity, load the weights
    return create_sglang_backend(model=model, max_new_tokens=max_new_tokens, run_dir=run_dir,
                                 sglang_args=sglang_args, concurrent=concurrent, gpus=gpus,
                                 ready_timeout=ready_timeout, mem_fraction=mem_fraction)


BACKENDS: dict[str, Callable[..., Backend]] = {"transformers": _transformers, "sglang": _sglang}


def create_backend(name: str, **options) -> Backend:
    if name not in BACKENDS:
        raise UsageError(f"unknown backend {name!r}; known backends: {', '.join(BACKENDS)}")
    return BACKENDS[name](**options)
