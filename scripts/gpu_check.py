"""Every GPU check in one call, in order of value, inside one time budget (scripts/gpu_check.sh).

A lent GPU gives one call of at most 10 minutes, and only what lies under $OUT comes back: at most 8
files, each under 16 MiB. So every step's limit is planned inside the budget before anything runs
(`schedule`, held by tests/test_gpu_check.py), a step at its limit is stopped, not killed (SIGINT,
so `parity run` writes what finished and pytest its summary, then SIGKILL after a grace), and after
every step four files are written again under --out, so a call cut short still returns what it did:

    summary.md   the one page a reader needs: per step its outcome and verdicts, the graph backend and
                 device that ran, where the time went, peak GPU memory, the noise, and what the CPU
                 reference run gave beside each (docs/measurements/gpu-check-cpu.json)
    summary.json the same as data
    log.txt      every command's output (each log's head and tail where it is long)
    runs.tar.gz  every results file, report, summary and JSON lines file the steps wrote, capped in
                 size; never a checkpoint or weights (a file left out is named in summary.md)

    python scripts/gpu_check.py [--device cuda|cpu] [--out DIR] [--budget 480] [--only STEP,...]

`--device cpu` is the dry run: the same steps on the emulated graph, on this machine's CPUs, each
under its dry limit, planned inside the same budget. `--limit-scale 8 --budget 3600 --write-reference
FILE` runs the steps long enough on a CPU to be the reference a GPU call is read against.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BUDGET_S = 480.0  # one device call of at most 10 minutes, with the machine's start and the transfers around it
RESERVE_S = 15.0  # the last write of $OUT after the last step has stopped
GRACE_S = 15.0  # from a step's stop (SIGINT) to its kill: partial results written, pytest's summary printed
OUT_FILES = ("summary.md", "summary.json", "log.txt", "runs.tar.gz")  # the device returns at most 8
# runs.tar.gz: what a reader needs, never a checkpoint (a weights file of 16 GiB would fill the disk
# and the call), the earlier steps' files first, inside the 16 MiB a returned file may have. Results
# files pack about 6 to 1 (a 63-case results.json: 1.8 MB, 0.3 MB packed); a packed archive over
# ARCHIVE_RETURN_CAP is packed again with half the files' bytes.
ARCHIVE_SUFFIXES = (".json", ".jsonl", ".md", ".xml", ".txt")
ARCHIVE_FILE_CAP = 8 * 2**20
ARCHIVE_CAP = 48 * 2**20  # the files' bytes before compression
ARCHIVE_RETURN_CAP = 15 * 2**20
LOG_HEAD, LOG_TAIL = 16 * 2**10, 192 * 2**10  # of each command's log, in log.txt (at most ~1.5 MiB in all)
REFERENCE = ROOT / "docs" / "measurements" / "gpu-check-cpu.json"

DEEPSTACK_PRESETS = ("tiny-qwen3-vl", "tiny-qwen3-vl-moe")
SCENARIO_ALL_DTYPES = ("float32", "bfloat16")
# Reduced precision first: what only a GPU's kernels can show (the replay check judges bf16 and fp16
# as fp32, design §6); the preset without DeepStack, whose rows a CPU already shows, last.
MATRIX_RUNS = (*((p, d) for d in ("bfloat16", "float16") for p in DEEPSTACK_PRESETS),
               *((p, "float32") for p in DEEPSTACK_PRESETS),
               ("tiny-qwen3-vl-nodeepstack", "bfloat16"), ("tiny-qwen3-vl-nodeepstack", "float32"))
DEPARTURE_RUNS = tuple((p, d) for d in ("bfloat16", "float16", "float32") for p in DEEPSTACK_PRESETS)


@dataclass(frozen=True)
class Command:
    label: str
    argv: tuple[str, ...]
    ok_exit: tuple[int, ...] = (0,)  # the exit codes that mean "as expected"
    skip_exit: tuple[int, ...] = ()  # a refusal that means "not on this machine" (its last line says why)


@dataclass(frozen=True)
class Step:
    name: str
    limit_s: float  # on a GPU: what its work needs there (`measured` says from what)
    dry_limit_s: float  # --device cpu: every step started within the budget, the slow ones stopped
    what: str
    commands: tuple[Command, ...]
    measured: str  # where limit_s comes from: an H200 measurement, or an estimate and its basis
    parallel: bool = True  # False: one after another (timings that must not share the machine)
    # Started, then left running while the next steps run (the suite: CPU work on the host's cores
    # while the device steps use the GPU); its limit runs to the end of the budget.
    background: bool = False
    default: bool = True  # False: only with --only (a call of its own)


@dataclass(frozen=True)
class Slot:
    """A step's place in the budget: it starts at most `start_s` after the call and ends by `end_s`."""

    step: Step
    start_s: float
    limit_s: float

    @property
    def end_s(self) -> float:
        return self.start_s + self.limit_s


