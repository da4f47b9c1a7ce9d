"""CI plumbing for reports: the GitHub Actions job summary and the size limit of a PR comment.

GitHub rejects a comment (and a job summary shown in it) over 65,536 characters, so a report meant for
either is fitted under `MAX_COMMENT_CHARS`; long arm texts are the usual excess and are cut with a
visible note rather than silently, so a reader knows the text shown is not the whole answer.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Mapping

MAX_COMMENT_CHARS = 65536
SUMMARY_ENV = "GITHUB_STEP_SUMMARY"
_CUT_NOTE = "… [cut: {} more characters]"


def step_summary_wanted(env: Mapping[str, str] = os.environ) -> bool:
    """Whether a CI step summary is to be written (rendering one is not free on a large sweep)."""
    return bool(env.get(SUMMARY_ENV))


def append_step_summary(markdown: str, env: Mapping[str, str] = os.environ) -> Path | None:
    """Append to the file `GITHUB_STEP_SUMMARY` names (created if missing); None outside Actions.

    Appending, not overwriting: earlier steps of the same job may have written their own summary.
    An unwritable path raises OSError; the caller decides whether that should fail the run.
    """
    target = env.get(SUMMARY_ENV)
    if not target:
        return None
    path = Path(target)
    with path.open("a", encoding="utf-8") as summary:
        # Start on a fresh paragraph, so our first line is not glued to a previous step's last one.
        if summary.tell() > 0:
            summary.write("\n")
        summary.write(markdown if markdown.endswith("\n") else markdown + "\n")
    return path


def clip_text(text: str, limit: int) -> str:
    """`text` unchanged if it fits in `limit` characters; else its head plus a note of what was cut.

    The result, note included, is never longer than `limit`, so callers can budget exactly.
    """
    if len(text) <= limit:
        return text
    kept = limit - len(_CUT_NOTE.format(len(text)))
    if kept < 0:
        raise ValueError(f"limit {limit} leaves no room for the cut note")
    # The note's digit count can only shrink as `kept` grows, so the first fit is the final one.
    while len(_CUT_NOTE.format(len(text) - kept - 1)) + kept + 1 <= limit:
        kept += 1
    return text[:kept] + _CUT_NOTE.format(len(text) - kept)
