"""Changing an engine's module right after it executes, in the processes parity starts: one
import-time finder per process, for every engine (SGLang's CPU changes, vLLM's tap).

A change applied right after the module's own code ran binds before any `from X import f`
elsewhere, and the module is never imported early (importing a model module may initialise CUDA,
and only the process that runs the model imports it at all). The finder asks the other finders for
the module, wraps the loader it gets (forwarding every attribute, so `get_source`, `is_package` and
the rest still answer), and runs every change registered for that module, in order. A per-thread
guard keeps a lookup from re-entering itself: another finder that also asks "every other finder"
(as two separate finders once did for one module) gets no answer from this one while its own lookup
is under way, instead of a RecursionError.

Standard library only: this is imported in every engine process, before the engine.
"""

from __future__ import annotations

import importlib.abc
import sys
import threading
import types
from typing import Any, Callable

Patch = Callable[[types.ModuleType], None]


class _PatchingLoader(importlib.abc.Loader):
    def __init__(self, loader: Any, patches: list[Patch]) -> None:
        self.loader, self.patches = loader, patches

    def __getattr__(self, name: str) -> Any:
        return getattr(self.loader, name)  # get_source, get_filename, is_package, ... as the real loader

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module: types.ModuleType) -> None:
        self.loader.exec_module(module)
        for patch in list(self.patches):
            patch(module)


class AfterImport(importlib.abc.MetaPathFinder):
    """Finds a target module through the other finders, and runs its patches once it has executed."""

    def __init__(self) -> None:
        self.patches: dict[str, list[Patch]] = {}
        self._looking = threading.local()

    def find_spec(self, fullname: str, path: Any = None, target: Any = None):
        patches = self.patches.get(fullname)
        looking = self._looking.__dict__.setdefault("names", set())
        if not patches or fullname in looking:
            return None
        looking.add(fullname)
        try:
            spec = next((found for finder in list(sys.meta_path) if finder is not self
                         and hasattr(finder, "find_spec")
                         for found in (finder.find_spec(fullname, path, target),) if found is not None), None)
        finally:
            looking.discard(fullname)
        if spec is not None and spec.loader is not None:
            spec.loader = _PatchingLoader(spec.loader, patches)
        return spec


FINDER = AfterImport()


def after_import(name: str, patch: Patch) -> None:
    """Run `patch(module)` right after module `name` executes (now, if it already has). Patches of
    one module run in the order they were registered; the same patch is registered once."""
    if name in sys.modules:
        patch(sys.modules[name])
        return
    patches = FINDER.patches.setdefault(name, [])
    if patch not in patches:
        patches.append(patch)
    if FINDER not in sys.meta_path:
        sys.meta_path.insert(0, FINDER)


def around(original: Callable, call: Callable[..., Any], flag: str) -> Callable:
    """A method that calls `call(original, self, *args, **kwargs)` in place of `original`, under the
    original's name, signature and docstring (`__wrapped__`), marked with `flag` so a patch applied
    twice can tell it is already there."""
    import functools

    @functools.wraps(original, updated=())
    def method(owner: Any, *args: Any, **kwargs: Any) -> Any:
        return call(original, owner, *args, **kwargs)

    setattr(method, flag, True)
    return method
