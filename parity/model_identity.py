"""Which model a results file judged (design §4b, v5): a preset's name, seed and a hash of its built
weights, or a checkpoint's content hash. Recorded in `config.model_identity` by every backend,
required by the loader, equal across the shards of one merge (named first when they differ), and
shown in the report.

A name says nothing of the weights behind it: `--model DIR` may point at one checkpoint on one CI
machine and another elsewhere, and a preset's seed is one edited field. The identity is read from
the weights themselves, and verified where weights load again (`parity localize` refuses other
weights; a known build of a preset is checked by the loader). A checkpoint's files are hashed once
and the hashes kept in parity's cache, keyed by path, inode, change and modification times and size
(a same-size, same-mtime swap changes the inode or the change time), so a 16 GB checkpoint is not
read again every run; the cache is read as every user file is (regular, bounded, non-blocking) and
ignored, with a warning, on any refusal. One checkpoint at two paths is one model. Torch-free: the
loader reads it.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Mapping

from parity.textfiles import NotAFile, TooLarge, described, read_chunks, read_text_capped

CONFIG_KEY = "model_identity"
PRESET, CHECKPOINT = "preset", "checkpoint"
# Files of a checkpoint folder that do not change what it computes.
_IGNORED_SUFFIXES = (".md", ".txt.lock", ".lock")
_CHUNK = 16 * 2**20
# A line per checkpoint file: a cache of a million files is past any real use, and reading more is a hang.
MAX_CACHE_BYTES = 256 * 2**20
# The weights a preset's recipe builds (float32 on the CPU, x86_64), where known: a file that says it
# judged that preset at that seed with other weights was edited. Other machines' random streams may
# round otherwise (not recorded), and other presets' layouts follow the transformers release.
KNOWN_BUILDS: Mapping[tuple[str, int, str], str] = {
    ("tiny-qwen3-vl", 0, "x86_64"): "7e8c9f35fa8742968e2163ffbe8ca4d74895f35eda0431d85cf100185c9318fb",
}


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
        from parity.presets import PRESETS

        shape = self.name in PRESETS and PRESETS[self.name].shape is not None  # identified by its recipe
        what = f"preset, seed {self.seed}, {'recipe' if shape else 'weights'}" if self.kind == PRESET else "checkpoint, files"
        return f"{self.name} ({what} sha256 {self.sha256[:12]}…)"

    def weights(self) -> tuple:
        """What decides the weights: a checkpoint's files, wherever its folder is; a preset's name,
        seed and build."""
        return (self.kind, self.sha256) if self.kind == CHECKPOINT else (self.kind, self.name, self.seed, self.sha256)


def same_model(a: ModelIdentity, b: ModelIdentity) -> bool:
    """One model: one checkpoint at two paths is one model, a preset is its name, seed and build."""
    return a.weights() == b.weights()


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
        # The inode and change time too: a file swapped for another of the same size and mtime gets a
        # new inode (a rename over it) or a new change time (a copy into it, a touch to reset the mtime).
        key = (f"{os.path.realpath(path)}|{status.st_ino}|{status.st_ctime_ns}|{status.st_mtime_ns}|"
               f"{status.st_size}")
        file_sha = None if known is None else known.get(key)
        if file_sha is None:
            file_sha = _file_sha256(path)
            if known is not None:
                known[key], changed = file_sha, True
        digest.update(f"{path.name}\0{file_sha}\n".encode())
    if changed:
        _write_cache(cache, known)
    return digest.hexdigest()


def _file_sha256(path: Path) -> str:
    from parity.textfiles import NotAFile

    digest = hashlib.sha256()
    try:
        for chunk in read_chunks(path, _CHUNK):
            digest.update(chunk)
    except NotAFile as err:  # said with the file it is about
        raise NotAFile(f"{path.name} {err}") from None
    return digest.hexdigest()


def _cache_path() -> Path:
    root = os.environ.get("PARITY_CACHE_DIR") or Path.home() / ".cache" / "parity"
    return Path(root) / "file-hashes.json"


def _read_cache(path: Path) -> dict[str, str] | None:
    """The cached file hashes; {} for no cache yet or a damaged one (hashed again), None for a path
    that is refused as any user file is (not a regular file, too large, a read that would block):
    then it is neither read nor written, and the run says so."""
    try:
        raw = json.loads(read_text_capped(path, MAX_CACHE_BYTES))
    except FileNotFoundError:
        return {}
    except (NotAFile, TooLarge) as err:
        print(f"warning: the checkpoint hash cache {path} {err}; ignored (every file is hashed)", file=sys.stderr)
        return None
    except OSError as err:
        print(f"warning: the checkpoint hash cache {path} cannot be read ({described(err)}); ignored", file=sys.stderr)
        return None
    except ValueError:  # damaged (not UTF-8, not JSON): hashed again, and rewritten
        return {}
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
    from parity.textfiles import NotAFile, TooLarge

    try:
        return ModelIdentity(name, CHECKPOINT, None, checkpoint_sha256(folder))
    except (NotAFile, TooLarge) as err:  # a link to /proc/kmsg, a device: nothing a checkpoint holds
        raise ModelUnavailableError(f"model {name!r}: its file {err}, not a checkpoint file") from None
    except OSError as err:
        raise ModelUnavailableError(f"model {name!r}: its files cannot be read to record which weights were "
                                    f"judged ({err.strerror or err})") from None