@dataclass
class Outcome:
    label: str
    exit_code: int | None = None  # None: killed, or never started
    seconds: float = 0.0
    status: str = "not reached"  # ok | unexpected | stopped | killed | skipped | not reached
    tail: str = ""


@dataclass
class StepResult:
    name: str
    what: str
    limit_s: float
    outcomes: list[Outcome] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def status(self) -> str:
        seen = {o.status for o in self.outcomes}
        for status, said in (("unexpected", "fail"), ("killed", "cut"), ("stopped", "cut"), ("ok", "pass"),
                             ("skipped", "skipped")):
            if status in seen:
                return said
        return "not reached"


def steps(device: str, work: Path, scratch: Path) -> list[Step]:
    """The checks in order of value: what decides a verdict first (the user's command, --scenario all,
    the GPU tests, the matrix rows only a GPU shows), then the shapes; the suite beside them."""
    py, parity = sys.executable, (sys.executable, "-m", "parity")

    def run(label: str, out: str, *args: str, ok=(0,), skip=()) -> Command:
        return Command(label, (*parity, "run", "--device", device, "--no-plot", "--out", str(work / out), *args), ok,
                       skip)

    def measure(label: str, what: str, out: str, *args: str) -> Command:
        return Command(label, (py, "scripts/gpu_measure.py", what, "--device", device, "--out", str(work / out), *args))

    cuda = device == "cuda"
    shape, shape_moe = (("shape-qwen3-vl-8b", "shape-qwen3-vl-30b-a3b") if cuda else
                        ("shape-qwen3-vl-8b-scaled", "shape-qwen3-vl-30b-a3b-scaled"))
    checkpoint = scratch / shape  # outside `work`: the archive never walks 16 GiB of weights
    refused = (2,)  # parity run refuses a shape this device cannot hold, in one line, before building
    return [
        Step("defaults", 45, 30, "`parity run` as a user types it, on this device and on this host's CPU (PASS, exit 0)",
             (run("parity run", "defaults/device"),
              Command("parity run --device cpu", (*parity, "run", "--device", "cpu", "--no-plot", "--out",
                                                  str(work / "defaults/cpu")))),
             "H200 2026-12-04: 24 s on the GPU, then 12-14 s on its CPU", parallel=False),
        Step("scenario-all", 150, 60, "`--scenario all --fixture all` (63 cases) in one process per DeepStack preset "
                                      "and dtype, the four side by side (PASS)",
             tuple(run(f"{p} {d}", f"scenario-all/{p}-{d}", "--model", p, "--dtype", d, "--scenario", "all",
                       "--fixture", "all") for p in DEEPSTACK_PRESETS for d in SCENARIO_ALL_DTYPES),
             "H200 2026-12-04: 92 s for 56 cases alone (MoE bf16); 63 cases about 105 s, 4 side by side on 16 "
             "cores (launch-bound tiny models) estimated 1.4x"),
        Step("pytest-gpu", 30, 20, "the tests marked gpu (real torch.cuda.CUDAGraph), less the --scenario all one "
                                   "the step above runs",
             (Command("pytest -m gpu", (py, "-m", "pytest", "-q", "-m", "gpu", "-k",
                                        "not scenario_all_on_every_fixture", "-p", "no:cacheprovider", "-rs")),),
             "estimated: 6 four-arm library runs and a pool test on tiny presets, about 3 s each"),
        Step("suite", 240, 200, "the whole suite but the gpu tests on this host's CPU, beside the steps after it",
             (Command("pytest -n 6", (py, "-m", "pytest", "-q", "-n", "6" if cuda else "2", "-m", "not gpu and not network",
                                      "-p", "no:cacheprovider")),),
             "the CPU suite takes 6.6 min at -n 2 on 2 cores; 6 workers on the GPU host's cores, beside the "
             "device steps; stopped with its summary if it runs past the budget", background=True),
        Step("matrix", 60, 40, "each runner variant x scenario per preset, bf16 and fp16 first, then fp32, against "
                               "its expected verdict (as many rows as the limit lets each run write)",
             tuple(measure(f"{p} {d}", "matrix", f"matrix/{p}-{d}.jsonl", "--preset", p, "--dtype", d,
                           "--runs", str(work / "matrix" / "runs")) for p, d in MATRIX_RUNS),
             "H200 2026-12-04: 80 rows in the limit then given; each run writes its planted variants first"),
        Step("replay-check", 50, 30, "every planted bug's departure from eager on its own shape, a correct replay's "
                                     "bound and padding noise, per preset and dtype side by side (bf16 first)",
             tuple(Command(f"departures {p} {d}", (py, "scripts/departure_table.py", "--device", device, "--presets",
                                                   p, "--dtypes", d, "--out", str(work / f"replay-check/{p}-{d}.md")))
                   for p, d in DEPARTURE_RUNS),
             "estimated: 10 one-fixture runs per process, about 4 s each on a GPU"),
        # Real sizes without weights (shape presets, parity/models/shapes.py); --device cpu: their -scaled
        # variants. Each checks the device's free memory before building, and says what it skipped.
        Step("shapes", 80, 90, f"{shape} and {shape_moe} in bf16: build, capture of buckets 16 ... 8192 (time, "
                               "memory, the slot against its formula), replay vs eager per bucket, a correct replay's "
                               "noise at full depth",
             (measure("shapes", "shapes", "shapes/rows.jsonl"),),
             "estimated: a few seconds to draw 17 and 62 GB, 10 captures, per bucket 12 timed passes (3 from 2048)"),
        Step("shape-runs", 40, 40, f"`parity run --model {shape}` and `{shape_moe}`: the four arms at a released "
                                   "size, load, capture and each session timed",
             (run(shape, f"shape-runs/{shape}", "--model", shape, skip=refused),
              run(shape_moe, f"shape-runs/{shape_moe}", "--model", shape_moe, skip=refused)),
             "estimated: CUDA's start and the draw, about 10 s each, then 4 arms of 20 tokens", parallel=False),
        # Calls of their own (--only): the checkpoint writes 16 GiB, the noise sweep is the tiny presets'.
        Step("shape-checkpoint", 120, 45, f"{shape} saved as a checkpoint folder, then `parity run --model FOLDER` "
                                          "(the path a user's own checkpoint takes)",
             (Command("parity models save", (*parity, "models", "save", shape, str(checkpoint), "--device", device)),
              run("parity run --model FOLDER", "shape-checkpoint/run", "--model", str(checkpoint), skip=refused)),
             "estimated: 16 GiB written and read back at about 1 GB/s", parallel=False, default=False),
        Step("noise", 90, 30, "the noise of a correct replay of the tiny presets on this device (measure_noise.py, "
                              "one seed; its rows written as they are measured)",
             (Command("measure_noise.py", (py, "scripts/measure_noise.py", "--device", device, "--seeds", "0",
                                           "--skip-bugs", "--jsonl", str(work / "noise/comparisons.jsonl"))),),
             "estimated from the CPU: about a third of the CPU's time", default=False),
    ]


