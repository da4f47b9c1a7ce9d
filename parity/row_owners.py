"""Who last wrote each row of a persistent input buffer: the leak witness's bookkeeping, one rule for every runner.

A graph reads its per-call inputs from buffers that outlive a request. A row a request reads but did
not write holds whatever an earlier write left there. The in-process runner and the vLLM tap both
keep, per row, the write that left it (a serial and the tag of the request it served), and both name
the request behind stale rows by the same rule (`RowOwners.named`): the one that left most of them,
and on a tie the one that left the first of them. Pure bookkeeping: no torch, so the tap inside a
server process and the runner share it.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Iterable


@dataclass(frozen=True)
class Write:
    """One write into the buffer: its serial (writes by the same request differ) and the request's tag."""

    serial: int
    tag: str | None


class RowOwners:
    """The write that left each row (None: zeros, or never written since the buffer was made)."""

    def __init__(self, rows: int = 0) -> None:
        self._rows: list[Write | None] = [None] * rows
        self._serial = 0
        self.current: Write | None = None  # the write in hand

    def begin(self, tag: str | None) -> None:
        """A new write, for the request tagged `tag`; `wrote` records the rows it covers."""
        self._serial += 1
        self.current = Write(self._serial, tag)

    def wrote(self, stop: int, start: int = 0) -> None:
        self.grow(stop)
        self._rows[start:stop] = [self.current] * max(0, stop - start)

    def cleared(self, stop: int, start: int = 0) -> None:
        self._rows[start:stop] = [None] * max(0, min(stop, len(self._rows)) - start)

    def took_over(self, other: "RowOwners") -> None:
        """This buffer took over `other`'s contents (it grew from it): its rows' writers too."""
        self.grow(len(other._rows))
        self._rows[:len(other._rows)] = other._rows

    def grow(self, rows: int) -> None:
        self._rows += [None] * (rows - len(self._rows))

    def owner(self, row: int) -> Write | None:
        return self._rows[row] if 0 <= row < len(self._rows) else None

    def left_by_others(self, rows: Iterable[int]) -> list[int]:
        """Of `rows`, those an earlier write left (not the write in hand, not zeros)."""
        return [r for r in rows if self.owner(r) is not None and self.owner(r) != self.current]

    def named(self, stale: Iterable[int]) -> str | None:
        """The tag of the request that left most of the `stale` rows; on a tie, the one that left the
        first of them; None when no stale row has a known writer."""
        tags = [w.tag for w in map(self.owner, sorted(stale)) if w is not None and w.tag is not None]
        if not tags:
            return None
        counts = Counter(tags)
        top = max(counts.values())
        return next(t for t in tags if counts[t] == top)
