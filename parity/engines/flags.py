"""Reading an engine's command-line flags the way argparse would, for the facts parity needs from
the user's pass-through flags (buckets, parallel sizes, context length, dtype)."""

from __future__ import annotations

import shlex
from typing import Sequence

from parity.errors import UsageError


def split_user_args(values: Sequence[str], option: str, reserved: Sequence[str], why: str) -> tuple[str, ...]:
    """`OPTION "--tp-size 2"` and `OPTION --tp-size OPTION 2` mean the same; a reserved flag (one
    parity sets itself) is a usage error saying `why` parity owns it."""
    args = tuple(token for value in values for token in shlex.split(value))
    clashes = sorted({a.split("=", 1)[0] for a in args} & set(reserved))
    if clashes:
        raise UsageError(f"{option} may not set {', '.join(clashes)}: {why}")
    return args


def flag_values(args: Sequence[str], *names: str) -> list[str] | None:
    """The values the last occurrence of any of `names` was given: `--f v`, `--f=v` and, for list
    flags, `--f a b c` (argparse nargs "+": every token up to the next flag). None: not given."""
    found: list[str] | None = None
    for i, token in enumerate(args):
        name, eq, inline = token.partition("=")
        if name not in names:
            continue
        if eq:
            found = [inline]
            continue
        found = []
        for value in args[i + 1:]:
            if _is_option(value):
                break
            found.append(value)
    return found


def _is_option(token: str) -> bool:
    # As argparse: a leading dash starts a flag (-O2, -cc.mode=..., --tp) unless it is a number.
    if not token.startswith("-"):
        return False
    try:
        float(token)
    except ValueError:
        return True
    return False


def int_flag(args: Sequence[str], option: str, *names: str) -> int | None:
    """The one integer the last of `names` was given; None: not given; else a usage error."""
    values = flag_values(args, *names)
    if values is None:
        return None
    try:
        (value,) = values
        return int(value)
    except ValueError:
        raise UsageError(f"{option} {names[0]} needs one integer, got {' '.join(values) or 'nothing'}") from None