def schedule(plan: list[Step], device: str, chosen: set[str], scale: float = 1.0) -> list[Slot]:
    """Each chosen step at its full limit: the foreground ones back to back, a background one from
    where it starts. The call fits its budget when every slot ends by budget - RESERVE_S."""
    slots, at = [], 0.0
    for step in plan:
        if step.name not in chosen:
            continue
        limit = (step.limit_s if device == "cuda" else step.dry_limit_s) * scale
        slots.append(Slot(step, at, limit))
        if not step.background:
            at += limit
    return slots


def overruns(slots: list[Slot], budget: float) -> list[str]:
    """The steps whose slot ends past what the budget leaves them."""
    return [f"{s.step.name} ends at {s.end_s:.0f} s, past {budget - RESERVE_S:.0f} s (budget {budget:.0f} s less "
            f"{RESERVE_S:.0f} s to write the results)" for s in slots if s.end_s > budget - RESERVE_S + 1e-9]


# ---- running a step: a stop, then a kill


@dataclass
class _Running:
    command: Command
    process: subprocess.Popen
    handle: object
    log: Path
    started: float


def _default_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _start(name: str, command: Command, logs: Path, index: int) -> _Running:
    logs.mkdir(parents=True, exist_ok=True)
    log = logs / f"{name}-{index}.log"
    handle = log.open("w")
    # Its own group, so that a kill reaches its children too; Ctrl-C's default restored, since a shell
    # without job control starts a background job with SIGINT ignored, and Python then never raises
    # KeyboardInterrupt: the stop would do nothing and every cut would be a kill.
    process = subprocess.Popen(command.argv, cwd=ROOT, stdout=handle, stderr=subprocess.STDOUT,
                               start_new_session=True, preexec_fn=_default_sigint)
    return _Running(command, process, handle, log, time.monotonic())


def _signal_group(pid: int, signum: int) -> None:
    try:
        os.killpg(pid, signum)
    except (ProcessLookupError, PermissionError):
        pass


