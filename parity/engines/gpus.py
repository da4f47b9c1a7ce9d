"""What nvidia-smi says about the GPUs: their names, their free memory, whether any is present.

Read from the launcher's process, not from torch: parity's own process may have no CUDA torch, and
engines size a server's KV cache from the memory they find when it starts.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from typing import Sequence


def gpu_name(gpus: tuple[int, ...]) -> str | None:
    names = [line.strip() for line in nvidia_smi("--query-gpu=name", "--format=csv,noheader").splitlines()
             if line.strip()]
    index = gpus[0] if gpus else 0
    return names[index] if index < len(names) else None


def gpu_memory(gpus: Sequence[int] | None, count: int) -> tuple[float, float] | None:
    """(free, total) MiB of the tightest of a server's GPUs, as nvidia-smi reports them now; None
    where it cannot tell. Without --gpus, the server's GPUs are the first `count` visible ones
    (CUDA_VISIBLE_DEVICES, when it lists indexes; nvidia-smi itself ignores it)."""
    rows = {}
    for line in nvidia_smi("--query-gpu=index,memory.free,memory.total", "--format=csv,noheader,nounits").splitlines():
        try:
            index, free, total = (float(x) for x in line.split(","))
        except ValueError:
            continue
        rows[int(index)] = (free, total)
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "")
    if gpus:
        chosen = list(gpus)
    elif visible.strip():
        try:
            chosen = [int(v) for v in visible.split(",")][:count]
        except ValueError:  # UUIDs or MIG names: not matched to nvidia-smi's indexes here
            return None
    else:
        chosen = sorted(rows)[:count]
    found = [rows[i] for i in chosen if i in rows]
    return min(found) if found and len(found) == len(chosen) else None


def gpu_count() -> int | None:
    """How many GPUs nvidia-smi lists (its indexes are what --gpus names); None: it cannot tell."""
    listing = nvidia_smi("-L")
    return sum(line.startswith("GPU ") for line in listing.splitlines()) if listing else None


def visible_gpu_count() -> int | None:
    """How many GPUs a server started without --gpus can use: CUDA_VISIBLE_DEVICES, else nvidia-smi's."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return len([v for v in visible.split(",") if v.strip()])
    return gpu_count()


def nvidia_smi(*args: str) -> str:
    """nvidia-smi's output, or "" where it is missing or fails (then there is no GPU to name)."""
    if shutil.which("nvidia-smi") is None:
        return ""
    try:
        return subprocess.run(["nvidia-smi", *args], capture_output=True, text=True, timeout=20, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return ""


def cuda_present() -> bool:
    try:
        import torch

        if torch.cuda.is_available():
            return True
    except ImportError:
        pass
    return "GPU" in nvidia_smi("-L")
