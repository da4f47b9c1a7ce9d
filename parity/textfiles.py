"""Reading a user's text file with a bound: a device such as /dev/zero or /dev/urandom, or a file
far larger than any parity file, is refused after `limit` bytes instead of read to exhaustion."""

from __future__ import annotations

import os
import stat
from pathlib import Path


class TooLarge(ValueError):
    """The file holds more than the limit, or is a device that never ends."""


def read_text_capped(path: str | Path, limit: int) -> str:
    """The file's UTF-8 text; `TooLarge` past `limit` bytes, `OSError` or `UnicodeDecodeError` as
    reading raises them."""
    with open(path, "rb") as handle:
        mode = os.fstat(handle.fileno()).st_mode
        if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
            raise TooLarge("is a device, not a file")
        data = handle.read(limit + 1)
    if len(data) > limit:
        raise TooLarge(f"holds more than {limit // 2**20} MiB")
    return data.decode("utf-8")
