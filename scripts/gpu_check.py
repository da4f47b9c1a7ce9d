"""Every GPU check in one call, in order of value, inside one time budget (scripts/gpu_check.sh).

Each step runs its commands (in parallel where they are independent) under its own time limit, cut
to what is left of the budget; a step not reached, or cut, says so. After every step the results
are written again under --out, so a call cut short still returns what it did, in four files:

    summary.md   what each step gave, its tables (verdict matrix, departures, shape presets' timings and memory)
    summary.json the same as data
    log.txt      every command's output
    runs.tar.gz  every results.json, report.md and JSON lines file the steps wrote

    python scripts/gpu_check.py [--device cuda|cpu] [--out DIR] [--budget 480] [--only STEP,...]

`--device cpu` is the dry run: the same steps on the emulated graph, on this machine's CPUs,
each under a shorter limit so that every step starts (and the slow ones are cut) within the budget.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEEPSTACK_PRESETS = ("tiny-qwen3-vl", "tiny-qwen3-vl-moe")
MATRIX_PRESETS = (*DEEPSTACK_PRESETS, "tiny-qwen3-vl-nodeepstack")
MATRIX_DTYPES = ("float32", "bfloat16")
# The replay check judges reduced precision as fp32 (design §6): every planted bug in fp16 too.
MATRIX_RUNS = tuple((p, d) for p in MATRIX_PRESETS for d in MATRIX_DTYPES) + tuple(
    (p, "float16") for p in DEEPSTACK_PRESETS)


@dataclass(frozen=True)
class Command:
    label: str
    argv: tuple[str, ...]
    ok_exit: tuple[int, ...] = (0,)  # the exit codes that mean "as expected"


@dataclass(frozen=True)
class Step:
    name: str
    limit_s: float
    what: str
    commands: tuple[Command, ...]
    parallel: bool = True  # False: one after another (timings that must not share the machine)
    dry_limit_s: float = 30  # with --device cpu: every step started and cut, within the same budget
    # Started, then left running while the next steps run (the suite: CPU work on the host's cores
    # while the device steps use the GPU); collected when done, or cut at its limit or the budget's end.
    background: bool = False


@dataclass
class Outcome:
    label: str
    exit_code: int | None = None  # None: cut by the time limit, or never started
    seconds: float = 0.0
    status: str = "not reached"  # ok | unexpected | cut | not reached
    tail: str = ""


@dataclass
class StepResult:
    name: str
    what: str
    limit_s: float
    outcomes: list[Outcome] = field(default_factory=list)
    seconds: float = 0.0


def steps(device: str, work: Path) -> list[Step]:
    """The checks in order of value: the user's command, the crash this machine found, the verdict
    matrix, the GPU tests, the whole suite, then the measurements."""
    py, parity = sys.executable, (sys.executable, "-m", "parity")

    def run(label: str, out: str, *args: str, ok=(0,)) -> Command:
        return Command(label, (*parity, "run", "--device", device, "--no-plot", "--out", str(work / out), *args), ok)

    def measure(label: str, what: str, out: str, *args: str) -> Command:
        return Command(label, (py, "scripts/gpu_measure.py", what, "--device", device, "--out", str(work / out), *args))

    xdist = "12" if device == "cuda" else "2"  # on the GPU host, cores left for the device steps beside it
    shape, shape_moe = (("shape-qwen3-vl-8b", "shape-qwen3-vl-30b-a3b") if device == "cuda" else
                        ("shape-qwen3-vl-8b-scaled", "shape-qwen3-vl-30b-a3b-scaled"))
    checkpoint = work / "shape-checkpoint" / shape
    # Limits sized from the H200 run of 2026-12-04 (docs/gpu.md): the user's command 24 s, the MoE
    # --scenario all --fixture all 92 s, the suite about 200 s at -n 16. Expected together about 480 s
    # with the suite beside the device steps; the last step (the tiny presets' noise, which the shapes
    # step measures at full size) is the first cut.
    return [
        Step("defaults", 60, "`parity run` as a user types it, on this device and on this host's CPU (PASS, exit 0)",
             (run("parity run", "defaults/device"),
              Command("parity run --device cpu", (*parity, "run", "--device", "cpu", "--no-plot", "--out",
                                                  str(work / "defaults/cpu")))), parallel=False),
        Step("scenario-all", 100, "`--scenario all --fixture all` in one process per DeepStack preset and dtype (PASS)",
             tuple(run(f"{p} {d}", f"scenario-all/{p}-{d}", "--model", p, "--dtype", d, "--scenario", "all",
                       "--fixture", "all") for p in DEEPSTACK_PRESETS for d in MATRIX_DTYPES), dry_limit_s=60),
        Step("pytest-gpu", 45, "the tests marked gpu (real torch.cuda.CUDAGraph)",
             (Command("pytest -m gpu", (py, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider", "-rs")),)),
        Step("suite", 300, f"the whole suite on this host (pytest -n {xdist}), beside the steps after it",
             (Command(f"pytest -n {xdist}", (py, "-m", "pytest", "-q", "-n", xdist, "-p", "no:cacheprovider")),),
             dry_limit_s=120, background=True),
        Step("replay-check", 45, "every planted bug's departure from eager on its own shape, and a correct "
                                 "replay's bound and padding noise on this device (departure_table.py)",
             (Command("departure_table.py", (py, "scripts/departure_table.py", "--device", device,
                                             "--out", str(work / "replay-check/table.md"))),)),
        Step("matrix", 45, "each runner variant x scenario x preset x dtype (fp32, bf16, fp16) against its expected "
                           "verdict, the same in every dtype (its rows as far as the limit lets it)",
             tuple(measure(f"{p} {d}", "matrix", f"matrix/{p}-{d}.jsonl", "--preset", p, "--dtype", d,
                           "--runs", str(work / "matrix" / "runs")) for p, d in MATRIX_RUNS),
             dry_limit_s=40),
        # Real sizes without weights (shape presets, parity/models/shapes.py); --device cpu: their -scaled
        # variants. It replaces the tiny presets' replay timings and slot memory: at tiny size a GPU
        # measures overheads only.
        Step("shapes", 110, f"{shape} and {shape_moe} in bf16: build, capture of buckets 16 ... 8192 (time, "
                            "memory, the slot against its formula), replay vs eager per bucket, a correct replay's "
                            "noise at full depth",
             (measure("shapes", "shapes", "shapes/rows.jsonl"),), dry_limit_s=90),  # the scaled ones to the end
        Step("shape-runs", 70, f"`parity run --model {shape}` and `{shape_moe}`: the four arms at a released size, "
                               "load, capture and each session timed",
             (run(shape, f"shape-runs/{shape}", "--model", shape),
              run(shape_moe, f"shape-runs/{shape_moe}", "--model", shape_moe)), parallel=False, dry_limit_s=40),
        Step("shape-checkpoint", 90, f"{shape} saved as a checkpoint folder, then `parity run --model FOLDER` "
                                     "(the path a user's own checkpoint takes)",
             (Command("parity models save", (*parity, "models", "save", shape, str(checkpoint), "--device", device)),
              run("parity run --model FOLDER", "shape-checkpoint/run", "--model", str(checkpoint))),
             parallel=False, dry_limit_s=45),
        Step("noise", 40, "the noise of a correct replay of the tiny presets on this device (measure_noise.py, one seed)",
             (Command("measure_noise.py", (py, "scripts/measure_noise.py", "--device", device, "--seeds", "0",
                                           "--skip-bugs", "--jsonl", str(work / "noise/comparisons.jsonl"))),),
             dry_limit_s=20),
    ]


@dataclass
class _Running:
    command: Command
    process: subprocess.Popen
    handle: object
    log: Path
    started: float


def _start(name: str, command: Command, logs: Path, index: int) -> _Running:
    logs.mkdir(parents=True, exist_ok=True)
    log = logs / f"{name}-{index}.log"
    handle = log.open("w")
    process = subprocess.Popen(command.argv, cwd=ROOT, stdout=handle, stderr=subprocess.STDOUT,
                               start_new_session=True)  # its own group: a cut stops its children too
    return _Running(command, process, handle, log, time.monotonic())


def _finish(running: _Running, deadline: float) -> Outcome:
    """Wait for a command until `deadline` (monotonic), then cut it."""
    try:
        code = running.process.wait(timeout=max(0.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        os.killpg(running.process.pid, signal.SIGKILL)
        running.process.wait()
        code = None
    running.handle.close()
    text = running.log.read_text(errors="replace")
    status = "cut" if code is None else "ok" if code in running.command.ok_exit else "unexpected"
    return Outcome(running.command.label, code, round(time.monotonic() - running.started, 1), status,
                   "\n".join(text.strip().splitlines()[-15:]))


def _run_step(step: Step, limit: float, logs: Path) -> StepResult:
    result = StepResult(step.name, step.what, limit)
    began = time.monotonic()
    batches = [step.commands] if step.parallel else [(c,) for c in step.commands]
    for batch in batches:
        running = [_start(step.name, c, logs, len(result.outcomes) + i) for i, c in enumerate(batch)]
        result.outcomes += [_finish(r, began + limit) for r in running]
    result.seconds = round(time.monotonic() - began, 1)
    return result


def _rows(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _tables(work: Path, results: list[StepResult]) -> dict:
    """What the steps measured, read back from their files."""
    defaults = {}
    walls = {o.label: o.seconds for r in results if r.name == "defaults" for o in r.outcomes}
    for name, label in (("device", "parity run"), ("cpu", "parity run --device cpu")):
        found = work / "defaults" / name / "results.json"
        if found.exists():
            doc = json.loads(found.read_text())
            defaults[name] = {"verdict": doc["verdict"]["code"], "timings": doc.get("timings"), "wall_s": walls.get(label),
                              "device": doc["environment"].get("device"), "gpu": doc["environment"].get("gpu")}
    matrix = [row for path in sorted((work / "matrix").glob("*.jsonl")) for row in _rows(path)]
    departures = work / "replay-check/table.md"
    shape_runs = {}
    for found in sorted([*(work / "shape-runs").glob("*/results.json"), *(work / "shape-checkpoint").glob("*/results.json")]):
        doc = json.loads(found.read_text())
        shape_runs[f"{found.parent.parent.name}/{found.parent.name}"] = {"model": doc["config"]["model"], "verdict": doc["verdict"]["code"],
                                         "timings": doc.get("timings")}
    return {"defaults": defaults, "matrix": matrix, "shapes": _rows(work / "shapes/rows.jsonl"),
            "shape_runs": shape_runs, "departures": departures.read_text() if departures.exists() else ""}


def _pytest_line(tail: str) -> str:
    found = re.findall(r"^=*\s*(\d+ (?:passed|failed|skipped|error).*?)\s*=*$", tail, re.MULTILINE)
    return found[-1] if found else ""


def _markdown(header: str, results: list[StepResult], tables: dict) -> str:
    lines = [f"# parity GPU check\n\n{header}\n", "| step | what | limit s | took s | commands |", "|---|---|---|---|---|"]
    for r in results:
        outcomes = "; ".join(f"{o.label}: {o.status}" + (f" (exit {o.exit_code})" if o.exit_code is not None else "")
                             + (f", {_pytest_line(o.tail)}" if _pytest_line(o.tail) else "") for o in r.outcomes)
        lines.append(f"| {r.name} | {r.what} | {r.limit_s:.0f} | {r.seconds} | {outcomes or 'not reached'} |")
    if tables["defaults"]:
        lines += ["\n## The default command, where the time goes (s)\n",
                  "| device | verdict | process wall | load | capture | eager session | graph session | run total |",
                  "|---|---|---|---|---|---|---|---|"]
        for name, d in tables["defaults"].items():
            t = d["timings"] or {}
            lines.append(f"| {d['device']} | {d['verdict']} | {d['wall_s']} | {t.get('load_s')} | {t.get('capture_s')} | "
                         f"{t.get('eager_s')} | {t.get('bcg_s')} | {t.get('total_s')} |")
    if tables["matrix"]:
        bad = [r for r in tables["matrix"] if not r["ok"]]
        lines += [f"\n## Verdict matrix: {len(tables['matrix']) - len(bad)} of {len(tables['matrix'])} as expected\n",
                  "| preset | dtype | runner | scenario | expected | got | ok | bcg vs eager | s |",
                  "|---|---|---|---|---|---|---|---|---|"]
        lines += [f"| {r['preset']} | {r['dtype']} | {r['runner']} | {r['scenario']} | {r['expected']} | {r['got']} | "
                  f"{'✅' if r['ok'] else '❌'} | {r['graph_vs_eager']} | {r['seconds']} |" for r in tables["matrix"]]
    if tables["departures"]:
        lines += ["\n## The replay check: each planted bug's departure, a correct replay's bound\n",
                  tables["departures"]]
    built = [r for r in tables["shapes"] if r.get("what") in ("build", "error")]
    if built:
        lines += ["\n## Shape presets (bf16): build, capture, memory\n",
                  "| preset | built s | weights GiB (formula) | capture s | graphs' peak GiB | slot MiB (formula) | error |",
                  "|---|---|---|---|---|---|---|"]
        lines += [f"| {r['preset']} | {r.get('build_s')} | {_gib(r.get('weights_bytes'))} ({_gib(r.get('weights_formula_bytes'))}) | "
                  f"{r.get('capture_s')} | {_gib(r.get('capture_peak_bytes'))} | {_mib(r.get('slot_bytes'))} "
                  f"({_mib(r.get('slot_formula_bytes'))}) | {r.get('error', '')} |" for r in built]
    buckets = [r for r in tables["shapes"] if r.get("what") == "bucket"]
    if buckets:
        lines += ["\n## Shape presets: replay vs eager per bucket, a correct replay's noise (bf16)\n",
                  "| preset | bucket | eager ms | replay ms | speed-up | vs padded eager | padded eager's repeat | vs eager | hidden rms |",
                  "|---|---|---|---|---|---|---|---|---|"]
        lines += [f"| {r['preset']} | {r['bucket']} | {r['eager_ms']:.3f} | {r['replay_ms']:.3f} | {r['speedup']:.2f}× | "
                  f"{r['vs_padded_eager_max_abs']:.3g} | {r['padded_eager_repeat_max_abs']:.3g} | "
                  f"{r['vs_unpadded_eager_max_abs']:.3g} | {r['hidden_rms']:.3g} |"
                  for r in buckets]
    if tables["shape_runs"]:
        lines += ["\n## Shape presets: the four arms (s)\n",
                  "| run | model | verdict | load | capture | eager session | graph session | total |", "|---|---|---|---|---|---|---|---|"]
        for name, r in tables["shape_runs"].items():
            t = r["timings"] or {}
            lines.append(f"| {name} | {r['model']} | {r['verdict']} | {t.get('load_s')} | {t.get('capture_s')} | "
                         f"{t.get('eager_s')} | {t.get('bcg_s')} | {t.get('total_s')} |")
    return "\n".join(lines) + "\n"


def _gib(count: int | None) -> str:
    return "—" if count is None else f"{count / 2**30:.2f}"


def _mib(count: int | None) -> str:
    return "—" if count is None else f"{count / 2**20:.1f}"


def _write(out: Path, work: Path, header: str, results: list[StepResult]) -> None:
    """Everything so far, again: a call cut after this still returns it."""
    tables = _tables(work, results)
    (out / "summary.json").write_text(json.dumps({"header": header, "steps": [asdict(r) for r in results],
                                                  **tables}, indent=1))
    (out / "summary.md").write_text(_markdown(header, results, tables))
    logs = sorted((work / "logs").glob("*.log"))
    (out / "log.txt").write_text("".join(f"===== {p.stem}\n{p.read_text(errors='replace')}\n" for p in logs))
    with tarfile.open(out / "runs.tar.gz.partial", "w:gz") as tar:
        tar.add(work, arcname="gpu-check", filter=lambda info: None if info.name.endswith(".log") else info)
    os.replace(out / "runs.tar.gz.partial", out / "runs.tar.gz")


def _header(device: str) -> str:
    probe = ("import torch, transformers, platform; "
             "print('python', platform.python_version(), '· torch', torch.__version__, '· transformers', "
             "transformers.__version__, '·', torch.cuda.get_device_name() if torch.cuda.is_available() else 'no CUDA')")
    found = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=ROOT)
    return f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} · --device {device} · {found.stdout.strip()}"


def _report(result: StepResult) -> None:
    for outcome in result.outcomes:
        print(f"   {result.name} · {outcome.label}: {outcome.status} (exit {outcome.exit_code}, {outcome.seconds} s)",
              flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "gpu-check-out")))
    parser.add_argument("--budget", type=float, default=480, help="seconds for every step together (default 8 min)")
    parser.add_argument("--only", help="comma list of step names to run (the others are listed as not reached)")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="gpu-check-"))
    header = _header(args.device)
    print(header, flush=True)
    began = time.monotonic()
    plan = steps(args.device, work)
    chosen = set(args.only.split(",")) if args.only else {s.name for s in plan}
    results = [StepResult(s.name, s.what, s.limit_s, [Outcome(c.label) for c in s.commands]) for s in plan]
    background: dict[int, tuple[list[_Running], float]] = {}  # step index -> (its commands, its deadline)

    def collect(wait: bool) -> None:
        for i, (running, deadline) in list(background.items()):
            if wait or all(r.process.poll() is not None for r in running):
                started = running[0].started
                results[i].outcomes = [_finish(r, deadline) for r in running]
                results[i].seconds = round(time.monotonic() - started, 1)
                _report(results[i])
                del background[i]
                _write(args.out, work, header, results)

    for i, step in enumerate(plan):
        collect(wait=False)
        left = args.budget - (time.monotonic() - began)
        if step.name not in chosen or left < 5:
            continue
        print(f"== {step.name}: {step.what}{' (in the background)' if step.background else ''}", flush=True)
        limit = min(step.limit_s if args.device == "cuda" else step.dry_limit_s, left)
        if step.background:
            background[i] = ([_start(step.name, c, work / "logs", k) for k, c in enumerate(step.commands)],
                             time.monotonic() + limit)
            results[i].limit_s = limit
            continue
        results[i] = _run_step(step, limit, work / "logs")
        _report(results[i])
        _write(args.out, work, header, results)
    collect(wait=True)
    _write(args.out, work, header, results)
    unexpected = [o for r in results for o in r.outcomes if o.status in ("unexpected", "cut")]
    print(f"done in {time.monotonic() - began:.0f} s; {len(unexpected)} command(s) unexpected or cut; "
          f"{args.out / 'summary.md'}", flush=True)


if __name__ == "__main__":
    main()
