"""The servers of a server backend, each under its key (a mode, or a mode with serving features:
`EngineBackend.server_key`): started on demand or in stages, probed once ready, stopped when their
session ends or the backend closes; and tagged requests to them.

An engine backend supplies how to start a mode's server and how to probe it (its command line,
its request bodies); the life of the servers and what a failure means are the same for every
engine: a server that does not come up, or whose tap does not fire, fails its mode's arms.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

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


StartFn = Callable[[str, int], Server]  # (server key, its launch count) -> a started server
ProbeFn = Callable[[Server], "ArmFailure | None"]
ExplainFn = Callable[[str, ArmFailure], ArmFailure]  # a server's start-up failure, with the engine's hint


class ServerPool:
    def __init__(self, start: StartFn, probe: ProbeFn, ready_timeout: float, ready_poll: float, stop_grace: float,
                 explain_exit: ExplainFn | None = None) -> None:
        self._start, self._probe, self._explain = start, probe, explain_exit
        self.ready_timeout, self.ready_poll, self.stop_grace = ready_timeout, ready_poll, stop_grace
        self._servers: dict[str, Server] = {}
        self._failures: dict[str, ArmFailure] = {}
        self._launches: dict[str, int] = {}
        self.start_seconds = 0.0  # every launch until its servers were ready and probed

    @property
    def launch_count(self) -> int:
        return sum(self._launches.values())

    def launch(self, keys: Sequence[str]) -> None:
        """Start these servers together and wait until each is ready and probed (or failed)."""
        began = time.monotonic()
        try:
            self._launch(keys)
        finally:
            self.start_seconds += time.monotonic() - began

    def _launch(self, keys: Sequence[str]) -> None:
        started = []
        for key in keys:
            count = self._launches[key] = self._launches.get(key, 0) + 1
            try:
                server = self._start(key, count)
            except ArmFailure as failure:
                self._failures[key] = failure
                continue
            self._servers[key] = server  # registered before waiting: a Ctrl-C in start-up still stops it
            started.append(server)
        failures = launcher.wait_ready([s.process for s in started], self.ready_timeout, self.ready_poll)
        for server in started:
            key = server.process.name
            failure = server.standin_failure() or failures.get(key)  # a stand-in call names the op
            if failure is not None and self._explain is not None and server.process.exit_code() is not None:
                failure = self._explain(key, failure)
            failure = failure or self._probe(server)
            if failure is not None:
                self._servers.pop(key, None)
                server.process.stop(self.stop_grace)
                self._failures[key] = failure

    def acquire(self, key: str) -> Server:
        """The ready server `key` (launched now if need be), or the failure that kept it down."""
        if key not in self._servers and key not in self._failures:
            self.launch((key,))
        if key in self._failures:
            raise self._failures[key]
        return self._servers[key]

    def stop(self, keys: Sequence[str]) -> None:
        """Stop these servers if running (freeing their GPUs); a later `acquire` launches anew."""
        for key in keys:
            server = self._servers.pop(key, None)
            if server is not None:
                server.process.stop(self.stop_grace)

    @property
    def running(self) -> tuple[str, ...]:
        return tuple(self._servers)

    def close(self) -> None:
        self.stop(list(self._servers))


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
