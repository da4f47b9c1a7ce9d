"""What parity checks about SGLang before starting servers, and about a running server before
trusting its answers (beyond the tap).

Before: SGLang installed, a GPU (or `--device cpu`), parity's plugin registered, the graph backend
possible on the device, the fix's SGLang version; each failure is a usage error (exit 2).

While running, each check reads what the server's own processes wrote, never what its flags imply,
and returns a one-line problem (the caller turns it into the arm's `ERROR`) or None:

- the dtype the model really runs in (the embeddings the tap saw) is the one parity asked for
  (SGLang silently runs a float32 checkpoint in float16 under `--dtype auto`);
- parity's DeepStack slot fix, when asked for, is in place in the bcg server's prefill runner: its
  captured graph reads parity's slot, or the fix stood aside for the engine's own slot and says so.
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

from parity.errors import BackendUnavailableError
from parity.engines.sglang import deepstack_slot, plugin, versions
from parity.engines.fix_records import read_records
from parity.engines.settings import EnginePackage
from parity.engines.sglang.plugin import TapEntry


# --- before any server starts --------------------------------------------------------------------------

PACKAGE = EnginePackage("sglang", "SGLang", versions.NEWEST.version, "sglang", plugin.ENTRY_POINT_GROUP, plugin.ENTRY_POINT_NAME)


def check_fix_version(fix: str | None) -> None:
    version = deepstack_slot.installed_sglang()
    if fix is not None and version not in versions.fix_accepted():
        raise BackendUnavailableError(f"--sglang-fix {fix} is validated on SGLang {', '.join(versions.fix_accepted())}'s "
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
    """(problem, the slot records) for a server asked to run `fix`; only a bcg server builds a slot,
    and parity's slot counts only where the captured graph was seen to read it. A fix that stood
    aside for the engine's own slot is no problem: the run then judges the engine's slot."""
    if not fix:
        return None, []
    records = read_records(channel)
    raw = [r.to_json() for r in records]
    refused = [r for r in records if r.refused]
    if refused:
        return f"parity's {fix} fix refused to install: {refused[0].note}", raw
    if mode != "bcg":
        return None, raw
    captured = [r for r in records if r.captures is not None]
    if not captured:
        why = records[0].note if records else "no prefill graph runner reported it (is the prefill graph disabled?)"
        return f"parity's {fix} fix was asked for but the bcg server's prefill runner has no DeepStack slot: {why}", raw
    unread = [r for r in captured if not r.stood_aside and (not r.captures or r.reads != r.captures)]
    if unread:
        r = unread[0]
        return (f"parity's {fix} fix allocated its slot, but {r.captures - (r.reads or 0)} of {r.captures} captured "
                f"bodies took another tensor as {deepstack_slot.DEEPSTACK_KWARG}: the graph does not read parity's "
                "slot, so the fix is not in place"), raw
    return None, raw

