"""`parity run`: options into a RunSpec, a backend and an output plan, then the run folder's files.

Everything a user can get wrong is checked before a model loads, a server starts or a file is
created; files are written last, each whole or not at all, also when the run is interrupted.
"""

from __future__ import annotations

import dataclasses
import os
import re
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Sequence

from rich.console import Console
from rich.markup import escape

from parity.backends.options import BackendOptions
from parity.registry import create_backend
from parity.errors import NothingToProve, UsageError
from parity.run.experiment import RunInterrupted, run_experiment
from parity.run.planning import CaseSpec, RunSpec, planned_arm_runs
from parity.media.catalog import builtin_fixture
from parity.media.fixtures import DEFAULT_FIXTURE, Fixture, Prompt, builtin_fixtures, default_prompts, image_fixture
from parity.media.videos import builtin_video, builtin_videos, is_video_name, video_fixture
from parity.run.interrupts import deferred_stops, exit_code_of, signal_of
from parity.reporting.ci_summary import append_step_summary, step_summary_wanted
from parity.reporting.progress import progress_display
from parity.reporting.report import FULL_REPORT, REPORT, render_markdown, report_files
from parity.reporting.terminal import print_table
from parity.results import RunResult, dumps
from parity.textfiles import NotAFile, TooLarge, described, read_text_capped, write_atomically

# A prompts file is a few lines; a megabyte of prompts is thousands of cases, far past any run.
MAX_PROMPTS_BYTES = 1024 * 1024
AUDIO_PROMPT = Prompt("describe", "Describe what you hear in one sentence.")


@dataclass(frozen=True)
class OutputOptions:
    """Where the run's files go."""

    run_dir: Path
    junit: Path | None = None
    plots: bool = True
    signing_key: bytes | None = field(default=None, repr=False)  # signs results.json (design §4d)


def build_cases(fixture_names: Sequence[str], images: Sequence[str], prompt_texts: Sequence[str],
                prompts_file: str | None, videos: Sequence[str] = ()) -> tuple[CaseSpec, ...]:
    fixtures = _unique_names(_fixtures(fixture_names, images, videos))
    prompts = _user_prompts(prompt_texts, prompts_file)
    # Every fixture x prompt is a case; without user prompts, each fixture's first own prompt.
    return tuple(CaseSpec(f, p) for f in fixtures for p in (prompts or default_prompts(f)[:1]))


def _fixtures(names: Sequence[str], images: Sequence[str], videos: Sequence[str] = ()) -> list[Fixture]:
    for name in names:
        if name != "all":
            builtin_fixture(name)  # every name is checked, also next to `all`
    chosen = builtin_fixtures() if "all" in names else [builtin_fixture(n) for n in dict.fromkeys(names)]
    chosen += [image_fixture(path) for path in images]
    chosen += [video for given in videos for video in _videos(given)]
    return chosen or [builtin_fixture(DEFAULT_FIXTURE)]


def _videos(given: str) -> list[Fixture]:
    """`--video`: a file (first, so a file named like a built-in is read), `all` built-in videos, or one."""
    if Path(given).exists() or not (given == "all" or is_video_name(given)):
        return [video_fixture(given)]
    return builtin_videos() if given == "all" else [builtin_video(given)]


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
            raw = read_text_capped(prompts_file, MAX_PROMPTS_BYTES)
        except (TooLarge, NotAFile) as err:
            raise UsageError(f"--prompts {prompts_file}: {err}; not a prompts file") from None
        except OSError as err:
            raise UsageError(f"--prompts {prompts_file}: cannot be read ({described(err)})") from None
        except UnicodeDecodeError as err:
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
    _check_resolvable(option, path)
    if path.exists():
        if path.is_dir() != directory:
            raise UsageError(f"{option} {path}: is {'not ' if directory else ''}a folder")
        if not directory and not path.is_file():
            raise UsageError(f"{option} {path}: is not a regular file (a FIFO, socket or device); give a file path")
        if not os.access(path, os.W_OK | (os.X_OK if directory else 0)):
            raise UsageError(f"{option} {path}: cannot be written (permission denied)")
        return path
    ancestor = path.parent
    while not ancestor.exists():
        _check_resolvable(option, ancestor)
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        raise UsageError(f"{option} {path}: cannot be written ({ancestor} is a file)")
    if not os.access(ancestor, os.W_OK | os.X_OK):
        raise UsageError(f"{option} {path}: cannot be written (permission denied in {ancestor})")
    return path


