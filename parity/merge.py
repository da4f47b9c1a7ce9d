"""`parity merge`: shards of one experiment back into one judged run, and several experiments into
one matrix report (design §8).

Nothing stored is trusted: every file is loaded and validated like `parity verdict` does, the
merged run is re-judged from its arms (`verdict.judge_run`), and a file that does not belong is a
usage error (exit 2) naming the file and the field: another experiment, a shard given twice, a
shard missing (unless `--allow-missing` names it, and then the verdict is at best INCOMPLETE).
"""

from __future__ import annotations

import dataclasses
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

from parity.errors import UsageError
from parity.run.interrupts import deferred_stops
from parity.judge.identity import MODEL_FIELD, SOURCE_KEY, difference_path, first_difference, identity, model_of, shown
from parity.model_identity import CONFIG_KEY as IDENTITY_KEY
from parity.results import RunResult, Verdict, dumps
from parity.textfiles import write_atomically
from parity.trust.consistency import Contradiction
from parity.trust.loader import MAX_FILE_BYTES, load_results
from parity.trust.requirements import check_all
from parity.plan.sharding import CONFIG_KEY, ShardRecord, merged_config, read_shard
from parity.judge.verdict import judge_run

Warn = Callable[[str], object]


@dataclass(frozen=True)
class ShardFile:
    """A results file as the merge sees it: where it came from, its run, and the shards it holds."""

    path: str
    run: RunResult
    record: ShardRecord

    @classmethod
    def load(cls, path: str, require_signed: bool = False) -> "ShardFile":
        run = load_results(path, require_signed)
        record = read_shard(run.config)  # validated by the loader
        if record is None:  # an unsharded run is the one shard of a run in one shard
            record = ShardRecord(1, {c.id: 1 for c in run.cases}, index=1)
        return cls(path, run, record)


def load_files(paths: Sequence[str], require_signed: bool = False) -> list[ShardFile]:
    if not paths:
        raise UsageError("give at least one results file")
    return [ShardFile.load(p, require_signed) for p in paths]


# --- one experiment ------------------------------------------------------------------------------

def check_one_experiment(files: Sequence[ShardFile], allow_mixed_code: bool = False) -> tuple[str, ...]:
    """Refuse files of another experiment, naming the first field (and the case) where they differ;
    the sources of the code that wrote them, several only with `allow_mixed_code`."""
    first = files[0]
    reference = identity(first.run)
    for other in files[1:]:
        theirs = identity(other.run)
        field = first_difference(reference, theirs)
        if field in (MODEL_FIELD, f"config.{IDENTITY_KEY}"):
            raise UsageError(f"{other.path}: judged {model_of(other.run)}, but {first.path} judged "
                             f"{model_of(first.run)}: shards of two models, not of the same experiment "
                             f"(config.{IDENTITY_KEY}; merge --matrix reports several experiments)")
        if field is not None:
            path, mine, before = difference_path(field, theirs.get(field), reference.get(field))
            raise UsageError(f"{other.path}: {path} is {shown(mine)}, but {first.path} has {shown(before)}: "
                             "not shards of the same experiment (merge --matrix reports several experiments)")
    sources = tuple(dict.fromkeys(str(f.run.environment.get(SOURCE_KEY)) for f in files))
    if len(sources) > 1 and not allow_mixed_code:
        other = next(f for f in files if str(f.run.environment.get(SOURCE_KEY)) != sources[0])
        raise UsageError(f"{other.path}: environment.{SOURCE_KEY} is {sources[1]!r}, but {first.path} was written by "
                         f"{sources[0]!r}: shards of different code; re-run them with one parity, or merge with "
                         "--allow-mixed-code (the report then says so)")
    return sources


