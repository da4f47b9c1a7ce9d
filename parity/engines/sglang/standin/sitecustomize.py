"""parity's start-up hook for the SGLang servers it launches on a CPU.

This folder is on the PYTHONPATH of those servers only, so every process SGLang starts (launcher,
tokenizer, scheduler, detokenizer) runs this before anything else. It changes nothing unless
parity's variables are set: then it installs the CPU changes of parity/engines/sglang/cpu_patches.py.
A sitecustomize this one shadows (a distribution's own) still runs, after it.
"""

import importlib.machinery
import importlib.util
import os
import sys
from pathlib import Path


def _run_shadowed() -> None:
    here = Path(__file__).resolve().parent
    rest = [p for p in sys.path if Path(p or ".").resolve() != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
    if spec is not None and spec.loader is not None:
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)


if os.environ.get("PARITY_SGLANG_CPU"):
    from parity.engines.sglang.cpu_patches import install

    install(os.environ)
_run_shadowed()
