"""Progress of a run: a rich bar on a terminal, one plain line per arm elsewhere (CI logs)."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress as Bar, TextColumn, TimeElapsedColumn

from parity.run.experiment import Progress, ProgressFn
from parity.reporting.text import terminal, visible


@contextmanager
def progress_display(console: Console) -> Iterator[ProgressFn]:
    if not console.is_terminal:
        def plain(event: Progress) -> None:
            console.print(visible(f"[{event.index}/{event.total}] {event.case_id} {event.arm}"), highlight=False,
                          markup=False)

        yield plain
        return
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Bar(*columns, console=console, transient=True) as bar:
        task = None

        def update(event: Progress) -> None:
            nonlocal task
            if task is None:
                task = bar.add_task("", total=event.total)
            bar.update(task, completed=event.index - 1, description=terminal(f"{event.case_id} · {event.arm}"))

        yield update

