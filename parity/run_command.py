"""`parity run`: options into a RunSpec and a backend, then the run folder's files."""

from __future__ import annotations

import dataclasses
import re
from datetime import datetime
from pathlib import Path
from typing import Sequence

from rich.console import Console

from parity.arms import select_arms
from parity.backends import create_backend
from parity.reporting.ci_summary import append_step_summary
from parity.errors import UsageError
from parity.experiment import CaseSpec, RunSpec, run_experiment
from parity.fixtures import DEFAULT_FIXTURE, Fixture, Prompt, builtin_fixture, builtin_fixtures, default_prompts, image_fixture
from parity.reporting.progress import progress_display
from parity.reporting.report import print_table, render_markdown
from parity.results import RunResult, write_results


def build_cases(fixture_names: Sequence[str], images: Sequence[str], prompt_texts: Sequence[str],
                prompts_file: str | None) -> tuple[CaseSpec, ...]:
    fixtures = _fixtures(fixture_names, images)
    prompts = _user_prompts(prompt_texts, prompts_file)
    # Every fixture x prompt is a case; without user prompts, each fixture's first own prompt.
    return tuple(CaseSpec(f, p) for f in fixtures for p in (prompts or default_prompts(f)[:1]))


def _fixtures(names: Sequence[str], images: Sequence[str]) -> list[Fixture]:
    if "all" in names:
        chosen = builtin_fixtures()
    else:
        chosen = [builtin_fixture(n) for n in dict.fromkeys(names)]
    chosen += [image_fixture(path) for path in images]
    return chosen or [builtin_fixture(DEFAULT_FIXTURE)]


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


def prepare_run_dir(out_dir: str | None, model: str) -> Path:
    path = Path(out_dir) if out_dir else default_run_dir(model)
    probe = path / ".parity-write-test"
    _check_writable("--out", path, probe, "the output folder cannot be written")
    probe.unlink()
    return path


def check_writable_file(option: str, path: str) -> Path:
    """Fail before the run, not after it, when a file the run must write cannot be written."""
    target = Path(path)
    _check_writable(option, target, target, "cannot be written")
    return target


def _check_writable(option: str, shown: Path, probe: Path, problem: str) -> None:
    try:
        probe.parent.mkdir(parents=True, exist_ok=True)
        with open(probe, "a", encoding="utf-8"):
            pass
    except OSError as err:
        raise UsageError(f"{option} {shown}: {problem} ({err.strerror or err})") from None


def execute_run(*, console: Console, model: str, backend: str, arm_selection: str, fixture_names, images,
                prompt_texts, prompts_file, max_new_tokens: int, logprob_tol: float, device: str, dtype: str,
                runner: str, graph_backend: str, buckets, scenario: str, repeat: int, out_dir, junit_path,
                no_plot: bool, sglang_args, concurrent: bool, gpus, ready_timeout: float,
                mem_fraction: float) -> RunResult:
    # Everything a user can get wrong is checked before a model loads or a server starts.
    spec = RunSpec(
        model=model, arms=select_arms(arm_selection),
        cases=build_cases(fixture_names, images, prompt_texts, prompts_file),
        max_new_tokens=max_new_tokens, logprob_tol=logprob_tol, dtype=dtype, scenario=scenario, repeat=repeat,
    )
    run_dir = prepare_run_dir(out_dir, model)
    junit = check_writable_file("--junit", junit_path) if junit_path else None
    engine = create_backend(
        backend, model=model, device=device, dtype=dtype, max_new_tokens=max_new_tokens, runner=runner,
        graph_backend=graph_backend, buckets=buckets, run_dir=run_dir, sglang_args=tuple(sglang_args),
        concurrent=concurrent, gpus=tuple(gpus), ready_timeout=ready_timeout, mem_fraction=mem_fraction,
    )
    with progress_display(console) as progress:
        result = run_experiment(spec, engine, progress)
    if not no_plot:
        result = _with_plots(result, run_dir)
    write_results(result, run_dir / "results.json")
    markdown = render_markdown(result)
    (run_dir / "report.md").write_text(markdown, encoding="utf-8")
    if junit is not None:
        from parity.reporting.junit import write_junit

        write_junit(result, junit)
    try:
        append_step_summary(markdown)
    except OSError as err:  # the verdict stands; a CI summary that cannot be written is a warning
        console.print(f"[yellow]warning:[/] GITHUB_STEP_SUMMARY not written ({err.strerror or err})")
    print_table(result, console)
    console.print(f"results: {run_dir / 'results.json'}  report: {run_dir / 'report.md'}", highlight=False)
    return result


def _with_plots(result: RunResult, run_dir: Path) -> RunResult:
    from parity.reporting.plots import plot_case

    cases = tuple(
        dataclasses.replace(case, plot=plot_case(case, run_dir, logprob_tol=result.logprob_tol).name)
        for case in result.cases
    )
    return dataclasses.replace(result, cases=cases)
