"""Every backend by name: its lazy factory, the `parity run` options it uses, and what it can do
(design §5). The rest of parity asks this module, never compares a backend's name.

Each backend declares its entry in its own folder (`parity/backends/entry.py`,
`parity/engines/<engine>/entry.py`); this module names them as `module:attribute` strings and loads
them when first asked, as packaging's entry points do. So it sits at the bottom of parity's layers
and imports no backend: the verdict, the loader and the reports get capabilities as data, on
machines where an engine is not installed, without an import that runs up the layers.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from parity.capabilities import BackendInfo, EngineOption

if TYPE_CHECKING:
    from parity.backends.options import BackendOptions
    from parity.backends.protocol import Backend

# name -> "module:attribute" of its BackendInfo, in the order the command line lists them.
ENTRIES = {
    "transformers": "parity.backends.entry:TRANSFORMERS",
    "sglang": "parity.engines.sglang.entry:SGLANG",
    "vllm": "parity.engines.vllm.entry:VLLM",
}
DEFAULT = "transformers"


class _Entries(Mapping[str, BackendInfo]):
    """`ENTRIES` loaded on first use (each a light module: no torch, no engine)."""

    def __init__(self) -> None:
        self._loaded: dict[str, BackendInfo] = {}

    def __getitem__(self, name: str) -> BackendInfo:
        if name not in self._loaded:
            module, attribute = ENTRIES[name].split(":")
            self._loaded[name] = getattr(importlib.import_module(module), attribute)
        return self._loaded[name]

    def __iter__(self) -> Iterator[str]:
        return iter(ENTRIES)

    def __len__(self) -> int:
        return len(ENTRIES)


BACKENDS: Mapping[str, BackendInfo] = _Entries()


def info(name: object) -> BackendInfo:
    """The backend a results file names; one parity does not know reads as the in-process one."""
    return BACKENDS.get(str(name), BACKENDS[DEFAULT])


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
