"""Each mode's server of a server backend: started on demand or in stages, probed once ready,
stopped when its session ends or the backend closes; and tagged requests to it.

An engine backend supplies how to start a mode's server and how to probe it (its command line,
its request bodies); the life of the servers and what a failure means are the same for every
engine: a server that does not come up, or whose tap does not fire, fails its mode's arms.
"""

from __future__ import annotations

import time
import uuid
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Mapping, Sequence

from parity.errors import ArmFailure
from parity.engines import launcher
from parity.engines.channel import TapChannel, TapEntry
from parity.engines.http import ServerRejected, ServerUnreachable, post_json
from parity.engines.standin_calls import StandinLog


@dataclass(frozen=True)
class Server:
    """A ready server of one mode, the channel of its tap, and the log of its stand-in ops (CPU)."""

    process: launcher.ServerProcess
    channel: TapChannel
    standins: StandinLog | None = None

    def standin_failure(self) -> ArmFailure | None:
        """A stand-in op called in this server fails its arms naming the op, whatever it answered."""
        problem = self.standins.problem() if self.standins is not None else None
        return None if problem is None else self.process.failure(problem)


StartFn = Callable[[str, int], Server]  # (mode, its launch count) -> a started server
ProbeFn = Callable[[Server], "ArmFailure | None"]
ExplainFn = Callable[[str, ArmFailure], ArmFailure]  # a mode's start-up failure, with the engine's hint


class ServerPool:
    def __init__(self, start: StartFn, probe: ProbeFn, ready_timeout: float, ready_poll: float, stop_grace: float,
                 explain_exit: ExplainFn | None = None) -> None:
        self._start, self._probe, self._explain = start, probe, explain_exit
        self.ready_timeout, self.ready_poll, self.stop_grace = ready_timeout, ready_poll, stop_grace
        self._servers: dict[str, Server] = {}
        self._failures: dict[str, ArmFailure] = {}
        self._launches: dict[str, int] = {}

    @property
    def launch_count(self) -> int:
        return sum(self._launches.values())

    def launch(self, modes: Sequence[str]) -> None:
        """Start `modes` together and wait until each is ready and probed (or failed)."""
        started = []
        for mode in modes:
            count = self._launches[mode] = self._launches.get(mode, 0) + 1
            try:
                server = self._start(mode, count)
            except ArmFailure as failure:
                self._failures[mode] = failure
                continue
            self._servers[mode] = server  # registered before waiting: a Ctrl-C in start-up still stops it
            started.append(server)
        failures = launcher.wait_ready([s.process for s in started], self.ready_timeout, self.ready_poll)
        for server in started:
            mode = server.process.name
            failure = server.standin_failure() or failures.get(mode)  # a stand-in call names the op
            if failure is not None and self._explain is not None and server.process.exit_code() is not None:
                failure = self._explain(mode, failure)
            failure = failure or self._probe(server)
            if failure is not None:
                self._servers.pop(mode, None)
                server.process.stop(self.stop_grace)
                self._failures[mode] = failure

    @contextmanager
    def serving(self, mode: str) -> Iterator[Server]:
        """The mode's ready server (launched now if need be); stopped when the block ends."""
        if mode not in self._servers and mode not in self._failures:
            self.launch((mode,))
        if mode in self._failures:
            raise self._failures[mode]
        server = self._servers[mode]
        try:
            yield server
        finally:
            # Free the GPU as soon as the mode is done; a later session of the mode launches anew.
            self._servers.pop(mode, None)
            server.process.stop(self.stop_grace)

    def close(self) -> None:
        for mode in list(self._servers):
            self._servers.pop(mode).process.stop(self.stop_grace)


# --- tagged requests ----------------------------------------------------------------------------------

def post_tagged(server: Server, tap: str, path: str, body_for: Callable[[str], Mapping[str, Any]],
                belongs: Callable[[TapEntry, str], bool] = lambda entry, tag: True) -> tuple[str, dict, list[TapEntry]]:
    """POST one request under a fresh tag with the tap armed in `tap` mode: (the tag, the answer,
    the entries the tap recorded for it that `belongs` to it)."""
    tag = uuid.uuid4().hex
    server.channel.arm(tap, tag)
    try:
        doc = post(server.process, path, body_for(tag))
    finally:
        server.channel.disarm()
    return tag, doc, [e for e in server.channel.entries(tag) if belongs(e, tag)]


def post(process: launcher.ServerProcess, path: str, body: Mapping[str, Any]) -> dict:
    """The answer, or the ArmFailure that a rejected request or a lost server means for the arm."""
    try:
        return post_json(f"{process.base_url}{path}", body)
    except ServerRejected as err:
        raise process.failure(str(err)) from None
    except ServerUnreachable as err:
        if _exited_within(process, 5.0):
            raise process.failure(f"died mid-run with code {process.exit_code()}") from None
        raise process.failure(f"connection lost: {err}") from None


def parsed(process: launcher.ServerProcess, parse: Callable[[dict], Any], doc: dict) -> Any:
    try:
        return parse(doc)
    except ServerRejected as err:
        raise process.failure(str(err)) from None


def _exited_within(process: launcher.ServerProcess, seconds: float) -> bool:
    # A dropped connection and the process exit race; give the exit a moment to show.
    deadline = time.monotonic() + seconds
    while process.exit_code() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    return process.exit_code() is not None
