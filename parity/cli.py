"""The `parity` command line: parse options, build a spec, call the library, render.

Exit codes: 0 PASS · 1 FAIL_* · 2 usage error · 3 INCOMPLETE / INCONCLUSIVE_* · 4 ERROR · 130 interrupted
(Ctrl-C) · 143 terminated (SIGTERM).
"""

from __future__ import annotations

import signal
import sys
from pathlib import Path
from types import MappingProxyType

import click
from rich.console import Console
from rich.markup import escape

from parity import __version__
from parity.audit.command import audit
from parity.listings import arms, fixtures, models
from parity.cli_options import (
    LOCALIZE_THRESHOLD_HELP, MAX_SEED, arm_selection, auto_or_number, engine_options, int_list, not_empty, positive, threads,
    require_signed_option, tie_margin, warn_ignored,
)
from parity import registry
from parity.errors import NothingToProve, ParityError, UsageError
from parity.presets import misspelled_preset
from parity.reporting.text import visible
from parity.run.interrupts import exit_code_of, signal_of
from parity.design import RUNNER_VARIANTS, SCENARIO_SUMMARIES
from parity.results import FOUR_ARM, SCENARIOS
from parity.results.signing import signing_key
from parity.trust.loader import MIN_LOGPROB_TOL
from parity.judge.verdict import USAGE_EXIT, exit_code

# What a stop by Ctrl-C (SIGINT) or SIGTERM exits with: 128 + the signal's number.
STOP_EXITS = (exit_code_of(signal.SIGINT), exit_code_of(signal.SIGTERM))
# Runs of one arm: past a hundred, a repeat measures nothing more and only multiplies the run.
MAX_REPEAT = 100


class ParityCommandError(click.ClickException):
    """A library error shown as `Error: <one line>` with its documented exit code."""

    exit_code = USAGE_EXIT


class VerdictBeforeRun(click.ClickException):
    """A verdict found before any arm ran (NothingToProve): `<VERDICT>: <reason>`, exit with its code."""

    def __init__(self, err: NothingToProve) -> None:
        written = "" if err.written is None else f"\nresults: {err.written}"  # its files, for CI
        super().__init__(visible(f"{err.verdict}: {err}{written}", keep="\n"))
        self.exit_code = err.exit_code

    def show(self, file=None) -> None:
        click.echo(self.format_message(), err=True)


class ParityGroup(click.Group):
    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except NothingToProve as err:
            raise VerdictBeforeRun(err) from None
        except ParityError as err:
            # Messages quote files (a model name, a case id, a path): nothing in them may drive the terminal.
            raise ParityCommandError(visible(str(err), keep="\n")) from None
        except KeyboardInterrupt as stop:  # a light command stopped: nothing to keep, no traceback
            click.echo("interrupted", err=True)
            ctx.exit(exit_code_of(signal_of(stop)))


def _console() -> Console:
    return Console(highlight=False, soft_wrap=True)