def _finish(running: _Running, deadline: float) -> Outcome:
    """Wait for a command until `deadline` (monotonic); past it less the grace, stop it as Ctrl-C
    does (its leader alone, so pytest stops its own workers and prints its summary), and kill its
    whole group at the deadline."""
    process, stopped = running.process, False
    grace = min(GRACE_S, max(0.0, deadline - running.started) / 3)
    try:
        code = process.wait(timeout=max(0.0, deadline - grace - time.monotonic()))
    except subprocess.TimeoutExpired:
        stopped = True
        try:
            process.send_signal(signal.SIGINT)
        except ProcessLookupError:
            pass
        try:
            code = process.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            code = None
    _signal_group(process.pid, signal.SIGKILL)  # what the leader left behind (workers, servers)
    if code is None:
        code = process.wait()
        status = "killed"
    elif stopped:
        status = "stopped"
    else:
        status = ("ok" if code in running.command.ok_exit else "skipped" if code in running.command.skip_exit
                  else "unexpected")
    running.handle.close()
    text = running.log.read_text(errors="replace")
    return Outcome(running.command.label, None if status == "killed" else code,
                   round(time.monotonic() - running.started, 1), status, "\n".join(text.strip().splitlines()[-15:]))


def run_step(step: Step, limit: float, logs: Path) -> StepResult:
    result = StepResult(step.name, step.what, limit)
    began = time.monotonic()
    batches = [step.commands] if step.parallel else [(c,) for c in step.commands]
    for batch in batches:
        running = [_start(step.name, c, logs, len(result.outcomes) + i) for i, c in enumerate(batch)]
        result.outcomes += [_finish(r, began + limit) for r in running]
    result.seconds = round(time.monotonic() - began, 1)
    return result


# ---- what the steps wrote, read back


def _rows(path: Path) -> list[dict]:
    if not path.exists():
        return []
    rows = []
    for line in path.read_text(errors="replace").splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:  # the last line of a file whose writer was killed
            pass
    return rows


def run_figures(doc: dict) -> dict:
    """One results file's verdicts, where it ran, its timings, its peak GPU memory and its noise."""
    environment, config = doc.get("environment", {}), doc.get("config", {})
    arms = [arm for case in doc.get("cases", []) for group in (case, *case.get("requests", ()))
            for arm in (group.get("arms") or {}).values()]  # a sequence's arms are its requests'
    checks = [arm["evidence"]["replay_check"] for arm in arms if (arm.get("evidence") or {}).get("replay_check")]
    tensors = [t for check in checks for t in check["tensors"].values()]
    return {
        "verdict": doc["verdict"]["code"], "interrupted": bool(doc.get("interrupted")),
        "cases": dict(Counter(f"{c['scenario']} {c['verdict']['code']}" for c in doc.get("cases", []))),
        "graph_backend": config.get("graph_backend"), "dtype": config.get("dtype"), "model": config.get("model"),
        "device": environment.get("device"), "gpu": environment.get("gpu"),
        "gpu_peak_bytes": environment.get("gpu_peak_bytes"), "timings": doc.get("timings") or {},
        # A planted variant's departure is its bug, not noise: only a correct runner's checks are noise.
        "noise": {"checked": 0} if config.get("runner") != "fixed" else {
                  "checked": len(checks), "delta": max((t[0] for t in tensors), default=None),
                  "bound": max((t[1] for t in tensors), default=None),
                  "padding": max((c.get("padding_noise") or 0.0 for c in checks), default=None)},
    }


