"""What parity checks about a running SGLang server before trusting its answers, beyond the tap.

Each check reads what the server's own processes wrote, never what its flags imply, and returns a
one-line problem (the caller turns it into the arm's `ERROR`) or None:

- no `sgl_kernel` stand-in op was called (a CPU server that needed a compiled kernel computed
  nothing trustworthy; the message names the op);
- the dtype the model really runs in (the embeddings the tap saw) is the one parity asked for
  (SGLang silently runs a float32 checkpoint in float16 under `--dtype auto`);
- parity's DeepStack slot fix, when asked for, is in place in the bcg server's prefill runner.
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

from parity.sglang import deepstack_slot
from parity.sglang.kernel_standin import read_calls
from parity.sglang.plugin import TapEntry


def standin_problem(calls_file: Path | None) -> str | None:
    calls = read_calls(calls_file) if calls_file is not None else []
    if not calls:
        return None
    ops = sorted({c.op for c in calls})
    return (f"the sgl_kernel stand-in op {', '.join(ops)} was called (pid {calls[0].pid}): SGLang took a path that "
            f"needs a compiled kernel this CPU run does not have, so its answers cannot be trusted ({calls_file})")


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
    records = deepstack_slot.read_records(channel)
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
