"""The call log of stand-in ops: what a CPU server's stand-in for a compiled op writes when it is
called after all, and what parity reads back to fail the arm naming the op (design §6).

A stand-in op answers an engine's import-time look-ups so a CPU server can start; it must never
compute an answer. Calling it appends one JSON line to the file named by the engine's variable
and raises, so the run is an `ERROR` naming the op, never an answer computed by something else.
Stdlib only: the stubs run inside the servers.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping


class StandinCalled(NotImplementedError):
    """A stand-in op was called: this run needed a compiled kernel that is not here."""


@dataclass(frozen=True)
class StandinCall:
    op: str
    pid: int

    @classmethod
    def from_json(cls, raw: dict) -> "StandinCall":
        return cls(str(raw.get("op", "?")), int(raw.get("pid", 0)))


def read_calls(path: Path) -> list[StandinCall]:
    """The stub calls logged in `path` (none when the file does not exist)."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return []
    calls = []
    for line in text.splitlines():
        try:
            calls.append(StandinCall.from_json(json.loads(line)))
        except (ValueError, TypeError, AttributeError):
            calls.append(StandinCall(f"<unreadable call record: {line[:80]!r}>", 0))
    return calls


def stub(name: str, env_var: str, what: str, environ: Mapping[str, str] = os.environ) -> Callable[..., Any]:
    """A callable that stands for compiled op `name` of `what` (e.g. "sgl_kernel"): calling it logs
    the call to the file `environ[env_var]` names and raises."""

    def standin_op(*args: Any, **kwargs: Any) -> Any:
        where = environ.get(env_var)
        if where:
            with open(where, "a", encoding="utf-8") as log:
                log.write(json.dumps({"op": name, "pid": os.getpid()}) + "\n")
        print(f"parity: {what} stand-in op {name} was called", file=sys.stderr, flush=True)
        raise StandinCalled(f"{name} is a stand-in for a compiled {what} kernel that this CPU run does not have")

    standin_op.__name__ = standin_op.__qualname__ = name.rsplit(".", 1)[-1]
    return standin_op


@dataclass(frozen=True)
class StandinLog:
    """Where a server's stand-in ops log their calls, and whose ops they stand for."""

    path: Path
    what: str  # "sgl_kernel"
    engine: str  # "SGLang"

    def problem(self) -> str | None:
        calls = read_calls(self.path)
        if not calls:
            return None
        ops = sorted({c.op for c in calls})
        return (f"the {self.what} stand-in op {', '.join(ops)} was called (pid {calls[0].pid}): {self.engine} took "
                f"a path that needs a compiled kernel this CPU run does not have, so its answers cannot be trusted "
                f"({self.path})")
