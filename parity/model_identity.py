"""Which model a results file judged (design §4b, v5): a preset's name, seed and a hash of its built
weights, or a checkpoint's content hash. Recorded in `config.model_identity` by every backend,
required by the loader, equal across the shards of one merge (named first when they differ), and
shown in the report.

A name says nothing of the weights behind it: `--model DIR` may point at one checkpoint on one CI
machine and another elsewhere, and a preset's seed is one edited field. The identity is read from
the weights themselves. A checkpoint's files are hashed once and the hashes kept in parity's cache,
keyed by path, modification time and size, so a 16 GB checkpoint is not read again every run.
Torch-free: the loader reads it.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Mapping

CONFIG_KEY = "model_identity"
PRESET, CHECKPOINT = "preset", "checkpoint"
# Files of a checkpoint folder that do not change what it computes.
_IGNORED_SUFFIXES = (".md", ".txt.lock", ".lock")
_CHUNK = 16 * 2**20


@dataclass(frozen=True)
class ModelIdentity:
    """What a run judged: `name` as `--model` gave it, `kind` preset or checkpoint, a preset's `seed`,
    and `sha256`: a preset's built weights (float32, every tensor by name), or a checkpoint's files."""

    name: str
    kind: str
    seed: int | None
    sha256: str

    def to_json(self) -> dict:
        return {"name": self.name, "kind": self.kind, "seed": self.seed, "sha256": self.sha256}

    def describe(self) -> str:
        """`tiny-qwen3-vl (preset, seed 0, weights sha256 1a2b3c4d5e6f…)`."""
        what = f"preset, seed {self.seed}, weights" if self.kind == PRESET else "checkpoint, files"
        return f"{self.name} ({what} sha256 {self.sha256[:12]}…)"


def read_identity(raw: Any) -> ModelIdentity:
    """`config.model_identity` parsed; ValueError names what is wrong (the loader adds the place)."""
    import re

    if not isinstance(raw, dict):
        raise ValueError("must be an object: every run records the model it judged since parity's v5 results "
                         "(run it again)")
    extra = set(raw) - {"name", "kind", "seed", "sha256"}
    if extra:
        raise ValueError(f"has unknown key {sorted(extra)[0]!r}")
    name, kind, seed, sha = (raw.get(k) for k in ("name", "kind", "seed", "sha256"))
    if not isinstance(name, str) or not name.strip():
        raise ValueError("name must be the model's name")
    if kind not in (PRESET, CHECKPOINT):
        raise ValueError(f"kind must be {PRESET!r} or {CHECKPOINT!r}, got {kind!r}")
    if kind == PRESET and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise ValueError(f"seed must be the preset's seed, got {seed!r}")
    if kind == CHECKPOINT and seed is not None:
        raise ValueError("seed must be null for a checkpoint")
    if not isinstance(sha, str) or not re.fullmatch(r"[0-9a-f]{64}", sha):
        raise ValueError("sha256 must be 64 lowercase hex digits")
    return ModelIdentity(name, kind, seed, sha)


# --- a preset's weights ------------------------------------------------------------------------------

def weights_sha256(tensors: Iterable[tuple[str, Any]]) -> str:
    """sha256 over (name, dtype, shape, bytes) of every tensor, in name order: a model's weights as
    numbers, whatever file or process holds them (torch tensors; torch is imported by the caller)."""
    import torch

    digest = hashlib.sha256()
    for name, tensor in sorted(tensors, key=lambda item: item[0]):
        array = tensor.detach().cpu().contiguous()
        digest.update(f"{name}\0{array.dtype}\0{tuple(array.shape)}\0".encode())
        digest.update(array.reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


# --- a checkpoint's files ------------------------------------------------------------------------------

def checkpoint_files(folder: Path) -> list[Path]:
    """The files of a checkpoint folder that decide what it computes: every top-level regular file
    (config, weights index, weight files, tokenizer and processor files), symbolic links followed
    (a hub snapshot's files are links into its blobs), dotfiles and notes left out."""
    files = []
    for path in sorted(folder.iterdir()):
        if path.name.startswith(".") or path.name.lower().endswith(_IGNORED_SUFFIXES):
            continue
        try:
            if stat.S_ISREG(os.stat(path).st_mode):
                files.append(path)
        except OSError:
            continue  # a dangling link: not part of what loads
    return files


def checkpoint_sha256(folder: str | Path, cache: Path | None = None) -> str:
    """sha256 over (file name, file sha256) of `checkpoint_files(folder)`; each file's own hash is
    reused from `cache` while its path, modification time and size are unchanged."""
    folder = Path(folder)
    cache = cache or _cache_path()
    known = _read_cache(cache)
    digest, changed = hashlib.sha256(), False
    for path in checkpoint_files(folder):
        status = os.stat(path)
        key = f"{os.path.realpath(path)}|{status.st_mtime_ns}|{status.st_size}"
        file_sha = known.get(key)
        if file_sha is None:
            file_sha = known[key] = _file_sha256(path)
            changed = True
        digest.update(f"{path.name}\0{file_sha}\n".encode())
    if changed:
        _write_cache(cache, known)
    return digest.hexdigest()


def _file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _cache_path() -> Path:
    root = os.environ.get("PARITY_CACHE_DIR") or Path.home() / ".cache" / "parity"
    return Path(root) / "file-hashes.json"


def _read_cache(path: Path) -> dict[str, str]:
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}  # no cache yet, or a damaged one: hashed again
    return {k: v for k, v in raw.items() if isinstance(k, str) and isinstance(v, str)} if isinstance(raw, dict) else {}


def _write_cache(path: Path, known: Mapping[str, str]) -> None:
    from parity.textfiles import write_atomically

    try:
        write_atomically(path, json.dumps(dict(known), indent=0, sort_keys=True))
    except OSError:
        pass  # a read-only cache: the next run hashes again, nothing is wrong


def checkpoint_folder(name: str) -> Path | None:
    """The local folder of a checkpoint: the folder itself, or a hub id's cached snapshot (None when
    the hub cache holds no config.json for it)."""
    path = Path(name).expanduser()
    if path.is_dir():
        return path
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:  # pragma: no cover - transformers brings it
        return None
    found = try_to_load_from_cache(name, "config.json")
    return Path(found).parent if isinstance(found, str) else None


def of_checkpoint(name: str) -> ModelIdentity:
    """A checkpoint's identity by its files; `ModelUnavailableError` when they cannot be found."""
    from parity.errors import ModelUnavailableError

    folder = checkpoint_folder(name)
    if folder is None:
        raise ModelUnavailableError(f"model {name!r}: its files are not in a local folder or the Hugging Face cache, "
                                    "so parity cannot record which weights it judged")
    try:
        return ModelIdentity(name, CHECKPOINT, None, checkpoint_sha256(folder))
    except OSError as err:
        raise ModelUnavailableError(f"model {name!r}: its files cannot be read to record which weights were "
                                    f"judged ({err.strerror or err})") from None