def merge_runs(files: Sequence[ShardFile], allow_missing: Sequence[int] = (), allow_mixed_code: bool = False
               ) -> RunResult:
    """The judged run of one experiment's shards; refuses another experiment, a duplicate or a
    missing shard (unless allowed: then the run records it and cannot pass), shards of other code
    (unless allowed: then the run records it), and shards that disagree on what the same image and
    prompt gave (another seed, checkpoint or dtype)."""
    if any(f.run.before_run is not None for f in files):
        return _merged_before_run(files)
    sources = check_one_experiment(files, allow_mixed_code)
    count, plan = files[0].record.count, files[0].record.cases
    holder: dict[int, str] = {}
    for f in files:
        for shard in f.record.covers:
            if shard in holder:
                what = (f"config.{CONFIG_KEY} shard {shard}/{count}" if CONFIG_KEY in f.run.config
                        else "the whole (unsharded) run")
                raise UsageError(f"{f.path}: {what} is also in {holder[shard]}: a duplicate; give each "
                                 "results file once")
            holder[shard] = f.path
    missing = [k for k in range(1, count + 1) if k not in holder]
    _check_allowed(allow_missing, holder, count)
    for shard in missing:
        if shard not in allow_missing:
            cases = [c for c, k in plan.items() if k == shard]
            raise UsageError(f"shard {shard}/{count} is missing: no file given has config.{CONFIG_KEY}.index {shard} "
                             f"(its {len(cases)} case(s), e.g. {cases[0]!r}); give its results file, or "
                             f"--allow-missing {shard} to merge without it (the verdict is then at best INCOMPLETE)")
    by_id = {case.id: (case, f.path) for f in files for case in f.run.cases}  # absent ones stay INCOMPLETE
    first = files[0].run
    config = dict(first.config)
    if count > 1 or CONFIG_KEY in config:
        config[CONFIG_KEY] = merged_config(count, plan, sorted(holder), missing)
    environment = dict(first.environment)
    if len(sources) > 1:
        environment[SOURCE_KEY] = list(sources)  # the report names every source (--allow-mixed-code)
    merged = RunResult(
        created=max(f.run.created for f in files), environment=environment, config=config,
        cases=tuple(by_id[c][0] for c in plan if c in by_id), schema=first.schema,
        interrupted=any(f.run.interrupted for f in files),
    )
    try:
        check_all(merged)  # across shards: one fingerprint per image and prompt, among others
    except Contradiction as err:
        case = merged.cases[err.place.case] if err.place is not None else None
        source = f"{by_id[case.id][1]}: " if case is not None else ""
        raise UsageError(f"{source}the shards disagree: {err}") from None
    return judge_run(merged)


def _merged_before_run(files: Sequence[ShardFile]) -> RunResult:
    """Shards of a run judged before any arm (design §4c): each shard judged the model, not its cases,
    so every shard says the same, and the merge is that verdict. A shard whose run went further, or
    that judged another model, is not a shard of this experiment."""
    first = files[0]
    for other in files:
        if other.run.before_run is None or other.run.config.get("model") != first.run.config.get("model"):
            raise UsageError(f"{other.path}: not a shard of {first.path}'s run, which was judged before any arm "
                             f"({first.run.before_run.code if first.run.before_run else 'its arms ran'} for "
                             f"{first.run.config.get('model')!r})")
    latest = max(files, key=lambda f: f.run.created).run
    return judge_run(latest)


def _check_allowed(allowed: Sequence[int], holder: dict[int, str], count: int) -> None:
    for shard in allowed:
        if not 1 <= shard <= count:
            raise UsageError(f"--allow-missing {shard}: the run has shards 1 to {count}")
        if shard in holder:
            raise UsageError(f"--allow-missing {shard}: shard {shard}/{count} is in {holder[shard]}; "
                             "leave it out of --allow-missing")


# --- several experiments -------------------------------------------------------------------------

def group_experiments(files: Sequence[ShardFile]) -> list[list[ShardFile]]:
    """Files grouped by experiment, in the order each experiment is first given."""
    groups: list[tuple[dict, list[ShardFile]]] = []
    for f in files:
        key = identity(f.run)
        for reference, members in groups:
            if first_difference(reference, key) is None:
                members.append(f)
                break
        else:
            groups.append((key, [f]))
    return [members for _, members in groups]


def merge_matrix(files: Sequence[ShardFile], allow_mixed_code: bool = False) -> list[RunResult]:
    """One judged run per experiment among `files`, each from all of its shards; a refusal names
    the experiment it is about."""
    from parity.reporting.matrix import label_of

    runs = []
    for group in group_experiments(files):
        try:
            runs.append(merge_runs(group, allow_mixed_code=allow_mixed_code))
        except UsageError as err:
            raise UsageError(f"experiment {label_of(group[0].run)}: {err}") from None
    return runs


# --- writing ---------------------------------------------------------------------------------------

@dataclass(frozen=True)
class MergeOutput:
    out_dir: Path
    junit: Path | None = None
    plots: bool = True
    signing_key: bytes | None = field(default=None, repr=False)  # signs each results.json (design §4d)


def write_run_folder(run: RunResult, folder: Path, plots: bool, warn: Warn, key: bytes | None = None) -> RunResult:
    """results.json (signed with `key`), report.md and report-full.md first (each whole or not at
    all), the plots last, then all three again with the plots linked."""
    from parity.reporting.report import report_files

    def write(run: RunResult) -> None:
        _write(folder / "results.json", dumps(run, key) + "\n")
        for name, text in report_files(run).items():
            _write(folder / name, text)

    # Plots of the shards live in their own folders: drawn anew here, or not linked at all.
    run = dataclasses.replace(run, cases=tuple(dataclasses.replace(c, plot=None, localization_plot=None)
                                               for c in run.cases))
    write(run)
    if plots:
        from parity.reporting.plots import with_plots

        run = with_plots(run, folder, warn)
        write(run)
    return run


