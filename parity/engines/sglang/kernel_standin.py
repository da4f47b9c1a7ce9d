"""A stand-in for SGLang's compiled `sgl_kernel` package, for the servers parity starts on a CPU.

The registry's `sglang-kernel` wheels are CUDA-only: importing them needs `libcuda.so.1`, and they
hold no `*_cpu` op (docs/engines/sglang-cpu.md). On a CPU without AMX, SGLang never calls a CPU kernel (every
layer falls back to plain torch), but modules look the ops up at import time. The stand-in answers
those look-ups with stubs that, if called after all, write the call where parity reads it
(`PARITY_SGLANG_STANDIN_CALLS`) and raise, so a run that needed a compiled kernel is an `ERROR`
naming the op, never an answer computed by something else.

- `torch.ops.sgl_kernel`: names ending in `_cpu` are stubs, except the ones SGLang probes with
  `hasattr` to choose a path, which stay absent (their presence would switch on fused or AMX code
  paths, or make SGLang register fakes for ops that do not exist).
- the `sgl_kernel` module (parity/engines/sglang/standin/sgl_kernel): every attribute is a stub; the
  submodules that are pure Python in the real wheel are executed from the installed real package's
  own files (nothing of SGLang's is copied into parity); every other submodule is a stub module.

The stand-in lives in a folder put first on the **server's** `PYTHONPATH` only; the real package
stays installed and untouched.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
import types
from pathlib import Path
from typing import Any, Callable, Sequence

from parity.engines import standin_calls

ENV_CALLS = "PARITY_SGLANG_STANDIN_CALLS"  # a file: one JSON line per stub call
PACKAGE = "sgl_kernel"
STANDIN_DIR = Path(__file__).resolve().parent / "standin"  # what goes on the server's PYTHONPATH
# Names SGLang 0.5.23 probes with hasattr(torch.ops.sgl_kernel, ...) to pick a path (docs/engines/sglang-cpu.md).
PROBED_ABSENT = frozenset({
    "convert_weight_packed", "fused_qk_norm_cpu", "fused_qk_norm_rope_cpu", "shm_group_initialize",
    "gdn_attention", "get_device_accessible_ptr",
})
# Submodules of the real wheel that are plain Python with no compiled op behind them.
REAL_SUBMODULES = frozenset({"scalar_type", "version"})


def call_log(path: Path) -> standin_calls.StandinLog:
    """Where a server's `sgl_kernel` stand-in logs its calls (ENV_CALLS), as parity reads it back."""
    return standin_calls.StandinLog(path, PACKAGE, "SGLang")


def stub(name: str, environ=os.environ) -> Callable[..., Any]:
    """A callable that stands for compiled op `name`: calling it logs the call and raises."""
    return standin_calls.stub(name, ENV_CALLS, PACKAGE, environ)


class OpsNamespace:
    """What `torch.ops.sgl_kernel` answers: `<op>_cpu` stubs, and nothing for probed names."""

    def __init__(self) -> None:
        self._stubs: dict[str, Callable[..., Any]] = {}

    def __getattr__(self, name: str) -> Callable[..., Any]:
        if name.startswith("_") or not name.endswith("_cpu") or name in PROBED_ABSENT:
            raise AttributeError(f"'_OpNamespace' 'sgl_kernel' object has no attribute '{name}'")
        if name not in self._stubs:
            self._stubs[name] = stub(f"torch.ops.sgl_kernel.{name}")
        return self._stubs[name]


def install_ops(torch_module: Any) -> None:
    """Answer `torch.ops.sgl_kernel` look-ups from the stand-in (torch creates namespaces lazily)."""
    setattr(torch_module.ops, PACKAGE, OpsNamespace())


# --- the sgl_kernel module ----------------------------------------------------------------------------

def real_package_dir(search_path: Sequence[str] | None = None) -> Path | None:
    """The installed real `sgl_kernel` package's folder, the stand-in's own folder excluded."""
    paths = [p for p in (search_path if search_path is not None else sys.path)
             if Path(p or ".").resolve() != STANDIN_DIR]
    spec = importlib.machinery.PathFinder.find_spec(PACKAGE, paths)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0])


class StubModule(types.ModuleType):
    """A module of which every public attribute is a stub op."""

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        value = stub(f"{self.__name__}.{name}")
        setattr(self, name, value)
        return value


class _StubLoader(importlib.abc.Loader):
    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        return StubModule(spec.name)

    def exec_module(self, module: types.ModuleType) -> None:
        module.__path__ = []  # a package too: `import sgl_kernel.a.b` gets stubs all the way down


class SubmoduleFinder(importlib.abc.MetaPathFinder):
    """`sgl_kernel.<name>`: the real wheel's file for pure-Python submodules, else a stub module."""

    def __init__(self, real_dir: Path | None) -> None:
        self.real_dir = real_dir

    def find_spec(self, fullname: str, path: Any = None, target: Any = None):
        if not fullname.startswith(PACKAGE + "."):
            return None
        leaf = fullname[len(PACKAGE) + 1:]
        if leaf in REAL_SUBMODULES:
            if self.real_dir is None or not (self.real_dir / f"{leaf}.py").is_file():
                raise ImportError(f"{fullname}: the stand-in loads it from the installed sgl_kernel package, "
                                  "which was not found (install sglang's dependencies, sglang-kernel)")
            return importlib.util.spec_from_file_location(fullname, self.real_dir / f"{leaf}.py")
        return importlib.machinery.ModuleSpec(fullname, _StubLoader(), is_package=True)


def become_standin(namespace: dict) -> None:
    """Turn the module whose globals are `namespace` into the `sgl_kernel` stand-in."""
    finder = SubmoduleFinder(real_package_dir())
    if not any(isinstance(f, SubmoduleFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, finder)
    name = namespace["__name__"]

    def __getattr__(attr: str) -> Any:
        if attr.startswith("__"):
            raise AttributeError(attr)
        value = stub(f"{name}.{attr}")
        namespace[attr] = value
        return value

    namespace["__getattr__"] = __getattr__
    namespace["__path__"] = []  # submodules come from the finder above, never from this folder
    namespace["__parity_standin__"] = True
    if finder.real_dir is not None and (finder.real_dir / "version.py").is_file():
        namespace["__version__"] = importlib.import_module(f"{name}.version").__version__
