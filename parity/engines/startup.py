"""What parity's start-up hooks share: the `sitecustomize` each CPU engine's stand-in folder holds.

A stand-in folder goes first on the PYTHONPATH of the servers parity starts (never on parity's
own), so every process the engine starts runs its `sitecustomize` before anything else. That hook
installs parity's in-process changes only when parity's variable is set, then runs the
`sitecustomize` it shadows (a distribution's own), so nothing else changes.

Standard library only: this runs first in every server process.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import sys
from pathlib import Path


def run_shadowed(hook_file: str) -> None:
    """Run the `sitecustomize` that the hook at `hook_file` shadows on sys.path, if there is one."""
    here = Path(hook_file).resolve().parent
    rest = [p for p in sys.path if Path(p or ".").resolve() != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
    if spec is not None and spec.loader is not None:
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)


def standin_env(standin_dir: Path, threads: int | None) -> dict[str, str]:
    """What every CPU server parity starts gets, whatever the engine: the stand-in folder first on
    its PYTHONPATH (parity's own stays as it is), and capped threads. One thread per process unless
    asked: the presets are tiny, engines run several processes, and a CPU machine running out of
    threads kills launches (OpenBLAS pthread_create)."""
    existing = os.environ.get("PYTHONPATH", "")
    count = str(threads or 1)
    return {"PYTHONPATH": os.pathsep.join(p for p in (str(standin_dir), existing) if p),
            "OMP_NUM_THREADS": count, "MKL_NUM_THREADS": count, "OPENBLAS_NUM_THREADS": count}
