"""Stopping cleanly on a signal: SIGTERM (a CI cancel or timeout) unwinds like Ctrl-C, and writing
what finished is shielded from a second signal.

A stop is always a `KeyboardInterrupt` (a `Terminated` for SIGTERM), so every `finally` that stops a
server or removes a temporary file runs, whichever signal came; the exit code is 128 + the signal's
number (130 for Ctrl-C, 143 for SIGTERM), as a shell reports a process killed by it.
"""

from __future__ import annotations

import signal
import threading
from contextlib import contextmanager
from typing import Iterator

_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised where the program was, so it unwinds exactly as Ctrl-C does."""

    signum = signal.SIGTERM


def signal_of(stop: BaseException | None) -> int:
    """The signal a stop came from: SIGTERM for `Terminated`, else SIGINT (Ctrl-C)."""
    return int(getattr(stop, "signum", signal.SIGINT))


def exit_code_of(signum: int) -> int:
    return 128 + int(signum)


def _raise_stop(signum: int) -> None:
    raise Terminated() if signum == signal.SIGTERM else KeyboardInterrupt()


def _can_set_handlers() -> bool:
    return threading.current_thread() is threading.main_thread()


@contextmanager
def first_stop_only() -> Iterator[list[int]]:
    """Within the block, the first SIGINT or SIGTERM raises its stop where the program is, and every
    later one is only noted (the list yielded holds them all, the first first): once a run is
    stopping, a second Ctrl-C 10 ms later cannot interrupt the writing of what finished, and the exit
    code stays the first signal's."""
    noted: list[int] = []
    if not _can_set_handlers():
        yield noted
        return

    def on_signal(signum, frame) -> None:
        noted.append(signum)
        if len(noted) == 1:
            _raise_stop(signum)

    previous = {s: signal.signal(s, on_signal) for s in _STOP_SIGNALS}
    try:
        yield noted
    finally:
        _restore(previous)


@contextmanager
def deferred_stops(reraise: bool = True) -> Iterator[list[int]]:
    """Within the block, SIGINT and SIGTERM are only noted (the list yielded), so the block finishes
    (a file written whole, a server stopped). After it, a noted signal is raised as its stop when
    `reraise`; a caller that is already stopping, or says itself what a stop means, passes False."""
    noted: list[int] = []
    if not _can_set_handlers():
        yield noted
        return
    previous = {s: signal.signal(s, lambda signum, frame: noted.append(signum)) for s in _STOP_SIGNALS}
    try:
        yield noted
    finally:
        _restore(previous)
    if noted and reraise:
        _raise_stop(noted[0])  # the first signal decides the exit code


def _restore(previous: dict) -> None:
    for signum, handler in previous.items():
        if handler is not None:  # None: a handler set outside Python, which cannot be put back from here
            signal.signal(signum, handler)
