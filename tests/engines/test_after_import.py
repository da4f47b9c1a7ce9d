"""The one import-time finder both engines use (parity/engines/after_import.py): changes applied right
after a module executes, several per module, the real loader still answering, and no recursion with
another finder that asks every other finder too (found serving vLLM on a CPU, where SGLang's CPU
finder and vLLM's tap finder were both needed in one process)."""

from __future__ import annotations

import importlib.abc
import sys
import types
from pathlib import Path

import pytest

from parity.engines import after_import


@pytest.fixture
def module_dir(tmp_path: Path, monkeypatch):
    (tmp_path / "parity_probe_mod.py").write_text("def f():\n    return 'original'\n\nvalue = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield tmp_path
    sys.meta_path[:] = [m for m in sys.meta_path if m is not after_import.FINDER and not isinstance(m, _AskingFinder)]
    after_import.FINDER.patches.pop("parity_probe_mod", None)
    sys.modules.pop("parity_probe_mod", None)


class _AskingFinder(importlib.abc.MetaPathFinder):
    """Another finder of the same kind: it asks every other finder for the module."""

    def __init__(self) -> None:
        self.asked = 0

    def find_spec(self, fullname, path=None, target=None):
        if fullname != "parity_probe_mod":
            return None
        self.asked += 1
        for finder in list(sys.meta_path):
            if finder is not self and hasattr(finder, "find_spec"):
                spec = finder.find_spec(fullname, path, target)
                if spec is not None:
                    return spec
        return None


def test_every_change_of_a_module_applies_in_order_after_it_executes(module_dir):
    seen = []

    def first(module: types.ModuleType) -> None:
        seen.append(("first", module.value))
        module.f = lambda: "changed"

    def second(module: types.ModuleType) -> None:
        seen.append(("second", module.f()))

    after_import.after_import("parity_probe_mod", first)
    after_import.after_import("parity_probe_mod", second)
    after_import.after_import("parity_probe_mod", first)  # registered once
    from parity_probe_mod import f  # a later `from X import f` binds the changed name

    assert f() == "changed" and seen == [("first", 1), ("second", "changed")]
    assert sum(m is after_import.FINDER for m in sys.meta_path) == 1
    import parity_probe_mod

    assert parity_probe_mod.__spec__.loader.get_source("parity_probe_mod").startswith("def f()")  # forwarded


def test_a_module_already_imported_is_changed_at_once(module_dir):
    import parity_probe_mod

    after_import.after_import("parity_probe_mod", lambda module: setattr(module, "value", 2))
    assert parity_probe_mod.value == 2 and "parity_probe_mod" not in after_import.FINDER.patches


def test_another_finder_that_asks_every_finder_does_not_recurse(module_dir):
    asking = _AskingFinder()
    sys.meta_path.insert(0, asking)
    after_import.after_import("parity_probe_mod", lambda module: setattr(module, "value", 3))
    import parity_probe_mod  # without the guard: RecursionError between the two finders

    assert parity_probe_mod.value == 3 and asking.asked >= 1
