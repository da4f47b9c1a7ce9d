"""`parity audit --engine sglang|vllm`: which DeepStack models an installed engine's graph paths cover.

A static contract audit (design §11): the engine's source is read, never imported, so it needs no
model weights, no GPU and none of the engine's native libraries. Exit 0 when every DeepStack model
is covered in every graph mode that replays its prefills, 1 when one is not, 2 when the engine is not
installed here (or `--source` is not its package).
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import sys
from pathlib import Path

import click

from parity.audit.report import AuditReport, render_table, to_json, to_markdown
from parity.audit.source_index import SourceIndex
from parity.errors import UsageError

# engine -> the module holding its rules (`PACKAGE`, `MODES`, `audit_rows(index)`)
ENGINES = {"sglang": "parity.engines.sglang.audit", "vllm": "parity.engines.vllm.audit"}
SETUP = {"sglang": "scripts/setup_sglang_env.sh", "vllm": "scripts/setup_vllm_env.sh"}


class EngineNotInstalled(UsageError):
    """The engine's package is not importable here, or `--source` is not its package folder."""


def locate(package: str, source: Path | None) -> tuple[Path, str]:
    """The engine's package folder and version: `source` when given, else the installed package."""
    if source is not None:
        if not (source / "__init__.py").is_file():
            raise EngineNotInstalled(f"--source {source}: not a Python package folder (no __init__.py)")
        return source, "(from --source)"
    spec = importlib.util.find_spec(package)  # finds the package without running it
    if spec is None or not spec.submodule_search_locations:
        raise EngineNotInstalled(
            f"{package} is not installed in this environment ({sys.executable}); run the audit with the "
            f"engine's Python (its environment from {SETUP[package]}) or give --source <its package folder>")
    try:
        version = importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        version = "unknown version"
    return Path(next(iter(spec.submodule_search_locations))), version


def run_audit(engine: str, source: Path | None = None, with_fix: bool = False) -> AuditReport:
    rules = importlib.import_module(ENGINES[engine])
    root, version = locate(rules.PACKAGE, source)
    rows, facts = rules.audit_rows(SourceIndex(root, rules.PACKAGE))
    if not rows and not facts:
        raise EngineNotInstalled(f"{root}: no {engine} model files found there")
    return AuditReport(engine, version, str(root), rules.MODES, rows, facts, with_fix)


@click.command()
@click.option("--engine", type=click.Choice(list(ENGINES)), required=True, help="The installed engine to read.")
@click.option("--format", "output_format", type=click.Choice(["table", "markdown", "json"]), default="table",
              show_default=True)
@click.option("--with-fix", is_flag=True,
              help="Judge the engine with parity's fix in place (--sglang-fix deepstack-slot, --vllm-fix deepstack-clear).")
@click.option("--source", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Read this package folder instead of the installed engine (an unpacked wheel, a checkout's package).")
def audit(engine: str, output_format: str, with_fix: bool, source: Path | None) -> None:
    """Which DeepStack models an installed engine's graph modes cover (static: no weights, no GPU).

    One row per model class that consumes DeepStack, one column per graph mode: `eager` (its prefills
    do not replay there), `covered`, `dropped` (the graph never reads DeepStack), `leaks` (rows an
    earlier step left are read), `not analysed`. Exit 1 when a DeepStack model replays uncovered,
    0 when all are covered, 2 when the engine is not installed.
    """
    report = run_audit(engine, source, with_fix)
    if output_format == "json":
        click.echo(to_json(report))
    elif output_format == "markdown":
        click.echo(to_markdown(report), nl=False)
    else:
        from rich.console import Console

        render_table(report, Console(width=max(160, Console().width)))
    sys.exit(report.exit_code)
