"""Every backend by name: its lazy factory, the `parity run` options it uses, and what it can do
(design §6). The rest of parity asks this module, never compares a backend's name.

Importing it is cheap (no torch, no engine): the verdict and the reports read capabilities of the
backend a results file names, on machines where that engine is not installed.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping

from parity.engines.capabilities import BackendInfo, EngineOption
from parity.engines.sglang.entry import SGLANG
from parity.engines.vllm.entry import VLLM

if TYPE_CHECKING:
    from parity.backends.options import BackendOptions
    from parity.backends.protocol import Backend


TRANSFORMERS = BackendInfo(
    name="transformers", factory="parity.backends.transformers_backend:from_options",
    options=frozenset({"runner", "localize_threshold", "buckets", "graph_backend", "threads", "chunk_size"}),
    localizes=True, in_process=True,
)


BACKENDS: Mapping[str, BackendInfo] = {b.name: b for b in (TRANSFORMERS, SGLANG, VLLM)}
DEFAULT = TRANSFORMERS.name


def info(name: object) -> BackendInfo:
    """The backend a results file names; one parity does not know reads as the in-process one."""
    return BACKENDS.get(str(name), TRANSFORMERS)


def of_run(config: Mapping[str, Any]) -> BackendInfo:
    return info(config.get("backend", DEFAULT))


def option_backends() -> dict[str, tuple[str, ...]]:
    """Every `parity run` option that not every backend uses -> the backends that use it, in order."""
    names = sorted({o for b in BACKENDS.values() for o in b.uses})
    return {o: tuple(b.name for b in BACKENDS.values() if o in b.uses) for o in names}


def refusal(backend: str, option: str, value: Any) -> str | None:
    return info(backend).refused.get((option, value))


def own_options() -> tuple[EngineOption, ...]:
    return tuple(o for b in BACKENDS.values() for o in b.own_options)


def create_backend(options: "BackendOptions", max_new_tokens: int, run_dir: Path) -> "Backend":
    from parity.errors import UsageError

    if options.name not in BACKENDS:
        raise UsageError(f"unknown backend {options.name!r}; known backends: {', '.join(BACKENDS)}")
    return BACKENDS[options.name].create(options, max_new_tokens, run_dir)
