"""`parity run`: options into a RunSpec, a backend and an output plan, then the run folder's files.

Everything a user can get wrong is checked before a model loads, a server starts or a file is
created; files are written last, each whole or not at all, also when the run is interrupted.
"""

from __future__ import annotations

import dataclasses
import os
import re
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Sequence

from rich.console import Console
from rich.markup import escape

from parity.backends import BackendOptions, create_backend
from parity.errors import UsageError
from parity.experiment import CaseSpec, RunInterrupted, RunSpec, run_experiment
from parity.fixtures import DEFAULT_FIXTURE, Fixture, Prompt, builtin_fixture, builtin_fixtures, default_prompts, image_fixture
from parity.reporting.ci_summary import append_step_summary
from parity.reporting.progress import progress_display
from parity.reporting.report import print_table, render_markdown
from parity.results import RunResult, write_atomically, write_results


@dataclass(frozen=True)
class OutputOptions:
    """Where the run's files go."""

    run_dir: Path
    junit: Path | None = None
    plots: bool = True


def build_cases(fixture_names: Sequence[str], images: Sequence[str], prompt_texts: Sequence[str],
                prompts_file: str | None) -> tuple[CaseSpec, ...]:
    fixtures = _unique_names(_fixtures(fixture_names, images))
    prompts = _user_prompts(prompt_texts, prompts_file)
    # Every fixture x prompt is a case; without user prompts, each fixture's first own prompt.
    return tuple(CaseSpec(f, p) for f in fixtures for p in (prompts or default_prompts(f)[:1]))


def _fixtures(names: Sequence[str], images: Sequence[str]) -> list[Fixture]:
    for name in names:
        if name != "all":
            builtin_fixture(name)  # every name is checked, also next to `all`
    chosen = builtin_fixtures() if "all" in names else [builtin_fixture(n) for n in dict.fromkeys(names)]
    chosen += [image_fixture(path) for path in images]
    return chosen or [builtin_fixture(DEFAULT_FIXTURE)]


def _unique_names(fixtures: list[Fixture]) -> list[Fixture]:
    """Two images called `cat.png` (or a user image named like a built-in) stay two cases."""
    seen: dict[str, int] = {}
    unique = []
    for fixture in fixtures:
        count = seen.get(fixture.name, 0) + 1
        seen[fixture.name] = count
        unique.append(fixture if count == 1 else dataclasses.replace(fixture, name=f"{fixture.name}-{count}"))
    return unique


def _user_prompts(texts: Sequence[str], prompts_file: str | None) -> tuple[Prompt, ...]:
    lines = list(texts)
    if prompts_file:
        try:
            raw = Path(prompts_file).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as err:
            raise UsageError(f"--prompts {prompts_file}: cannot be read ({err.__class__.__name__})") from None
        from_file = [ln.strip() for ln in raw.splitlines() if ln.strip() and not ln.lstrip().startswith("#")]
        if not from_file:
            raise UsageError(f"--prompts {prompts_file}: no prompts in the file")
        lines += from_file
    if any(not t.strip() for t in lines):
        raise UsageError("--prompt: a prompt must not be empty")
    return tuple(Prompt(f"prompt-{i}", text) for i, text in enumerate(lines, 1))


def default_run_dir(model: str) -> Path:
    slug = re.sub(r"[^A-Za-z0-9_.-]+", "_", model).strip("_")
    return Path("reports") / f"{datetime.now().strftime('%Y%m%d-%H%M%S')}-{slug}"


def check_writable(option: str, path: Path, directory: bool) -> Path:
    """Fail before the run, not after it, when a file or folder the run must write cannot be
    written; creates nothing (a usage error later must not leave empty folders or files)."""
    if path.exists():
        if path.is_dir() != directory:
            raise UsageError(f"{option} {path}: is {'not ' if directory else ''}a folder")
        if not os.access(path, os.W_OK | (os.X_OK if directory else 0)):
            raise UsageError(f"{option} {path}: cannot be written (permission denied)")
        return path
    ancestor = path.parent
    while not ancestor.exists():
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        raise UsageError(f"{option} {path}: cannot be written ({ancestor} is a file)")
    if not os.access(ancestor, os.W_OK | os.X_OK):
        raise UsageError(f"{option} {path}: cannot be written (permission denied in {ancestor})")
    return path


def execute_run(spec: RunSpec, backend: BackendOptions, output: OutputOptions, console: Console) -> RunResult:
    engine = create_backend(backend, spec.max_new_tokens, output.run_dir)
    try:
        with progress_display(console) as progress:
            result = run_experiment(spec, engine, progress,
                                    warn=lambda message: console.print(f"[yellow]warning:[/] {escape(message)}"))
    except RunInterrupted as interrupted:
        write_outputs(interrupted.result, output, console, plots=False)
        raise KeyboardInterrupt from None
    result = write_outputs(result, output, console, plots=output.plots)
    print_table(result, console)
    console.print(f"results: {output.run_dir / 'results.json'}  report: {output.run_dir / 'report.md'}",
                  highlight=False)
    return result


def write_outputs(result: RunResult, output: OutputOptions, console: Console, plots: bool) -> RunResult:
    """results.json first (the evidence must survive a failing plot), then plots, report, JUnit."""
    results_path = output.run_dir / "results.json"
    write_results(result, results_path)
    if plots:
        result = _with_plots(result, output.run_dir, console)
        write_results(result, results_path)
    markdown = render_markdown(result)
    write_atomically(output.run_dir / "report.md", markdown)
    if output.junit is not None:
        from parity.reporting.junit import write_junit

        write_junit(result, output.junit)
    try:
        append_step_summary(markdown)
    except OSError as err:  # the verdict stands; a CI summary that cannot be written is a warning
        console.print(f"[yellow]warning:[/] GITHUB_STEP_SUMMARY not written ({err.strerror or err})")
    return result


def _with_plots(result: RunResult, run_dir: Path, console: Console) -> RunResult:
    from parity.reporting.plots import plot_case, plot_localization

    cases = []
    for case in result.cases:
        try:
            case = dataclasses.replace(case, plot=plot_case(case, run_dir, result).name)
            if case.localization is not None:
                case = dataclasses.replace(case, localization_plot=plot_localization(case, run_dir).name)
        except (OSError, ValueError, RuntimeError) as err:  # a plot is a view; results.json is already written
            console.print(f"[yellow]warning:[/] no plot for {case.id} ({err.__class__.__name__}: {err})")
        cases.append(case)
    return dataclasses.replace(result, cases=tuple(cases))
