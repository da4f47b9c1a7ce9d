"""Reading a user's file with bounds: only a regular file is opened, and it is refused before a byte
is read when it is larger than the reader's limit.

A path may name anything: a FIFO (opening it for reading blocks until a writer comes, forever in a
CI job), a socket, a device such as /dev/zero (it never ends), a folder, or a symbolic-link loop.
Each is refused in one line by what it is (`NotAFile`), never a hang or a traceback.
"""

from __future__ import annotations

import os
import stat
import tempfile
from pathlib import Path
from typing import Iterator


class TooLarge(ValueError):
    """The file holds more than the limit."""


class NotAFile(ValueError):
    """The path names something other than a regular file; the message says what."""


_WOULD_BLOCK = "is a file whose read would block (a kernel or device file that answers only when it has data)"


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISDIR, "a folder"), (stat.S_ISFIFO, "a FIFO (named pipe)"),
                       (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a device"), (stat.S_ISBLK, "a device")):
        if test(mode):
            return name
    return "not a regular file"


def described(err: OSError) -> str:
    """An OS error on a user's path as a few words: 'no such file', 'a symbolic-link loop', …"""
    import errno

    return {errno.ENOENT: "no such file", errno.ELOOP: "a symbolic-link loop",
            errno.ENXIO: "a socket or device that cannot be read"}.get(
        err.errno, (err.strerror or err.__class__.__name__).lower())


def regular_file(path: str | Path, limit: int | None = None) -> os.stat_result:
    """The path's status when it is a regular file (symbolic links followed) of at most `limit`
    bytes; `NotAFile` or `TooLarge` otherwise, `OSError` where the path cannot be followed."""
    status = os.stat(path)
    if not stat.S_ISREG(status.st_mode):
        raise NotAFile(f"is {_kind(status.st_mode)}, not a file")
    if limit is not None and status.st_size > limit:
        raise TooLarge(f"holds more than {_shown(limit)}")
    return status


def read_bytes_capped(path: str | Path, limit: int) -> bytes:
    """The bytes of a regular file of at most `limit` bytes. Opened and read without blocking, so
    neither a FIFO put in the path's place after the check nor a regular file whose read blocks
    (`/proc/kmsg`) can hang the reader: the latter is refused (`NotAFile`)."""
    chunks, size = [], 0
    for chunk in read_chunks(path, 2**20, limit):
        chunks.append(chunk)
        size += len(chunk)
        if size > limit:  # a file that grew since its size was checked: still bounded
            raise TooLarge(f"holds more than {_shown(limit)}")
    return b"".join(chunks)


def read_chunks(path: str | Path, size: int, limit: int | None = None) -> Iterator[bytes]:
    """A regular file's bytes in chunks of at most `size`, opened and read without blocking (see
    `read_bytes_capped`); `limit` is checked against its size first."""
    regular_file(path, limit)  # names what the path is (opening a socket only says "no such device")
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    try:
        status = os.fstat(fd)
        if not stat.S_ISREG(status.st_mode):
            raise NotAFile(f"is {_kind(status.st_mode)}, not a file")
        if limit is not None and status.st_size > limit:
            raise TooLarge(f"holds more than {_shown(limit)}")
        while True:
            try:
                chunk = os.read(fd, size)
            except BlockingIOError:
                raise NotAFile(_WOULD_BLOCK) from None
            if not chunk:
                return
            yield chunk
    finally:
        os.close(fd)


def read_text_capped(path: str | Path, limit: int) -> str:
    """The UTF-8 text of a regular file of at most `limit` bytes; `UnicodeDecodeError` as decoding raises it."""
    return read_bytes_capped(path, limit).decode("utf-8")


def _shown(limit: int) -> str:
    return f"{limit // 2**20} MiB" if limit >= 2**20 else f"{limit} bytes"


def user_bytes(option: str, given: str | Path, limit: int) -> bytes:
    """The bytes of a file a user named on the command line (`--image`, `--video`, `--audio` …),
    read as `read_bytes_capped` reads (bounded, never blocking): a `UsageError` naming the option
    when it is empty, missing, not a regular file, unreadable, larger than `limit` bytes or a read
    that would block. Decoders take these bytes, never the path (a read that blocks there would hang
    the command)."""
    from parity.errors import UsageError

    if not str(given).strip():
        raise UsageError(f"{option}: an empty path names no file")
    try:
        return read_bytes_capped(given, limit)
    except (NotAFile, TooLarge) as err:
        raise UsageError(f"{option} {given}: {err}") from None
    except OSError as err:
        raise UsageError(f"{option} {given}: {described(err)}") from None


def write_atomically(path: Path, text: str) -> None:
    """Write `text` to `path` whole or not at all: an interrupted write never leaves a half file.

    The file gets the mode an ordinary `open` would (0666 less the umask), not mkstemp's 0600. A
    lone surrogate (from a results file read back) is written as its JSON escape `\\udXXX`.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.fchmod(fd, 0o666 & ~current_umask())
        with os.fdopen(fd, "w", encoding="utf-8", errors="backslashreplace") as out:
            out.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def current_umask() -> int:
    # Reading the umask means setting it; parity writes its files from one thread.
    current = os.umask(0o022)
    os.umask(current)
    return current


def readable_as_written(folder: Path) -> None:
    """Every file under `folder` (a saved checkpoint) gets the mode an ordinary `open` gives (0666 less
    the umask): safetensors' atomic write leaves 0600, which a server running as another user cannot read."""
    mode = 0o666 & ~current_umask()
    for path in folder.rglob("*"):
        if path.is_file() and not path.is_symlink():
            path.chmod(mode)
