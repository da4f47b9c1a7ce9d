"""Engine server processes: start on a free loopback port, wait until ready, stop the whole group.

Each server runs in its own session (so its own process group): a Ctrl-C in the terminal reaches
only parity, which then stops the servers in order, and a stop signals every process the engine
spawned (SGLang's scheduler and detokenizer, vLLM's engine core and workers) even when the
launcher process itself already died. A module registry of live servers is stopped at interpreter
exit and on SIGTERM, so nothing is left running on success, failure or interruption.
"""

from __future__ import annotations

import atexit
import os
import signal
import socket
import subprocess
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType, MappingProxyType
from typing import IO, Mapping, Sequence

from parity.errors import ArmFailure, BackendUnavailableError

HOST = "127.0.0.1"
LOG_TAIL_LINES = 40
STOP_GRACE_S = 20.0  # engines tear down their model processes and free GPU memory on SIGTERM
POLL_S = 0.5


@dataclass(frozen=True)
class ServerSpec:
    """What to launch for one execution mode; host and port are added at start."""

    name: str  # the server key: its mode ("eager", "bcg"), with a serving profile ("bcg-chunked")
    command: tuple[str, ...]
    log_path: Path
    env: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))
    ready_path: str = "/ready"  # answers 200 once the engine serves (SGLang /ready, vLLM /health)


def free_port(host: str = HOST) -> int:
    """A port the OS just handed out on `host` (released again for the server to bind)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind((host, 0))
            return int(sock.getsockname()[1])
    except OSError as err:
        raise BackendUnavailableError(f"cannot bind a port on {host}: {err}") from None


def group_alive(pgid: int) -> bool:
    """Whether any process of the group still runs (zombies waiting for a reaper do not count)."""
    proc = Path("/proc")
    if not proc.is_dir():
        try:
            os.killpg(pgid, 0)
            return True
        except ProcessLookupError:
            return False
    return any(_stat_fields(stat) == ("running", pgid) for stat in proc.glob("[0-9]*/stat"))


def _stat_fields(stat: Path) -> tuple[str, int] | None:
    try:
        text = stat.read_text()
    except OSError:
        return None  # the process ended while we looked
    # The command name may hold spaces and parentheses; fields after the last ')' are fixed.
    fields = text[text.rindex(")") + 2:].split()
    state, pgrp = fields[0], int(fields[2])
    return ("zombie" if state in ("Z", "X") else "running", pgrp)


class ServerProcess:
    """One launched server: its process group, log and URL."""

    def __init__(self, spec: ServerSpec, process: subprocess.Popen, port: int, log: IO[bytes]) -> None:
        self.spec = spec
        self.port = port
        self._process = process
        self._log = log
        self._stopped = False

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def pid(self) -> int:
        return self._process.pid

    @property
    def base_url(self) -> str:
        return f"http://{HOST}:{self.port}"

    def exit_code(self) -> int | None:
        return self._process.poll()

    def alive(self) -> bool:
        return not self._stopped and self._process.poll() is None

    def log_tail(self, lines: int = LOG_TAIL_LINES) -> str:
        try:
            text = self.spec.log_path.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    def failure(self, message: str) -> ArmFailure:
        return ArmFailure(f"{self.name} server: {message} (log: {self.spec.log_path})", log_tail=self.log_tail())

    def exited_failure(self) -> ArmFailure:
        return self.failure(f"exited with code {self.exit_code()}")

    def is_ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.base_url}{self.spec.ready_path}", timeout=2.0) as response:
                return response.status == 200
        except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
            return False  # not listening yet, 503 while warming up, or gone

    def stop(self, grace: float = STOP_GRACE_S) -> None:
        """SIGTERM the whole group, SIGKILL what is left after `grace`; idempotent."""
        if self._stopped:
            return
        self._stopped = True
        try:
            _signal_group(self.pid, signal.SIGTERM)
            if not self._wait_gone(grace):
                _signal_group(self.pid, signal.SIGKILL)
                self._wait_gone(5.0)
        finally:
            self._log.close()
            _LIVE.discard(self)
            _restore_sigterm_when_idle()

    def _wait_gone(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while True:
            self._process.poll()  # reap the leader so it does not linger as a zombie
            if not group_alive(self.pid):
                return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.05)


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        pass  # already gone


def start_server(spec: ServerSpec) -> ServerProcess:
    """Launch `spec` on a free loopback port in a new process group; output goes to its log."""
    port = free_port()
    argv = [*spec.command, "--host", HOST, "--port", str(port)]
    spec.log_path.parent.mkdir(parents=True, exist_ok=True)
    log = open(spec.log_path, "ab")
    log.write(("$ " + " ".join(argv) + "\n").encode())
    log.flush()
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **spec.env}
    try:
        process = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                   env=env, start_new_session=True)
    except OSError as err:
        log.close()
        raise ArmFailure(f"{spec.name} server: cannot start {argv[0]!r}: {err}") from None
    server = ServerProcess(spec, process, port, log)
    _LIVE.add(server)
    _STARTED.append(server.pid)
    _install_sigterm_handler()
    return server


class ExitedDuringStartup(ArmFailure):
    """The server process ended by itself before /ready answered (not stopped by parity for a timeout)."""


def wait_ready(servers: Sequence[ServerProcess], timeout: float, poll: float = POLL_S) -> dict[str, ArmFailure]:
    """Poll every server's ready path until all are ready; failed ones are stopped and returned by name.

    One loop for all servers, so concurrent start-ups overlap without threads.
    """
    deadline = time.monotonic() + timeout
    pending = list(servers)
    failures: dict[str, ArmFailure] = {}
    while pending:
        for server in list(pending):
            if server.is_ready():
                pending.remove(server)
            elif server.exit_code() is not None:
                failure = server.failure(f"exited during start-up with code {server.exit_code()}")
                failures[server.name] = ExitedDuringStartup(str(failure), log_tail=failure.log_tail)
                pending.remove(server)
                server.stop()
        if pending and time.monotonic() >= deadline:
            for server in pending:
                failures[server.name] = server.failure(f"not ready after {timeout:g} s")
                server.stop()
            break
        if pending:
            time.sleep(poll)
    return failures


# --- nothing left running ----------------------------------------------------------------------------

_LIVE: set[ServerProcess] = set()
_STARTED: list[int] = []  # every server's process group this process started, stopped or not
_previous_sigterm: signal.Handlers | None = None


def groups_left_running() -> list[int]:
    """The process groups of servers this process started that still run: what a caller checks to
    know it left nothing behind, blind to servers another process (a neighbour's job) runs."""
    return [pgid for pgid in _STARTED if group_alive(pgid)]


def stop_all() -> None:
    for server in list(_LIVE):
        server.stop()


def _on_sigterm(signum: int, frame: FrameType | None) -> None:
    # Unwind like an exit: `finally` blocks and atexit stop the servers, then the process ends.
    raise SystemExit(128 + signum)


def _install_sigterm_handler() -> None:
    # Only the main thread may set handlers, and a handler someone else set is theirs to keep.
    global _previous_sigterm
    if threading.current_thread() is not threading.main_thread() or _previous_sigterm is not None:
        return
    if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        _previous_sigterm = signal.signal(signal.SIGTERM, _on_sigterm)


def _restore_sigterm_when_idle() -> None:
    global _previous_sigterm
    if _LIVE or _previous_sigterm is None or threading.current_thread() is not threading.main_thread():
        return
    signal.signal(signal.SIGTERM, _previous_sigterm)
    _previous_sigterm = None


atexit.register(stop_all)