def _check_written(merged: Sequence[tuple[Path, RunResult]], output: "MergeOutput", inputs: Sequence[str],
                   own_report: bool = False) -> None:
    """Before anything is written: no file the merge writes (an experiment's folder, the matrix
    report, the JUnit file) is an input or another of its files."""
    from parity.run_command import check_outputs, files_written

    written = [("--out", path) for folder, run in merged for path in files_written(folder, [c.id for c in run.cases])]
    written += [("--out", output.out_dir / "report.md")] if own_report else []
    check_outputs(written + ([("--junit", output.junit)] if output.junit else []), inputs)


def _check_out_holds_no_input(paths: Sequence[str], out_dir: Path) -> None:
    """The merge writes into --out; an input there would be overwritten by the merge of itself."""
    folder = Path(os.path.realpath(out_dir))  # realpath never raises, a loop in an input's path included
    for path in paths:
        resolved = Path(os.path.realpath(path))
        if resolved == folder or folder in resolved.parents:
            raise UsageError(f"--out {out_dir}: holds the input {path}, which the merge would overwrite; "
                             "write the merge to another folder")


def _write(path: Path, text: str) -> None:
    # A character is at most four UTF-8 bytes: encode (a copy of a large file) only near the cap.
    size = len(text) if len(text) * 4 <= MAX_FILE_BYTES else len(text.encode("utf-8", "backslashreplace"))
    if size > MAX_FILE_BYTES and path.suffix == ".json":
        raise UsageError(f"--out: the merged {path.name} would be larger than the {MAX_FILE_BYTES // 2**20} MiB "
                         "that `parity verdict` reads back; merge fewer shards at a time (or --matrix per experiment)")
    try:
        with deferred_stops():  # a stop while writing comes after the file is whole (or gone)
            write_atomically(path, text)
    except OSError as err:
        raise UsageError(f"--out: cannot write {path} ({err.strerror or err})") from None


def experiment_folder(index: int, run: RunResult) -> str:
    from parity.reporting.matrix import label_of

    slug = re.sub(r"[^A-Za-z0-9_.-]+", "_", label_of(run)).strip("_")[:80]
    return f"{index}-{slug}"


def run_merge(paths: Sequence[str], output: MergeOutput, allow_missing: Sequence[int] = (), matrix: bool = False,
              warn: Warn = print, allow_mixed_code: bool = False, require_signed: bool = False) -> tuple[Verdict, Path]:
    """Load, merge, judge and write; (the verdict to exit with, the report written).

    One experiment: `out_dir` holds its results.json, report.md and plots. `matrix`: one folder per
    experiment, and `out_dir/report.md` is the matrix report. Either way the report is appended to
    the CI step summary and `junit` gets one testsuite per experiment."""
    from parity.reporting.ci_summary import append_step_summary, step_summary_wanted
    from parity.reporting.junit import write_junit
    from parity.reporting.matrix import experiments, matrix_verdict, render_matrix
    from parity.reporting.report import render_markdown

    if matrix and allow_missing:
        raise UsageError("--allow-missing names a shard of one experiment; merge that experiment alone "
                         "(without --matrix) to go without one of its shards")
    _check_out_holds_no_input(paths, output.out_dir)
    files = load_files(paths, require_signed)
    if matrix:
        merged = [(output.out_dir / experiment_folder(i, run), run)
                  for i, run in enumerate(merge_matrix(files, allow_mixed_code), 1)]
        _check_written(merged, output, paths, own_report=True)
        runs = [write_run_folder(run, folder, output.plots, warn, output.signing_key) for folder, run in merged]
        markdown = render_matrix(runs)
        _write(output.out_dir / "report.md", markdown)
        verdict = matrix_verdict(experiments(runs))
    else:
        merged = [(output.out_dir, merge_runs(files, allow_missing, allow_mixed_code))]
        _check_written(merged, output, paths)
        runs = [write_run_folder(merged[0][1], output.out_dir, output.plots, warn, output.signing_key)]
        # A summary cannot show the folder's plots; rendered only for a CI that asks for one.
        markdown = render_markdown(runs[0], images=False) if step_summary_wanted() else ""
        verdict = runs[0].verdict
    if output.junit is not None:
        try:
            write_junit(runs, output.junit)
        except OSError as err:
            raise UsageError(f"--junit: cannot write {output.junit} ({err.strerror or err})") from None
    try:
        if step_summary_wanted():
            append_step_summary(markdown)
    except OSError as err:  # the verdict stands; a CI summary that cannot be written is a warning
        warn(f"GITHUB_STEP_SUMMARY not written ({err.strerror or err})")
    return verdict, output.out_dir / "report.md"
