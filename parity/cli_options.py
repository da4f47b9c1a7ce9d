"""What the `parity` command line checks about its options before anything runs: the callbacks
that turn a bad value into click's usage error (exit 2), and the warning for an option the chosen
backend does not use.
"""

from __future__ import annotations

import math
import os

import click
from click.core import ParameterSource

from parity import registry
from parity.trust.fields import MAX_MAGNITUDE

# Seeds torch.manual_seed takes without wrapping around, and a results file can carry.
MAX_SEED = 2**63 - 1

def positive(ctx, param, value):
    if value is not None and value <= 0:
        raise click.BadParameter(f"must be > 0, got {value}")
    return value


def threads(ctx, param, value):
    cpus = os.cpu_count() or 1
    if value is not None and not 1 <= value <= cpus:
        raise click.BadParameter(f"must be between 1 and this machine's {cpus} CPUs, got {value}")
    return value


def not_empty(hint: str = ""):
    def callback(ctx, param, value):
        if value is not None and not value.strip():
            raise click.BadParameter(f"must not be empty{hint}")
        return value

    return callback


def arm_selection(ctx, param, value):
    names = [n.strip() for n in value.split(",") if n.strip()]
    if not names:
        raise click.BadParameter("expected `all` or a comma list of arm names (see `parity arms`)")
    if "all" in names and len(names) > 1:
        raise click.BadParameter(f"`all` already names every arm; give it alone or list the arms, got {value!r}")
    return value


def auto_or_number(lowest: float, inclusive: bool, note: str = ""):
    """A callback for `auto` (None: resolved later from the dtype's measured noise) or a finite number
    above `lowest` (or equal to it, when `inclusive`)."""
    bound = f"{'>=' if inclusive else '>'} {lowest:g}{note}"

    def callback(ctx, param, value):
        if value == "auto":
            return None
        try:
            number = float(value)
        except ValueError:
            raise click.BadParameter(f"expected 'auto' or a number, got {value!r}") from None
        if (not math.isfinite(number) or number < lowest or (number == lowest and not inclusive)
                or number > MAX_MAGNITUDE):
            raise click.BadParameter(f"must be 'auto' or a finite number {bound} (at most {MAX_MAGNITUDE:g}), "
                                     f"got {value}")
        return number

    return callback


# `--tie-margin`: `auto` (the dtype's, resolved with the tolerances) or a finite number >= 0.
tie_margin = auto_or_number(0.0, True)

LOCALIZE_THRESHOLD_HELP = ("auto (from the dtype's measured noise) or a number: the first layer whose relative error "
                            "||h_bcg - h_eager|| / ||h_eager|| exceeds it is named.")


def int_list(ctx, param, value):
    if param.name == "buckets" and value is not None and not value.strip():
        raise click.BadParameter("expected auto or a comma list of bucket sizes, got an empty value")
    if value is None or value == "":
        return ()
    if param.name == "buckets" and value == "auto":
        return value
    try:
        numbers = tuple(int(v) for v in value.split(","))
    except ValueError:
        raise click.BadParameter(f"expected {'auto or ' if param.name == 'buckets' else ''}a comma list of "
                                 f"integers, got {value!r}") from None
    if param.name == "buckets" and any(n <= 0 for n in numbers):
        raise click.BadParameter("bucket sizes must be > 0")
    return numbers


# design §4d: files that travel between machines are verified whenever a key is set; this refuses unsigned ones.
require_signed_option = click.option(
    "--require-signed", is_flag=True,
    help="Refuse a results file that is not signed with the key of PARITY_SIGNING_KEY or PARITY_SIGNING_KEY_FILE "
         "(exit 2); a signed file is verified whenever a key is set, with or without this.")


def engine_options(command):
    """Add the options only one backend has (each engine's `entry`), before the common ones in --help."""
    for option in reversed(registry.own_options()):
        command = option.decorator()(command)
    return command


def warn_ignored(ctx: click.Context, backend: str) -> None:
    """Say every option the backend does not use, rather than drop it silently (design §5), at option
    parsing, before the backend or its package is loaded; refuse one it cannot honour."""
    ignored: dict[tuple[str, ...], list[str]] = {}
    users = registry.option_backends()
    for param in ctx.command.params:
        name = param.name or ""
        if ctx.get_parameter_source(name) in (None, ParameterSource.DEFAULT):
            continue
        refusal = registry.refusal(backend, name, ctx.params.get(name))
        if refusal:
            raise click.UsageError(refusal)
        backends = users.get(name)
        if backends and backend not in backends:
            ignored.setdefault(backends, []).append(param.opts[0])
    for backends, given in ignored.items():
        click.echo(f"warning: {', '.join(given)} only apply to --backend {' or '.join(backends)}; ignored with "
                   f"--backend {backend}", err=True)