def _check_resolvable(option: str, path: Path) -> None:
    """A path that exists as a name but cannot be followed (a symbolic-link loop, a link through a
    file) would fail only when the run writes, after all its work."""
    if os.path.lexists(path):
        try:
            os.stat(path)
        except FileNotFoundError:
            return  # a dangling link: written through like a new file
        except OSError as err:
            raise UsageError(f"{option} {path}: {described(err)}") from None


def files_written(out_dir: Path, case_ids: Sequence[str]) -> list[Path]:
    """The files a run (or a merged experiment) writes into its folder: results.json, report.md,
    report-full.md and each case's plots."""
    from parity.reporting.plots import plot_filename

    plots = [plot_filename(case_id, suffix) for case_id in case_ids for suffix in ("", "-layers")]
    return [out_dir / name for name in ("results.json", REPORT, FULL_REPORT, *plots)]


def check_outputs(written: Sequence[tuple[str, Path]], inputs: Sequence[str | Path]) -> None:
    """No file a command writes is one of its inputs, or another file the same command writes (the
    JUnit file over the results it reports): refused before any work. `written`: (option, path)."""
    seen: dict[str, tuple[str, Path]] = {}
    for option, path in written:
        real = os.path.realpath(path)  # realpath never raises, a loop in a path included
        if real in seen:
            raise UsageError(f"{option} {path}: the command writes {seen[real][1]} there too ({seen[real][0]}); "
                             "give another path")
        seen[real] = (option, path)
    for given in inputs:
        found = seen.get(os.path.realpath(given))
        if found is not None:
            raise UsageError(f"{found[0]} {found[1]}: is the input {given}, which the command would overwrite; "
                             "give another path")


# Seconds per generation of a tiny preset on one CPU core, measured with `parity run --fixture all
# --scenario all` (126 generations) at 4, 20 and 40 new tokens on a loaded two-core machine.
_TINY_SECONDS_PER_ARM = (0.15, 0.01)  # (fixed, per new token)
# Above this many generations a run says how long it will take before it starts.
LARGE_PLAN_ARMS = 500


def plan_note(spec: RunSpec, model: str) -> str | None:
    """'N arm runs planned, roughly M minutes' for a large plan; None for an ordinary one."""
    runs = planned_arm_runs(spec)
    if runs <= LARGE_PLAN_ARMS:
        return None
    if not model.startswith("tiny-"):
        return f"{runs} arm runs planned (each a full generation of {model})"
    fixed, per_token = _TINY_SECONDS_PER_ARM
    minutes = runs * (fixed + per_token * spec.max_new_tokens) / 60
    return f"{runs} arm runs planned, roughly {max(1, round(minutes))} minutes on a CPU"


def check_buckets(buckets: str | Sequence[int], max_positions: int | None) -> None:
    """A bucket past the model's context can never be filled, and capturing it costs without end."""
    if isinstance(buckets, str) or max_positions is None:
        return
    too_large = [b for b in buckets if b > max_positions]
    if too_large:
        raise UsageError(f"--buckets {max(too_large)}: larger than the model's context of {max_positions} positions; "
                         "no prompt can fill it")


class RunStopped(Exception):
    """A signal ended the run; `message` says what was kept, `exit_code` is 128 + the signal."""

    def __init__(self, signum: int, message: str) -> None:
        super().__init__(message)
        self.exit_code = exit_code_of(signum)
        self.message = message


