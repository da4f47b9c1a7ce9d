"""Where the shipped data folders (`arms/`, `fixtures/`) live: in the wheel or in a checkout."""

from __future__ import annotations

from pathlib import Path

_PACKAGE = Path(__file__).resolve().parent


def data_dir(name: str) -> Path:
    # A wheel carries the folders inside the package (pyproject's force-include); a source
    # checkout, an editable install or PYTHONPATH=. finds them beside the package.
    for candidate in (_PACKAGE / "_data" / name, _PACKAGE.parent / name):
        if candidate.is_dir():
            return candidate
    raise FileNotFoundError(f"parity's {name}/ folder is missing from this installation")