def _results(folder: Path) -> dict[str, dict]:
    found = {}
    for path in sorted(folder.rglob("results.json")) if folder.exists() else ():
        try:
            found[str(path.parent.relative_to(folder))] = run_figures(json.loads(path.read_text()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
            found[str(path.parent.relative_to(folder))] = {"error": f"{err.__class__.__name__}: {err}"}
    return found


def _step_figures(runs: dict[str, dict]) -> dict:
    """What a step's results files say together."""
    good = [r for r in runs.values() if "error" not in r]
    timings = {k: round(sum((r["timings"].get(k) or 0.0) for r in good), 2)
               for k in ("load_s", "capture_s", "eager_s", "bcg_s")} if good else {}
    peaks = [r["gpu_peak_bytes"] for r in good if r.get("gpu_peak_bytes") is not None]
    noise = [r["noise"] for r in good if r["noise"]["checked"]]
    return {
        "verdicts": dict(Counter(r["verdict"] + (" (interrupted)" if r["interrupted"] else "") for r in good)),
        "ran_on": sorted({f"{r['graph_backend']} graph · {r['gpu'] or r['device']}" for r in good}),
        "timings": timings, "gpu_peak_bytes": max(peaks) if peaks else None,
        "noise": {"checked": sum(n["checked"] for n in noise), "delta": max((n["delta"] for n in noise), default=None),
                  "bound": max((n["bound"] for n in noise), default=None),
                  "padding": max((n["padding"] for n in noise), default=None)} if noise else None,
    }


def _tables(work: Path, results: list[StepResult]) -> dict:
    """What the steps measured, read back from their files."""
    runs = {r.name: _results(work / r.name) for r in results}
    return {
        "figures": {name: _step_figures(found) for name, found in runs.items()},
        "defaults": runs.get("defaults", {}), "scenario_all": runs.get("scenario-all", {}),
        "shape_runs": {**runs.get("shape-runs", {}), **runs.get("shape-checkpoint", {})},
        "matrix": [row for path in sorted((work / "matrix").glob("*.jsonl")) for row in _rows(path)],
        "departures": [line for path in sorted((work / "replay-check").glob("*.md"))
                       for line in path.read_text().splitlines()[2:]],
        "shapes": _rows(work / "shapes/rows.jsonl"),
        "noise": _rows(work / "noise/comparisons.jsonl"),
    }


# ---- summary.md: the one page


def _pytest_line(tail: str) -> str:
    found = re.findall(r"^=*\s*(\d+ (?:passed|failed|skipped|error|deselected).*?)\s*=*$", tail, re.MULTILINE)
    return found[-1] if found else ""


def _gib(count: int | None) -> str:
    return "—" if count is None else f"{count / 2**30:.2f} GiB"


def _mib(count: int | None) -> str:
    return "—" if count is None else f"{count / 2**20:.1f}"


def _num(value) -> str:
    return "—" if value is None else f"{value:.3g}" if isinstance(value, float) else str(value)


def _verdicts(figures: dict | None) -> str:
    return ", ".join(f"{code} ×{n}" for code, n in sorted(figures["verdicts"].items())) if figures else ""


def _phases(figures: dict | None) -> str:
    t = (figures or {}).get("timings") or {}
    return " / ".join(_num(t.get(k)) for k in ("load_s", "capture_s", "eager_s", "bcg_s")) if t else "—"


def _noise(figures: dict | None) -> str:
    n = (figures or {}).get("noise")
    return "—" if not n else (f"Δ {_num(n['delta'])} ≤ {_num(n['bound'])}, padding {_num(n['padding'])} "
                              f"({n['checked']} checks)")


def _said(result: StepResult, figures: dict | None, tables: dict) -> str:
    """The step's verdicts in a few words."""
    if result.name == "matrix" and tables["matrix"]:
        ok = sum(r["ok"] for r in tables["matrix"])
        return f"{ok} of {len(tables['matrix'])} rows as expected"
    lines = [line for line in (_pytest_line(o.tail) for o in result.outcomes) if line]
    skipped = [f"{o.label}: {o.tail.splitlines()[-1] if o.tail else 'refused'}" for o in result.outcomes
               if o.status == "skipped"]
    skipped += [f"{r['preset']}: {r['reason']}" for r in tables["shapes"] if r.get("what") == "skipped"
                and result.name == "shapes"]
    return "; ".join(filter(None, (_verdicts(figures), *lines, *(f"skipped {s}" for s in skipped))))


def _markdown(header: str, results: list[StepResult], tables: dict, reference: dict, left_out: list) -> str:
    ref_steps = reference.get("figures", {})
    lines = [f"# parity GPU check\n\n{header}\n",
             f"Graph: {', '.join(sorted({x for f in tables['figures'].values() for x in f['ran_on']})) or '—'}. "
             f"Each step's phases are load / capture / eager session / graph session, in seconds, summed over its "
             f"runs; noise is the replay check's largest departure against its bound, and the padding noise. "
             f"CPU: {reference.get('measured', 'no reference run')} (docs/measurements/gpu-check-cpu.json).\n",
             "| step | outcome | took s (limit) | verdicts | ran on | phases s | peak GPU | noise | CPU: verdicts · phases |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        f, ref = tables["figures"].get(r.name), ref_steps.get(r.name)
        outcome = r.status + (f" ({', '.join(f'{o.label}: {o.status}' for o in r.outcomes if o.status != 'ok')})"
                              if r.status not in ("pass", "not reached") else "")
        ref_text = (f"{_verdicts(ref) or '—'} · {_phases(ref)}" if ref else "—")
        lines.append(f"| {r.name} | {outcome} | {r.seconds} ({r.limit_s:.0f}) | {_said(r, f, tables) or '—'} | "
                     f"{', '.join(f['ran_on']) if f else '—'} | {_phases(f)} | "
                     f"{_gib(f['gpu_peak_bytes']) if f else '—'} | {_noise(f)} | {ref_text} |")
    lines += _scenario_table(tables["scenario_all"], reference.get("scenario_all", {}))
    if tables["defaults"]:
        lines += ["\n## The default command, where the time goes (s)\n",
                  "| run | verdict | ran on | load | capture | eager session | graph session | total |",
                  "|---|---|---|---|---|---|---|---|"]
        for name, d in tables["defaults"].items():
            if "error" not in d:
                t = d["timings"]
                lines.append(f"| {name} | {d['verdict']} | {d['graph_backend']} graph · {d['gpu'] or d['device']} | "
                             f"{_num(t.get('load_s'))} | {_num(t.get('capture_s'))} | {_num(t.get('eager_s'))} | "
                             f"{_num(t.get('bcg_s'))} | {_num(t.get('total_s'))} |")
    if tables["matrix"]:
        bad = [r for r in tables["matrix"] if not r["ok"]]
        lines += [f"\n## Verdict matrix: {len(tables['matrix']) - len(bad)} of {len(tables['matrix'])} as expected "
                  f"(rows per run: {_matrix_counts(tables['matrix'])})\n"]
        if bad:
            lines += ["| preset | dtype | runner | scenario | expected | got | bcg vs eager |", "|---|---|---|---|---|---|---|"]
            lines += [f"| {r['preset']} | {r['dtype']} | {r['runner']} | {r['scenario']} | {r['expected']} | {r['got']} | "
                      f"{r['graph_vs_eager']} |" for r in bad]
    if tables["departures"]:
        lines += ["\n## The replay check: each planted bug's departure, a correct replay's bound\n",
                  "| preset | dtype | runner | scenario | verdict | first departure | Δ | bound |",
                  "|---|---|---|---|---|---|---|---|", *tables["departures"]]
    lines += _shape_tables(tables)
    lines += _noise_table(tables["noise"])
    if left_out:
        lines += [f"\n## Not in runs.tar.gz ({len(left_out)} file(s))\n",
                  *(f"- `{path}`: {size / 2**20:.1f} MiB, {why}" for path, size, why in left_out[:20])]
        if len(left_out) > 20:
            lines.append(f"- … and {len(left_out) - 20} more")
    return "\n".join(lines) + "\n"


def _matrix_counts(rows: list[dict]) -> str:
    return ", ".join(f"{p} {d} {n}" for (p, d), n in Counter((r["preset"], r["dtype"]) for r in rows).items())


def _scenario_table(runs: dict, reference: dict) -> list[str]:
    """Rows: preset and dtype; columns: scenarios; each cell the cases' verdicts, the CPU's beside
    where they differ."""
    if not any("error" not in r for r in runs.values()):
        return []
    scenarios = list(dict.fromkeys(key.split(" ", 1)[0] for r in runs.values() if "error" not in r
                                   for key in r["cases"]))

    def cell(r: dict | None, scenario: str) -> str:
        found = {k.split(" ", 1)[1]: n for k, n in (r or {}).get("cases", {}).items() if k.split(" ", 1)[0] == scenario}
        return ", ".join(f"{code} {n}" for code, n in sorted(found.items())) or "—"

    lines = ["\n## --scenario all --fixture all: each scenario's cases (the CPU's where they differ)\n",
             f"| run | verdict | {' | '.join(scenarios)} |", "|---|---|" + "---|" * len(scenarios)]
    for name, r in runs.items():
        if "error" in r:
            lines.append(f"| {name} | {r['error']} |" + " |" * len(scenarios))
            continue
        cells = []
        for scenario in scenarios:
            here, cpu = cell(r, scenario), cell(reference.get(name), scenario)
            cells.append(here if name not in reference or cpu == here else f"{here} (cpu: {cpu})")
        lines.append(f"| {name} | {r['verdict']}{' (interrupted)' if r['interrupted'] else ''} | {' | '.join(cells)} |")
    return lines


def _shape_tables(tables: dict) -> list[str]:
    lines = []
    built = [r for r in tables["shapes"] if r.get("what") in ("build", "error", "skipped")]
    if built:
        lines += ["\n## Shape presets (bf16): build, capture, memory\n",
                  "| preset | built s | weights (formula) | capture s | graphs' peak | slot MiB (formula) | error or skip |",
                  "|---|---|---|---|---|---|---|"]
        lines += [f"| {r['preset']} | {_num(r.get('build_s'))} | {_gib(r.get('weights_bytes'))} "
                  f"({_gib(r.get('weights_formula_bytes'))}) | {_num(r.get('capture_s'))} | "
                  f"{_gib(r.get('capture_peak_bytes'))} | {_mib(r.get('slot_bytes'))} ({_mib(r.get('slot_formula_bytes'))}) "
                  f"| {r.get('error') or r.get('reason') or ''} |" for r in built]
    buckets = [r for r in tables["shapes"] if r.get("what") == "bucket"]
    if buckets:
        lines += ["\n## Shape presets: replay vs eager per bucket, a correct replay's noise (bf16)\n",
                  "| preset | bucket | eager ms | replay ms | speed-up | vs padded eager | padded eager's repeat | vs eager |",
                  "|---|---|---|---|---|---|---|---|"]
        lines += [f"| {r['preset']} | {r['bucket']} | {r['eager_ms']:.3f} | {r['replay_ms']:.3f} | {r['speedup']:.2f}× | "
                  f"{r['vs_padded_eager_max_abs']:.3g} | {r['padded_eager_repeat_max_abs']:.3g} | "
                  f"{r['vs_unpadded_eager_max_abs']:.3g} |" for r in buckets]
    if tables["shape_runs"]:
        lines += ["\n## Shape presets: the four arms (s)\n",
                  "| run | verdict | ran on | load | capture | eager session | graph session | peak GPU |",
                  "|---|---|---|---|---|---|---|---|"]
        for name, r in tables["shape_runs"].items():
            if "error" not in r:
                t = r["timings"]
                lines.append(f"| {name} | {r['verdict']} | {r['graph_backend']} graph · {r['gpu'] or r['device']} | "
                             f"{_num(t.get('load_s'))} | {_num(t.get('capture_s'))} | {_num(t.get('eager_s'))} | "
                             f"{_num(t.get('bcg_s'))} | {_gib(r['gpu_peak_bytes'])} |")
    return lines


def _noise_table(rows: list[dict]) -> list[str]:
    """measure_noise.py's comparisons: per preset and dtype, how many matched and their largest |Δ|."""
    if not rows:
        return []
    groups: dict[tuple, list[dict]] = {}
    for row in rows:
        groups.setdefault((row["preset"], row["dtype"]), []).append(row)
    lines = ["\n## The tiny presets' noise (a correct runner, must-match comparisons)\n",
             "| preset | dtype | comparisons | token flips | largest |Δ logprob| | largest mean |", "|---|---|---|---|---|---|"]
    for (preset, dtype), found in groups.items():
        matched = [r for r in found if r["kind"] == "match"]
        lines.append(f"| {preset} | {dtype} | {len(found)} | {len(found) - len(matched)} | "
                     f"{_num(max((r['max'] for r in matched), default=None))} | "
                     f"{_num(max((r['mean'] for r in matched), default=None))} |")
    return lines


# ---- $OUT


def archive_plan(work: Path, order: list[str], cap: int = ARCHIVE_CAP
                 ) -> tuple[list[Path], list[tuple[str, int, str]]]:
    """(files to pack, (path, size, why) of the files left out): results, reports, summaries and
    JSON lines only, each and all together within their caps; the steps' files in `order` (their
    folders' names), the smallest first within a step."""
    packed, left_out, total = [], [], 0
    found = [(p, p.stat().st_size) for p in work.rglob("*") if p.is_file() and not p.is_symlink()
             and p.suffix != ".log"]  # the logs are in log.txt

    def rank(item: tuple[Path, int]) -> tuple:
        top = item[0].relative_to(work).parts[0]
        return (order.index(top) if top in order else len(order), item[1], str(item[0]))

    for path, size in sorted(found, key=rank):
        name = str(path.relative_to(work))
        if path.suffix not in ARCHIVE_SUFFIXES:
            left_out.append((name, size, "not a results file, report, summary or log"))
        elif size > ARCHIVE_FILE_CAP:
            left_out.append((name, size, f"over the {ARCHIVE_FILE_CAP // 2**20} MiB a packed file may have"))
        elif total + size > cap:
            left_out.append((name, size, f"the archive's {cap / 2**20:g} MiB were full"))
        else:
            packed.append(path)
            total += size
    return packed, left_out


def pack(work: Path, order: list[str], target: Path) -> list[tuple[str, int, str]]:
    """runs.tar.gz at `target`, replaced whole, within ARCHIVE_RETURN_CAP; the files left out."""
    cap = ARCHIVE_CAP
    while True:
        packed, left_out = archive_plan(work, order, cap)
        partial = target.with_name(target.name + ".partial")
        with tarfile.open(partial, "w:gz") as tar:
            for path in packed:
                tar.add(path, arcname=f"gpu-check/{path.relative_to(work)}", recursive=False)
        if partial.stat().st_size <= ARCHIVE_RETURN_CAP or cap < 2**20:
            os.replace(partial, target)
            return left_out
        cap //= 2


def _log_text(path: Path) -> str:
    with path.open("rb") as f:
        size = f.seek(0, os.SEEK_END)
        if size <= LOG_HEAD + LOG_TAIL:
            f.seek(0)
            return f.read().decode(errors="replace")
        f.seek(0)
        head = f.read(LOG_HEAD).decode(errors="replace")
        f.seek(size - LOG_TAIL)
        tail = f.read().decode(errors="replace")
    return f"{head}\n[... {size - LOG_HEAD - LOG_TAIL} bytes of this log left out ...]\n{tail}"


def _write(out: Path, work: Path, header: str, results: list[StepResult], reference: dict) -> None:
    """Everything so far, again: a call cut after this still returns it."""
    tables = _tables(work, results)
    left_out = pack(work, [r.name for r in results], out / "runs.tar.gz")
    (out / "summary.json").write_text(json.dumps({"header": header, "steps": [asdict(r) for r in results],
                                                  "left_out": left_out, **tables}, indent=1))
    (out / "summary.md").write_text(_markdown(header, results, tables, reference, left_out))
    logs = sorted((work / "logs").glob("*.log"))
    (out / "log.txt").write_text("".join(f"===== {p.stem}\n{_log_text(p)}\n" for p in logs))


def _header(device: str, budget: float) -> str:
    probe = ("import torch, transformers, platform; "
             "print('python', platform.python_version(), '· torch', torch.__version__, '· transformers', "
             "transformers.__version__, '·', (torch.cuda.get_device_name() + ' ' + "
             "str(round(torch.cuda.mem_get_info()[1] / 2**30)) + ' GiB') if torch.cuda.is_available() else 'no CUDA')")
    found = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=ROOT)
    return (f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} · --device {device} · budget {budget:.0f} s · "
            f"{found.stdout.strip() or found.stderr.strip()[-200:]}")


def _report(result: StepResult) -> None:
    for outcome in result.outcomes:
        print(f"   {result.name} · {outcome.label}: {outcome.status} (exit {outcome.exit_code}, {outcome.seconds} s)",
              flush=True)


def _reference(path: Path | None) -> dict:
    try:
        return json.loads(path.read_text()) if path is not None else {}
    except (OSError, ValueError):
        return {}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "gpu-check-out")))
    parser.add_argument("--budget", type=float, default=BUDGET_S, help="seconds for every step together (8 min)")
    parser.add_argument("--only", help="comma list of step names to run (the others are listed as not reached); "
                                       "shape-checkpoint and noise run only when named")
    parser.add_argument("--limit-scale", type=float, default=1.0, help="every step's limit times this")
    parser.add_argument("--write-reference", type=Path, help="also write the steps' figures here (a CPU reference)")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="gpu-check-"))
    scratch = Path(tempfile.mkdtemp(prefix="gpu-check-checkpoints-"))
    plan = steps(args.device, work, scratch)
    names = {s.name for s in plan}
    chosen = set(args.only.split(",")) if args.only else {s.name for s in plan if s.default}
    if chosen - names:
        parser.error(f"--only: no step {', '.join(sorted(chosen - names))} (steps: {', '.join(s.name for s in plan)})")
    slots = schedule(plan, args.device, chosen, args.limit_scale)
    for problem in overruns(slots, args.budget):  # a smaller --budget cuts the steps at its end, saying so
        print(f"note: {problem}; the step is cut at the budget's end", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    header = _header(args.device, args.budget)
    print(header, flush=True)
    reference = _reference(REFERENCE if args.device == "cuda" else None)
    began = time.monotonic()
    results = [StepResult(s.name, s.what, 0.0, [Outcome(c.label) for c in s.commands]) for s in plan if s.name in chosen]
    background: dict[int, tuple[list[_Running], float]] = {}  # result index -> (its commands, its deadline)

    def write() -> None:
        _write(args.out, work, header, results, reference)

    def collect(wait: bool) -> None:
        for i, (running, deadline) in list(background.items()):
            if wait or all(r.process.poll() is not None for r in running):
                results[i].outcomes = [_finish(r, deadline) for r in running]
                results[i].seconds = round(time.monotonic() - running[0].started, 1)
                _report(results[i])
                del background[i]
                write()

    try:
        for i, slot in enumerate(slots):
            collect(wait=False)
            step = slot.step
            left = args.budget - RESERVE_S - (time.monotonic() - began)
            if left < 3:
                continue
            limit = min(slot.limit_s, left)
            print(f"== {step.name} (limit {limit:.0f} s): {step.what}{' (in the background)' if step.background else ''}",
                  flush=True)
            results[i].limit_s = limit
            if step.background:
                background[i] = ([_start(step.name, c, work / "logs", k) for k, c in enumerate(step.commands)],
                                 time.monotonic() + limit)
                continue
            results[i] = run_step(step, limit, work / "logs")
            _report(results[i])
            write()
        collect(wait=True)
        write()
        if args.write_reference is not None:
            tables = _tables(work, results)
            args.write_reference.write_text(json.dumps(
                {"measured": f"{header.split(' · budget')[0]} (this script, --limit-scale {args.limit_scale:g})",
                 "figures": tables["figures"], "scenario_all": tables["scenario_all"]}, indent=1) + "\n")
    finally:
        shutil.rmtree(scratch, ignore_errors=True)  # a checkpoint of 16 GiB never outlives the call
    trouble = [o for r in results for o in r.outcomes if o.status in ("unexpected", "stopped", "killed")]
    print(f"done in {time.monotonic() - began:.0f} s; {len(trouble)} command(s) unexpected or cut; "
          f"{args.out / 'summary.md'}", flush=True)


if __name__ == "__main__":
    main()