def judge_audio_only(audios: Sequence[str], prompt_texts: Sequence[str], prompts_file: str | None,
                     with_other_media: bool, backend: BackendOptions) -> None:
    """`--audio`: audio-only cases, judged before any arm. The model must take audio; each clip is
    prepared with each prompt, and when none carries a DeepStack row (audio has none) the run is
    INCONCLUSIVE_NO_POWER (NothingToProve) without running an arm. A server backend judges it the
    same way, and no server starts: what its servers would load is this model (a preset's saved
    checkpoint holds exactly the preset's weights; a whole Qwen3-Omni loads as its thinker)."""
    from parity.media.audio import audio_clip
    from parity.models import load_model

    if with_other_media:
        raise UsageError("--audio makes audio-only cases, which have no DeepStack to prove; run them apart from "
                         "--fixture, --image and --video")
    clips = [audio_clip(given) for given in audios]
    prompts = _user_prompts(prompt_texts, prompts_file) or (AUDIO_PROMPT,)
    loaded = load_model(backend.model, device=backend.device, dtype=backend.dtype, seed=backend.seed)
    if not loaded.adapter.takes_audio:
        raise UsageError(f"--audio: {backend.model} takes no audio; a model with an audio tower does (tiny-qwen3-omni)")
    for clip in clips:
        for prompt in prompts:
            deepstack = loaded.adapter.prepare(None, prompt.text, audio=clip).deepstack
            if deepstack is not None and bool(deepstack.any()):
                raise UsageError(f"--audio {clip.name}: {backend.model} adds DeepStack to audio rows; parity does "
                                 "not run audio arms yet")
    names = ", ".join(f"{c.name} ({c.seconds:.1f} s, sha256 {c.sha256[:12]}…)" for c in clips)
    raise NothingToProve(f"{len(clips) * len(prompts)} audio-only case(s), {names}: audio adds no DeepStack in "
                         f"{backend.model} (each prepared request has no DeepStack row), so no arm could show what "
                         "DeepStack does under graph replay; nothing ran", cause="audio")


def check_media(spec: RunSpec, backend: str) -> None:
    """A video for a server without PyAV to write the file it is sent as: exit 2 with the reason,
    before any server starts."""
    from parity.registry import BACKENDS
    from parity.media.videos import has_av

    videos = [c.fixture.name for c in spec.cases if c.fixture is not None and c.fixture.is_video]
    if videos and BACKENDS[backend].servers_key is not None and not has_av():
        raise UsageError(f"--backend {backend} sends each video ({', '.join(videos)}) as a file parity writes with "
                         "PyAV, which is not installed: pip install 'parity[video]'")


def execute_run(spec: RunSpec, backend: BackendOptions, output: OutputOptions, console: Console) -> RunResult:
    """Run, write the run folder (results.json, report.md and JUnit first), show the verdict, then
    draw the plots. Ctrl-C or SIGTERM raises `RunStopped` after writing what finished; the caller
    holds every later signal off (`interrupts.first_stop_only`) until the files are written."""
    check_media(spec, backend.name)
    existed = output.run_dir.exists()
    try:
        result = _run(spec, backend, output, console)
    except RunInterrupted as stop:
        raise _kept(stop, output, console, existed) from None
    except KeyboardInterrupt as stop:  # before the plan was made: the model loading, a server starting
        raise RunStopped(signal_of(stop), _nothing_finished(output, existed)) from None
    unwritten = None
    with deferred_stops(reraise=False) as noted:  # files first: a stop now still keeps them whole
        try:
            _write_files(result, output, console)
        except UsageError as failed:  # a full disk: the verdict is still shown, then the error
            unwritten = failed
    written = f"interrupted: the results are written in {output.run_dir}; no plots were drawn"
    if noted:
        raise RunStopped(noted[0], written)
    try:
        print_table(result, console)
    except KeyboardInterrupt as stop:
        raise RunStopped(signal_of(stop), written) from None
    if unwritten is not None:
        raise unwritten
    if output.plots:
        result = _plotted(result, output, console)
    console.print(f"results: {escape(str(output.run_dir / 'results.json'))}  "
                  f"report: {escape(str(output.run_dir / 'report.md'))}", highlight=False)
    return result


def write_before_run(spec: RunSpec, backend: BackendOptions, output: OutputOptions, found: NothingToProve,
                     console: Console) -> RunResult:
    """A verdict found before any arm (design §4c) still reaches CI: results.json (no case), the
    reports, JUnit and the step summary, as a run's would be."""
    from parity import __version__
    from parity.judge.identity import SOURCE_KEY, source_identity
    from parity.judge.verdict import judge_run
    from parity.results import Verdict

    config = {"model": spec.model, "backend": backend.name, "dtype": backend.dtype, "scenarios": list(spec.scenarios),
              "max_new_tokens": spec.max_new_tokens, "cause": found.cause}
    if spec.shard is not None:
        config["shard_asked"] = f"{spec.shard.index}/{spec.shard.count}"
    result = judge_run(RunResult(
        created=datetime.now(timezone.utc).isoformat(timespec="seconds"),
        environment={"parity": __version__, SOURCE_KEY: source_identity(), "device": backend.device},
        config=config, cases=(), before_run=Verdict(found.verdict, str(found))))
    with deferred_stops(reraise=False):
        _write_files(result, output, console)
    found.written = f"{output.run_dir / 'results.json'}  report: {output.run_dir / REPORT}"
    return result


