"""What parity checks about SGLang before starting servers, and about a running server before
trusting its answers (beyond the tap).

Before: SGLang installed, a GPU (or `--device cpu`), parity's plugin registered, the graph backend
possible on the device, the fix's SGLang version; each failure is a usage error (exit 2).

While running, each check reads what the server's own processes wrote, never what its flags imply,
and returns a one-line problem (the caller turns it into the arm's `ERROR`) or None:

- the dtype the model really runs in (the embeddings the tap saw) is the one parity asked for
  (SGLang silently runs a float32 checkpoint in float16 under `--dtype auto`);
- parity's DeepStack slot fix, when asked for, is in place in the bcg server's prefill runner.
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

from parity.errors import BackendUnavailableError
from parity.engines.sglang import deepstack_slot, plugin
from parity.engines.fix_records import read_records
from parity.engines.settings import EnginePackage
from parity.engines.sglang.plugin import TapEntry


# --- before any server starts --------------------------------------------------------------------------

PACKAGE = EnginePackage("sglang", "SGLang", "0.5.23", "sglang", plugin.ENTRY_POINT_GROUP, plugin.ENTRY_POINT_NAME)


def check_fix_version(fix: str | None) -> None:
    version = deepstack_slot.installed_sglang()
    if fix is not None and version != deepstack_slot.WRITTEN_FOR:
        raise BackendUnavailableError(f"--sglang-fix {fix} was written against SGLang {deepstack_slot.WRITTEN_FOR}'s "
                                      f"prefill graph runner; this environment has SGLang {version}")


# --- a running server ----------------------------------------------------------------------------------

def served_dtype(entries: Sequence[TapEntry]) -> str | None:
    dtypes = sorted({e.dtype for e in entries if e.dtype})
    return ",".join(dtypes) if dtypes else None


def dtype_problem(served: str | None, asked: str | None) -> str | None:
    if asked in (None, "auto") or served is None or served == f"torch.{asked}":
        return None
    return f"the model runs in {served}, not the {asked} parity asked for with --dtype"


def fix_problem(channel: Path, fix: str | None, mode: str) -> tuple[str | None, list[dict]]:
    """(problem, the slot records) for a server asked to run `fix`; only a bcg server builds a slot."""
    if not fix:
        return None, []
    records = read_records(channel)
    refused = [r for r in records if r.refused]
    if refused:
        return f"parity's {fix} fix refused to install: {refused[0].note}", [r.to_json() for r in records]
    if mode != "bcg":
        return None, [r.to_json() for r in records]
    slots = [r for r in records if r.slot is not None]
    if not slots:
        why = records[0].note if records else "no prefill graph runner reported it (is the prefill graph disabled?)"
        return (f"parity's {fix} fix was asked for but the bcg server's prefill runner has no DeepStack slot: {why}",
                [r.to_json() for r in records])
    return None, [r.to_json() for r in records]
