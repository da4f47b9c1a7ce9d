"""Proof that a fix parity runs inside an engine's servers is in place: each server process that
applies (or refuses) a fix appends one JSON line to `fix.jsonl` in parity's tap channel folder, and
parity reads them before it trusts the server (design §6). Stdlib only: written inside servers.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Collection, Iterable, Mapping

RECORDS_FILE = "fix.jsonl"


@dataclass(frozen=True)
class FixRecord:
    """What one server process did with the fix: the slot it allocated, or why none / why refused."""

    pid: int
    variant: str
    slot: tuple[int, int] | None  # [max_tokens, hidden x n]; None: no slot
    dtype: str | None
    note: str  # why there is no slot, or what refused the fix
    refused: bool = False
    # The engine does the fix's work itself, so the fix did nothing (the note names the engine's mechanism).
    stood_aside: bool = False
    # Counted at capture: the captured bodies, and how many took the slot (parity's, or where the fix
    # stood aside the engine's) as their DeepStack input; None where nothing was captured with it.
    captures: int | None = None
    reads: int | None = None

    def to_json(self) -> dict:
        return {"pid": self.pid, "variant": self.variant, "slot": None if self.slot is None else list(self.slot),
                "dtype": self.dtype, "note": self.note, "refused": self.refused, "stood_aside": self.stood_aside,
                "captures": self.captures, "reads": self.reads}

    @classmethod
    def from_json(cls, raw: Mapping[str, Any]) -> "FixRecord":
        slot = raw.get("slot")
        counts = [None if raw.get(k) is None else int(raw[k]) for k in ("captures", "reads")]
        return cls(int(raw["pid"]), str(raw["variant"]), None if slot is None else (int(slot[0]), int(slot[1])),
                   raw.get("dtype"), str(raw.get("note", "")), bool(raw.get("refused", False)),
                   bool(raw.get("stood_aside", False)), *counts)


def stood_aside_note(records: Iterable[Mapping[str, Any]]) -> str | None:
    """One line for the report where a fix stood aside for the engine's own mechanism, else None."""
    aside = [r for r in records if isinstance(r, Mapping) and r.get("stood_aside")]
    if not aside:
        return None
    note = f"parity's {aside[0].get('variant')} fix {aside[0].get('note')}"
    counted = [r for r in aside if r.get("captures") is not None]
    if counted:
        reads, captures = (sum(int(r.get(k) or 0) for r in counted) for k in ("reads", "captures"))
        note += f"; the captured bodies read the engine's own slot in {reads} of {captures} captures"
    return note + ". This run judges the engine's own mechanism, not parity's fix"


def read_records(folder: Path) -> list[FixRecord]:
    try:
        lines = (folder / RECORDS_FILE).read_text(encoding="utf-8").splitlines()
    except FileNotFoundError:
        return []
    return [FixRecord.from_json(json.loads(line)) for line in lines if line.strip()]


def append_record(folder: Path | None, record: FixRecord) -> None:
    if folder is None:
        return
    with open(folder / RECORDS_FILE, "a", encoding="utf-8") as out:
        out.write(json.dumps(record.to_json()) + "\n")


def installed_version(package: str) -> str | None:
    """The installed release of `package` (None: not installed): what a fix checks it was written for."""
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def requested_variant(environ: Mapping[str, str], env_var: str, variants: tuple[str, ...],
                      validated: Collection[str], found: str | None, engine: str, records: Path | None) -> str | None:
    """The fix variant this server process was asked for (`environ[env_var]`) and may install, or
    None. A fix validated on some releases refuses any other, and an unknown variant; the refusal
    is recorded for parity to read, and the server serves on without it."""
    variant = environ.get(env_var)
    if not variant:
        return None
    refusal = None
    if variant not in variants:
        refusal = f"unknown variant {variant!r}; known: {', '.join(variants)}"
    elif found not in validated:
        refusal = (f"validated on {engine} {', '.join(validated)}, this is {engine} "
                   f"{found or 'not installed'}")
    if refusal:
        append_record(records, FixRecord(os.getpid(), variant, None, None, refusal, refused=True))
        return None
    return variant
