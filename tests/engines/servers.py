"""What the engine tests share about the servers they start (a helper module, not a test module):
where each stand-in is, and whether a stopped server left a process behind."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import re
import time
from pathlib import Path

from parity.engines.sglang import versions as sglang_versions

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
SGLANG_STANDIN = HERE / "sglang_standin.py"
VLLM_STANDIN = HERE / "vllm_standin.py"


def standin_identity():
    """What a stand-in server serves as `tiny-standin` (the backends' `identity`): a checkpoint whose
    files are the stand-ins' sources."""
    import hashlib

    from parity.model_identity import CHECKPOINT, ModelIdentity

    digest = hashlib.sha256(SGLANG_STANDIN.read_bytes() + VLLM_STANDIN.read_bytes()).hexdigest()
    return ModelIdentity("tiny-standin", CHECKPOINT, None, digest)


def running(pid: int) -> bool:
    """True while `pid` runs; a zombie nobody reaped (PID 1 here may not) has stopped running."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat[stat.rindex(")") + 2] not in "ZX"


def pids_in_logs(run_dir: Path) -> list[int]:
    """The leader and child pids of every stand-in (either engine) launched into `run_dir`."""
    text = "".join(p.read_text() for p in run_dir.glob("*.log"))
    return [int(p) for p in re.findall(r"standin: (?:pid|scheduler pid|engine core pid) (\d+)", text)]


def assert_nothing_left(run_dir: Path) -> None:
    pids = pids_in_logs(run_dir)
    assert pids, "the stand-in never started"
    deadline = time.monotonic() + 2.0
    while any(map(running, pids)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert [p for p in pids if running(p)] == []


SGLANG_VERSION = sglang_versions.NEWEST.version  # what CI's SGLang stage installs


def installed(package: str) -> str | None:
    """The version of `package` this Python environment has (None: not installed)."""
    if importlib.util.find_spec(package) is None:
        return None
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def real_vllm_marks() -> list:
    """The marks of a module that runs the real vLLM: `real_vllm`, and skipped (saying why) unless the
    installed vLLM is a release parity supports (parity/engines/vllm/versions.py)."""
    import pytest

    from parity.engines.vllm import versions

    found = installed("vllm")
    return [pytest.mark.real_vllm,
            pytest.mark.skipif(versions.release(found) is None, reason=(
                f"needs a vLLM parity supports ({versions.supported()}), found {found or 'none'}; "
                "scripts/setup_vllm_env.sh --version V sets up an environment that has it"))]