@click.group(cls=ParityGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(version=__version__, prog_name="parity", message="parity %(version)s")
def cli() -> None:
    """parity: does prefill graph replay give the same answer as eager, and does it see DeepStack?

    Exit codes: 0 PASS, 1 FAIL_*, 2 usage error, 3 INCOMPLETE or INCONCLUSIVE_*, 4 ERROR,
    130 interrupted (Ctrl-C), 143 terminated (SIGTERM); an interrupted run writes what finished.
    """


@cli.command()
@click.option("--model", default="tiny-qwen3-vl", show_default=True, callback=not_empty(),
              help="An embedded preset (see `parity models`) or a Qwen3-VL Hugging Face id / local path.")
@click.option("--seed", type=click.IntRange(0, MAX_SEED), default=None,
              help="Build the embedded preset from this seed instead of its own.")
@click.option("--backend", type=click.Choice(list(registry.BACKENDS)), default=registry.DEFAULT, show_default=True)
@click.option("--arms", "arm_selection", default="all", show_default=True, callback=arm_selection,
              help="`all` or a comma list of arm names (four-arm scenario only).")
@click.option("--fixture", "fixture_names", multiple=True, help="Built-in fixture name or `all` (repeatable; default rgb-stripes).")
@click.option("--image", "images", multiple=True, help="A user image file, used as a fixture (repeatable).")
@click.option("--video", "videos", multiple=True,
              help="A built-in video (`parity fixtures`), `all` of them, or a video file PyAV or Pillow reads (repeatable).")
@click.option("--audio", "audios", multiple=True,
              help="audio-tone or a WAV file, for a model that takes audio: audio-only cases, judged before any arm.")
@click.option("--prompt", "prompt_texts", multiple=True, help="A prompt (repeatable); default: each fixture's first prompt.")
@click.option("--prompts", "prompts_file", callback=not_empty(), help="A text file with one prompt per line (# comments allowed).")
@click.option("--max-new-tokens", type=int, default=20, show_default=True, callback=positive)
@click.option("--logprob-tol", default="auto", show_default=True, callback=auto_or_number(MIN_LOGPROB_TOL, True, " (the fp32 noise floor of any x86 CPU)"),
              help="auto (from the dtype's measured noise) or a number: a comparison matches within it.")
@click.option("--tie-margin", default="auto", show_default=True, callback=tie_margin,
              help="auto (the dtype's: 0.1 in float32, 0.5 in bfloat16) or a number: two tokens this close in "
                   "logprob, in both arms, are a near-tie: a noise flip, not a failure, when the flip step and "
                   "the teacher-forced scores agree within the tolerance.")
@click.option("--device", type=click.Choice(["auto", "cpu", "cuda"]), default="auto", show_default=True)
@click.option("--dtype", type=click.Choice(["auto", "float32", "bfloat16", "float16"]), default="auto", show_default=True,
              help="auto: float32 for embedded presets and on CPU, bfloat16 for checkpoints on GPU.")
@click.option("--threads", type=int, default=None, callback=threads,
              help="CPU threads, at most the machine's CPUs (default: 1 for embedded presets unless "
                   "OMP_NUM_THREADS is set).")
@click.option("--runner", type=click.Choice(RUNNER_VARIANTS), default="fixed", show_default=True,
              help="Graph runner variant (transformers backend): the fix, or a planted bug it must catch "
                   "(docs/scenarios.md names the scenario that catches each).")
@click.option("--poison", is_flag=True,
              help="Before each graph replay's refresh, fill every row the request must write with a sentinel "
                   "(transformers backend): a row the refresh missed still holds it, a second opinion beside "
                   "the freshness witness (design §6). A correct runner's answers do not change.")
@click.option("--graph-backend", type=click.Choice(["auto", "cuda", "emulated"]), default="auto", show_default=True)
@click.option("--buckets", default="auto", show_default=True, callback=int_list,
              help="Prefill token buckets: auto (the engine's ladder, covering every prompt) or a comma list "
                   "(a server backend's graph capture sizes).")
@click.option("--scenario", "scenario_names", type=click.Choice([*SCENARIOS, "all"]), multiple=True,
              help="Repeatable (default four-arm). "
              + "; ".join(f"{name}: {line}" for name, line in SCENARIO_SUMMARIES.items())
              + "; all: every scenario.")
@click.option("--chunk-size", type=click.IntRange(1, None), default=None,
              help="The chunked scenario's prefill chunk, in tokens (default 8, which splits every built-in "
                   "fixture's image over two chunks or more; a server's --chunked-prefill-size or "
                   "--max-num-batched-tokens).")
@click.option("--repeat", type=click.IntRange(1, MAX_REPEAT), default=1, show_default=True,
              help="Run every arm N times (at most 100); an arm that does not reproduce itself is "
                   "INCONCLUSIVE_NONDETERMINISTIC.")
@click.option("--localize-threshold", default="auto", show_default=True, callback=auto_or_number(0.0, False),
              help="Localizing a failing case (transformers backend): " + LOCALIZE_THRESHOLD_HELP)
@click.option("--out", "out_dir", callback=not_empty("; leave --out out for reports/<timestamp>-<model>/"),
              help="Run folder (default reports/<timestamp>-<model>/).")
@click.option("--junit", "junit_path", callback=not_empty(), help="Also write a JUnit XML file here.")
@click.option("--no-plot", is_flag=True, help="Skip the plots.")
@click.option("--shard", "shard_spec", metavar="K/N",
              help="Run only shard K of N: a partition of the cases that is the same on every machine; "
                   "join the shards' results with `parity merge`.")
@click.option("--concurrent", is_flag=True,
              help="Keep both servers of a server backend up: started at once when --gpus gives each its own GPUs, "
                   "else one after the other on the shared GPU.")
@click.option("--gpus", callback=int_list, default="", help="Comma list of GPU indexes for --concurrent servers.")
@click.option("--ready-timeout", type=float, default=1800.0, show_default=True, callback=positive,
              help="Seconds to wait for a server to be ready (the engine's readiness endpoint).")
@click.option("--mem-fraction", type=float, default=0.70, show_default=True,
              help="The share of each GPU's memory a server may use (the engine's own memory flag); with --concurrent "
                   "on a shared GPU each server gets half of it of the GPU's total.")
@engine_options
def run(**options) -> None:
    """Run the experiment and write results.json and report.md to the run folder."""
    # Heavy imports (torch, transformers) only when running.
    from parity.arms import select_arms
    from parity.backends.options import BackendOptions
    from parity.run.planning import RunSpec
    from parity.run.interrupts import first_stop_only
    from parity.models import check_runnable
    from parity.run_command import (
        OutputOptions, RunStopped, build_cases, check_outputs, check_writable, default_run_dir, execute_run,
        files_written, plan_note, write_before_run,
    )
    from parity.plan.entries import scenario_case_id
    from parity.plan.sharding import Shard, check_not_empty

    o = options
    named = o["scenario_names"] or (FOUR_ARM,)
    scenarios = SCENARIOS if "all" in named else tuple(dict.fromkeys(named))
    sequence = next((s for s in scenarios if s != FOUR_ARM), None)
    if sequence is not None and o["arm_selection"].strip() != "all":
        raise UsageError(f"--arms {o['arm_selection']} with --scenario {sequence}: a sequence scenario "
                         "compares every request in both modes, so it needs all arms; give --arms all, or "
                         "--scenario four-arm to choose arms")
    spec = RunSpec(
        model=o["model"], arms=select_arms(o["arm_selection"]),
        cases=build_cases(o["fixture_names"], o["images"], o["prompt_texts"], o["prompts_file"], o["videos"]),
        scenarios=scenarios,
        max_new_tokens=o["max_new_tokens"], logprob_tol=o["logprob_tol"], tie_margin=o["tie_margin"],
        repeat=o["repeat"], localize_threshold=o["localize_threshold"],
        shard=Shard.parse(o["shard_spec"]) if o["shard_spec"] is not None else None,
    )
    if spec.shard is not None:
        check_not_empty(spec.shard, len(spec.scenarios) * len(spec.cases))
    run_dir = check_writable("--out", Path(o["out_dir"]) if o["out_dir"] else default_run_dir(o["model"]), True)
    inputs = (*o["images"], *o["videos"], *o["audios"], *([o["prompts_file"]] if o["prompts_file"] else []))
    junit = check_writable("--junit", Path(o["junit_path"]), False) if o["junit_path"] else None
    case_ids = [scenario_case_id(scenario, case.id) for scenario in spec.scenarios for case in spec.cases]
    check_outputs([("--out", path) for path in files_written(run_dir, case_ids)]
                  + ([("--junit", junit)] if junit else []), inputs)
    # Read before anything runs: a key file that cannot be used is refused now, not after the run.
    output = OutputOptions(run_dir=run_dir, junit=junit, plots=not o["no_plot"], signing_key=signing_key())
    backend = BackendOptions(
        name=o["backend"], model=o["model"], device=o["device"], dtype=o["dtype"], seed=o["seed"],
        threads=o["threads"], runner=o["runner"], poison=o["poison"], graph_backend=o["graph_backend"],
        buckets=o["buckets"], chunk_size=o["chunk_size"],
        concurrent=o["concurrent"], gpus=tuple(o["gpus"]), ready_timeout=o["ready_timeout"],
        mem_fraction=o["mem_fraction"], engine=MappingProxyType({e.name: o[e.name] for e in registry.own_options()}),
    )
    warn_ignored(click.get_current_context(), backend.name)
    close = misspelled_preset(o["model"])
    if close is not None:
        raise UsageError(f"--model {o['model']}: not an embedded preset, a folder, or a Hugging Face id (owner/name); "
                         f"did you mean {close}? (`parity models` lists the presets)")
    console = _console()
    try:
        check_runnable(o["model"])  # a model with nothing to prove is said so before any arm
        if o["audios"]:
            from parity.run_command import judge_audio_only

            judge_audio_only(o["audios"], o["prompt_texts"], o["prompts_file"],
                             bool(o["fixture_names"] or o["images"] or o["videos"]), backend)
        note = plan_note(spec, o["model"])
        if note:
            click.echo(note, err=True)
        with first_stop_only():
            run_result = execute_run(spec, backend, output, console)
    except RunStopped as stopped:
        console.print(f"[red]{escape(stopped.message)}[/]", highlight=False)
        sys.exit(stopped.exit_code)
    except NothingToProve as found:  # a verdict all the same: its files are written for CI, then said
        write_before_run(spec, backend, output, found, console)
        raise
    sys.exit(exit_code(run_result.verdict))


@cli.command()
@click.argument("results_file")
@click.option("--json", "as_json", is_flag=True, help="Print the recomputed verdicts as JSON: the run's and each case's.")
@click.option("--document", is_flag=True, help="Print the whole recomputed results document (JSON).")
@require_signed_option
def verdict(results_file: str, as_json: bool, document: bool, require_signed: bool) -> None:
    """Recompute comparisons and verdicts of a results file from its arms; exit with the verdict's code."""
    from parity.reporting.report import render_json, verdicts_json
    from parity.trust.loader import load_results
    from parity.judge.verdict import judge_run

    from parity.plan.sharding import describe as describe_shard

    if as_json and document:
        raise UsageError("--json prints the verdicts, --document the whole results document: give one")
    run_result = judge_run(load_results(results_file, require_signed))
    if document:
        click.echo(render_json(run_result))
    elif as_json:
        click.echo(verdicts_json(run_result))
    else:
        for case in run_result.cases:
            click.echo(visible(f"{case.id}: {case.verdict.code}: {case.verdict.reason}"))
        shard = describe_shard(run_result)
        if shard:
            click.echo(f"judged {shard[0].lower()}{shard[1:]}")
        click.echo(visible(f"{run_result.verdict.code}: {run_result.verdict.reason}"))
    sys.exit(exit_code(run_result.verdict))


@cli.command()
@click.argument("results_files", nargs=-1, required=True)
@click.option("--format", "fmt", type=click.Choice(["markdown", "json", "table"]), default="markdown", show_default=True)
@click.option("--no-images", is_flag=True,
              help="Markdown: name the plots instead of linking them (a PR comment or CI summary cannot show them).")
@click.option("--full", is_flag=True,
              help="Markdown: every case in full (report-full.md), not fitted to a PR comment (report.md).")
@click.option("--exit-zero", is_flag=True, help="Exit 0 whatever the verdict (rendering only, not a gate).")
@require_signed_option
def report(results_files: tuple[str, ...], fmt: str, no_images: bool, full: bool, exit_zero: bool,
           require_signed: bool) -> None:
    """Render a results file (verdicts recomputed) as markdown, JSON or a terminal table; exit with the
    verdict's code, like `verdict` and `merge` (--exit-zero: always 0).

    Several files: one matrix report over their experiments (the shards of each are merged); the exit
    code is the matrix verdict's."""
    from parity.reporting.report import render_full_markdown, render_json, render_markdown
    from parity.reporting.terminal import print_table
    from parity.trust.loader import load_results
    from parity.judge.verdict import judge_run

    if len(results_files) > 1:
        from parity.merge import load_files, merge_matrix
        from parity.reporting.matrix import matrix_json, print_matrix, render_matrix

        from parity.reporting.matrix import experiments, matrix_verdict

        runs = merge_matrix(load_files(results_files, require_signed))
        if fmt == "table":
            print_matrix(runs, _console())
        else:
            click.echo(render_matrix(runs) if fmt == "markdown" else matrix_json(runs))
        verdict = matrix_verdict(experiments(runs))
    else:
        run_result = judge_run(load_results(results_files[0], require_signed))
        if fmt == "table":
            print_table(run_result, _console())
        else:
            render = render_full_markdown if full else render_markdown
            click.echo(render(run_result, images=not no_images) if fmt == "markdown" else render_json(run_result))
        verdict = run_result.verdict
    sys.exit(0 if exit_zero else exit_code(verdict))


@cli.command()
@click.argument("results_file")
@click.option("--case", "case_id", help="Only this case (default: every case whose bcg arm disagrees with eager).")
@click.option("--image", "images", multiple=True, help="A user image the run used (matched by sha256; repeatable).")
@click.option("--video", "videos", multiple=True, help="A user video the run used (matched by sha256; repeatable).")
@click.option("--localize-threshold", default="auto", show_default=True, callback=auto_or_number(0.0, False),
              help="auto (the run's threshold, else the dtype's default) or a number: the first layer whose "
                   "relative error exceeds it is named.")
@click.option("--device", type=click.Choice(["cpu", "cuda"]), default=None, help="Default: the run's device.")
@click.option("--json", "as_json", is_flag=True, help="Print the localizations as JSON.")
@click.option("--write", is_flag=True, help="Store the localizations in the results file, the plots beside it.")
def localize(results_file: str, case_id: str | None, images: tuple[str, ...], videos: tuple[str, ...],
             localize_threshold: float | None, device: str | None, as_json: bool, write: bool) -> None:
    """Say where a failing case's graph replay first leaves eager: the first divergent layer.

    Reloads the run's model (transformers backend), rebuilds each failing case's requests, replays
    them through a probe graph of the run's runner and eagerly, and compares the hidden state after
    every decoder layer and DeepStack add. Exit 0 when it localized what was asked, 2 on usage errors.
    """
    from parity.localize_command import LocalizeOptions, localize_results
    from parity.reporting.report import localization_json, localization_lines

    result = localize_results(LocalizeOptions(Path(results_file), case_id, tuple(images), tuple(videos),
                                              localize_threshold, device, write))
    cases = [c for c in result.run.cases if c.id in result.case_ids]
    if as_json:
        click.echo(localization_json(cases))
    elif not cases:
        click.echo("nothing to localize: no bcg arm of any case disagrees with its eager reference")
    else:
        for case in cases:
            click.echo("\n".join(localization_lines(case)))
    for path in result.written:
        click.echo(visible(f"wrote {path}"), err=as_json)


@cli.command()
@click.argument("results_files", nargs=-1, required=True)
@click.option("--out", "out_dir", required=True, help="Folder for the merged results.json, report.md and plots.")
@click.option("--junit", "junit_path", help="Also write a JUnit XML file here (one testsuite per experiment).")
@click.option("--no-plot", is_flag=True, help="Skip the plots.")
@click.option("--allow-missing", callback=int_list, default="", metavar="K[,K]",
              help="Shards missing on purpose: merge without them; the verdict is then at best INCOMPLETE.")
@click.option("--matrix", is_flag=True,
              help="Files of several experiments (models, engines, graph modes, GPUs): merge each one's shards "
                   "into its own folder and write one matrix report.")
@click.option("--allow-mixed-code", is_flag=True,
              help="Merge shards written by different parity sources (environment.parity_source); the report "
                   "says so.")
@require_signed_option
def merge(results_files: tuple[str, ...], out_dir: str, junit_path: str | None, no_plot: bool,
          allow_missing: tuple[int, ...], matrix: bool, allow_mixed_code: bool, require_signed: bool) -> None:
    """Join the shards of a sharded run (`parity run --shard K/N`) into one judged run; exit with its verdict's code.

    Refuses (exit 2) files of different experiments, a shard given twice and a missing shard."""
    from parity.merge import MergeOutput, run_merge
    from parity.run_command import check_writable

    out = check_writable("--out", Path(out_dir), True)
    junit = check_writable("--junit", Path(junit_path), False) if junit_path else None
    output = MergeOutput(out, junit, not no_plot, signing_key())
    from parity.run.interrupts import first_stop_only

    with first_stop_only():  # SIGTERM unwinds like Ctrl-C: no temporary file is left behind
        merged, written = run_merge(results_files, output, allow_missing, matrix,
                                    warn=lambda message: click.echo(f"warning: {message}", err=True),
                                    allow_mixed_code=allow_mixed_code, require_signed=require_signed)
    click.echo(f"{merged.code}: {merged.reason}")
    click.echo(f"report: {written}")
    sys.exit(exit_code(merged))


@cli.command()
@click.argument("before_file")
@click.argument("after_file")
@click.option("--format", "fmt", type=click.Choice(["markdown", "table"]), default="markdown", show_default=True)
@require_signed_option
def compare(before_file: str, after_file: str, fmt: str, require_signed: bool) -> None:
    """Before/after table of two results files (e.g. before and after a fix); exit with AFTER's verdict code."""
    from parity.reporting.before_after import compare_runs, render_markdown, render_table
    from parity.trust.loader import load_results
    from parity.judge.verdict import judge_run

    # Judged here, where the files are loaded: what they store about themselves is not trusted.
    result = compare_runs(judge_run(load_results(before_file, require_signed)),
                          judge_run(load_results(after_file, require_signed)))
    if fmt == "table":
        render_table(result, _console())
    else:
        click.echo(render_markdown(result))
    sys.exit(exit_code(result.after_verdict))


for listing in (audit, fixtures, arms, models):
    cli.add_command(listing)


def main() -> None:
    try:
        cli(prog_name="parity")
    except SystemExit as leaving:
        if leaving.code in STOP_EXITS:
            # Stopping on a signal: one more (a second Ctrl-C, a CI runner's SIGTERM after its SIGINT)
            # arriving while the interpreter shuts down must not replace the first signal's exit code.
            for signum in (signal.SIGINT, signal.SIGTERM):
                signal.signal(signum, signal.SIG_IGN)
        raise