def _run(spec: RunSpec, backend: BackendOptions, output: OutputOptions, console: Console) -> RunResult:
    started = time.perf_counter()
    engine = create_backend(backend, spec.max_new_tokens, output.run_dir)
    load_seconds = time.perf_counter() - started
    try:
        check_buckets(backend.buckets, engine.max_positions)
    except BaseException:
        engine.close()
        raise
    with progress_display(console) as progress:
        return run_experiment(spec, engine, progress, load_seconds=load_seconds,
                              warn=lambda message: console.print(f"[yellow]warning:[/] {escape(message)}"))


def _kept(stop: RunInterrupted, output: OutputOptions, console: Console, existed: bool) -> RunStopped:
    """Write what finished, shielded from a further signal, then show it and say what was kept."""
    if stop.finished_arms == 0:
        return RunStopped(stop.signum, _nothing_finished(output, existed))
    with deferred_stops(reraise=False):
        _write_files(stop.result, output, console)
    # The cases that ran something, and the overall verdict: not a page of "not run" per case.
    print_table(dataclasses.replace(stop.result, cases=tuple(c for c in stop.result.cases if c.all_arms())), console)
    if not stop.result.interrupted:
        return RunStopped(stop.signum, f"interrupted after every arm had run: every process parity started was "
                                       f"stopped; the judged results (without localizations) are in {output.run_dir}")
    return RunStopped(stop.signum, f"interrupted: every process parity started was stopped; the "
                                   f"{stop.finished_arms} arm(s) that finished are in {output.run_dir}, "
                                   "marked interrupted")


def _nothing_finished(output: OutputOptions, existed: bool) -> str:
    if existed or not output.run_dir.exists():
        return "interrupted: nothing had finished; nothing written"
    # A server backend logs into the run folder from its start.
    return f"interrupted: nothing had finished; no results written ({output.run_dir} holds only the servers' logs)"


def _write_files(result: RunResult, output: OutputOptions, console: Console) -> None:
    """results.json, report.md, JUnit, the CI step summary: each whole or not at all."""
    _write(output.run_dir / "results.json", dumps(result, output.signing_key) + "\n", f"--out {output.run_dir}")
    for name, text in report_files(result).items():
        _write(output.run_dir / name, text, f"--out {output.run_dir}")
    if output.junit is not None:
        from parity.reporting.junit import junit_xml

        _write(output.junit, junit_xml(result), "--junit")
    try:
        if step_summary_wanted():
            append_step_summary(render_markdown(result, images=False))
    except OSError as err:  # the verdict stands; a CI summary that cannot be written is a warning
        console.print(f"[yellow]warning:[/] GITHUB_STEP_SUMMARY not written ({escape(err.strerror or str(err))})")


def _write(path: Path, text: str, option: str) -> None:
    try:
        write_atomically(path, text)
    except OSError as err:
        raise UsageError(f"{option}: cannot write {path} ({err.strerror or err}); the verdict above was not "
                         "saved there") from None


def _plotted(result: RunResult, output: OutputOptions, console: Console) -> RunResult:
    """The plots, then results.json and report.md again with them linked. A stop while plotting
    keeps the files already written (their report has no plot links)."""
    try:
        from parity.reporting.plots import with_plots

        plotted = with_plots(result, output.run_dir,
                             lambda message: console.print(f"[yellow]warning:[/] {escape(message)}"))
    except KeyboardInterrupt as stop:
        raise RunStopped(signal_of(stop), f"interrupted while plotting: results.json, report.md and JUnit are "
                                          f"written in {output.run_dir}; the plots are not linked") from None
    try:
        with deferred_stops():
            write_atomically(output.run_dir / "results.json", dumps(plotted, output.signing_key) + "\n")
            for name, text in report_files(plotted).items():
                write_atomically(output.run_dir / name, text)
    except OSError as err:
        console.print("[yellow]warning:[/] plots drawn but not linked in report.md "
                      f"({escape(err.strerror or str(err))})")
        return result
    except KeyboardInterrupt as stop:
        raise RunStopped(signal_of(stop), f"interrupted: the results are written in {output.run_dir}") from None
    return plotted
