"""How much memory there is, and what a checkpoint folder needs, known before anything is built.

"Free" is the least of what the kernel says is available and what this process may still take: its
address-space limit (`ulimit -v`, RLIMIT_AS, less what it has mapped already) and its cgroup's
`memory.max` (less what the cgroup uses). A checkpoint is sized from its weight files' headers (every
tensor's shape, without reading a weight), so a config.json that asks for more than its weights hold
(100,000 layers over a 4-layer checkpoint) is refused in one line instead of allocating until killed.
"""

from __future__ import annotations

import json
import re
import struct
from dataclasses import dataclass
from math import prod
from pathlib import Path

from parity.errors import ModelUnavailableError
from parity.presets import WORKSPACE_FLOOR, WORKSPACE_FRACTION, gib

_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")  # a decoder layer's weight; the vision tower's are `blocks.N.`
_MAX_HEADER = 100 * 2**20  # a safetensors header is a few MB at most; more is not a weight file


def host_available() -> int | None:
    """Bytes this process can still allocate on the host, or None where nothing says."""
    bounds = [b for b in (_meminfo_available(), _address_space_left(), _cgroup_left()) if b is not None]
    return min(bounds) if bounds else None


def _meminfo_available() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _address_space_left() -> int | None:
    try:
        import resource

        soft, _ = resource.getrlimit(resource.RLIMIT_AS)
        if soft == resource.RLIM_INFINITY:
            return None
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmSize:"):
                return max(0, soft - int(line.split()[1]) * 1024)
        return soft
    except (ImportError, OSError, ValueError, IndexError):
        return None


def _cgroup_left(root: Path = Path("/sys/fs/cgroup")) -> int | None:
    try:
        limit = (root / "memory.max").read_text().strip()
        if limit == "max":
            return None
        return max(0, int(limit) - int((root / "memory.current").read_text().strip()))
    except (OSError, ValueError):
        return None


@dataclass(frozen=True)
class WeightsOnDisk:
    """What a checkpoint folder's safetensors files hold, read from their headers."""

    parameters: int
    decoder_layers: int  # the highest `layers.N.` index plus one; 0 when no weight names a layer


def weights_on_disk(folder: Path) -> WeightsOnDisk | None:
    """None when the folder has no safetensors file (or one whose header cannot be read: loading it
    then fails with its own one-line error)."""
    parameters, layers, found = 0, 0, False
    for path in sorted(folder.glob("*.safetensors")):
        header = _header(path)
        if header is None:
            return None
        found = True
        for name, entry in header.items():
            if name == "__metadata__" or not isinstance(entry, dict):
                continue
            parameters += prod(int(n) for n in entry.get("shape", ()))
            match = _LAYER.search(name)
            if match:
                layers = max(layers, int(match[1]) + 1)
    return WeightsOnDisk(parameters, layers) if found else None


def _header(path: Path) -> dict | None:
    try:
        with open(path, "rb") as weights:
            (length,) = struct.unpack("<Q", weights.read(8))
            if length > _MAX_HEADER:
                return None
            header = json.loads(weights.read(length))
    except (OSError, struct.error, ValueError):
        return None
    return header if isinstance(header, dict) else None


def check_checkpoint_size(name: str, folder: Path | None, config, itemsize: int) -> None:
    """Before the model is built: the decoder layers config.json asks for are in the weights, and the
    host can hold the weights at `itemsize` bytes a parameter with a workspace."""
    on_disk = None if folder is None else weights_on_disk(folder)
    if on_disk is None:
        return
    text = getattr(config, "text_config", None) or config
    asked = getattr(text, "num_hidden_layers", None)
    if isinstance(asked, int) and on_disk.decoder_layers and asked > on_disk.decoder_layers:
        raise ModelUnavailableError(f"--model {name}: config.json asks for {asked} decoder layers, but its weights "
                                    f"hold {on_disk.decoder_layers}; the config does not describe these weights")
    weights = on_disk.parameters * itemsize
    needed = weights + max(WORKSPACE_FLOOR, int(weights * WORKSPACE_FRACTION))
    free = host_available()
    if free is not None and needed > free:
        raise ModelUnavailableError(f"--model {name}: its {on_disk.parameters / 1e9:.2f} B parameters need "
                                    f"{gib(needed)} of host memory to load, and this process may take {gib(free)}: "
                                    "run it on a larger machine or give a smaller --dtype")
