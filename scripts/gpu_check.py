"""Every GPU check in one call, in order of value, inside one time budget (scripts/gpu_check.sh).

Each step runs its commands (in parallel where they are independent) under its own time limit, cut
to what is left of the budget; a step not reached, or cut, says so. After every step the results
are written again under --out, so a call cut short still returns what it did, in four files:

    summary.md   what each step gave, its tables (verdict matrix, timings, memory)
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

    xdist = "16" if device == "cuda" else "2"
    return [
        Step("defaults", 90, "`parity run` as a user types it, on this device and on this host's CPU (PASS, exit 0)",
             (run("parity run", "defaults/device"),
              Command("parity run --device cpu", (*parity, "run", "--device", "cpu", "--no-plot", "--out",
                                                  str(work / "defaults/cpu")))), parallel=False),
        Step("scenario-all", 150, "`--scenario all --fixture all` in one process per DeepStack preset and dtype (PASS)",
             tuple(run(f"{p} {d}", f"scenario-all/{p}-{d}", "--model", p, "--dtype", d, "--scenario", "all",
                       "--fixture", "all") for p in DEEPSTACK_PRESETS for d in MATRIX_DTYPES), dry_limit_s=60),
        Step("matrix", 150, "each runner variant x scenario x preset x dtype (fp32, bf16, fp16) against its expected "
                            "verdict, the same in every dtype",
             tuple(measure(f"{p} {d}", "matrix", f"matrix/{p}-{d}.jsonl", "--preset", p, "--dtype", d,
                           "--runs", str(work / "matrix" / "runs")) for p, d in MATRIX_RUNS),
             dry_limit_s=60),
        Step("replay-check", 90, "every planted bug's departure from eager on its own shape, and a correct "
                                 "replay's bound and padding noise on this device (departure_table.py)",
             (Command("departure_table.py", (py, "scripts/departure_table.py", "--device", device,
                                             "--out", str(work / "replay-check/table.md"))),)),
        Step("pytest-gpu", 120, "the tests marked gpu (real torch.cuda.CUDAGraph)",
             (Command("pytest -m gpu", (py, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider", "-rs")),)),
        Step("suite", 180, f"the whole suite on this host (pytest -n {xdist})",
             (Command(f"pytest -n {xdist}", (py, "-m", "pytest", "-q", "-n", xdist, "-p", "no:cacheprovider")),),
             dry_limit_s=60),
        Step("noise", 90, "the noise of a correct replay on this device (measure_noise.py, one seed)",
             (Command("measure_noise.py", (py, "scripts/measure_noise.py", "--device", device, "--seeds", "0",
                                           "--skip-bugs", "--jsonl", str(work / "noise/comparisons.jsonl"))),)),
        Step("timings", 60, "replay vs eager prefill per bucket, side by side (bf16)",
             (measure("timings", "timings", "timings/rows.jsonl"),), dry_limit_s=45),
        Step("memory", 30, "the DeepStack slot's bytes against the formula, and the captured graphs' peak",
             (measure("memory", "memory", "memory/rows.jsonl"),)),
    ]


def _run_step(step: Step, limit: float, logs: Path) -> StepResult:
    result = StepResult(step.name, step.what, limit)
    began = time.monotonic()
    logs.mkdir(parents=True, exist_ok=True)
    batches = [step.commands] if step.parallel else [(c,) for c in step.commands]
    for batch in batches:
        _run_batch(step.name, batch, began, limit, logs, result)
    result.seconds = round(time.monotonic() - began, 1)
    return result


def _run_batch(name: str, batch: tuple[Command, ...], began: float, limit: float, logs: Path,
               result: StepResult) -> None:
    running = []
    for command in batch:
        log = logs / f"{name}-{len(result.outcomes) + len(running)}.log"
        handle = log.open("w")
        process = subprocess.Popen(command.argv, cwd=ROOT, stdout=handle, stderr=subprocess.STDOUT,
                                   start_new_session=True)  # its own group: a cut stops its children too
        running.append((command, process, handle, log, time.monotonic()))
    for command, process, handle, log, started in running:
        left = max(0.0, limit - (time.monotonic() - began))
        try:
            code = process.wait(timeout=left)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
            code = None
        handle.close()
        text = log.read_text(errors="replace")
        status = "cut" if code is None else "ok" if code in command.ok_exit else "unexpected"
        result.outcomes.append(Outcome(command.label, code, round(time.monotonic() - started, 1), status,
                                       "\n".join(text.strip().splitlines()[-15:])))


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
    return {"defaults": defaults, "matrix": matrix, "timings": _rows(work / "timings/rows.jsonl"),
            "memory": _rows(work / "memory/rows.jsonl"),
            "departures": departures.read_text() if departures.exists() else ""}


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
    if tables["timings"]:
        lines += ["\n## Replay vs eager prefill (bf16)\n", "| preset | bucket | eager ms | replay ms | speed-up | max abs diff |",
                  "|---|---|---|---|---|---|"]
        lines += [f"| {r['preset']} | {r['bucket']} | {r['eager_ms']:.3f} | {r['replay_ms']:.3f} | {r['speedup']:.2f}× | "
                  f"{r['max_abs_diff']:.3g} |" for r in tables["timings"]]
    if tables["memory"]:
        lines += ["\n## DeepStack slot memory\n", "| preset | dtype | slot bytes | formula | ok | capture peak bytes |",
                  "|---|---|---|---|---|---|"]
        lines += [f"| {r['preset']} | {r['dtype']} | {r['slot_bytes']} | {r['formula_bytes']} | "
                  f"{'✅' if r['ok'] else '❌'} | {r['capture_peak_bytes']} |" for r in tables["memory"]]
    return "\n".join(lines) + "\n"


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
    for i, step in enumerate(plan):
        left = args.budget - (time.monotonic() - began)
        if step.name not in chosen or left < 5:
            continue
        print(f"== {step.name}: {step.what}", flush=True)
        limit = step.limit_s if args.device == "cuda" else step.dry_limit_s
        results[i] = _run_step(step, min(limit, left), work / "logs")
        for outcome in results[i].outcomes:
            print(f"   {outcome.label}: {outcome.status} (exit {outcome.exit_code}, {outcome.seconds} s)", flush=True)
        _write(args.out, work, header, results)
    _write(args.out, work, header, results)
    unexpected = [o for r in results for o in r.outcomes if o.status in ("unexpected", "cut")]
    print(f"done in {time.monotonic() - began:.0f} s; {len(unexpected)} command(s) unexpected or cut; "
          f"{args.out / 'summary.md'}", flush=True)


if __name__ == "__main__":
    main()
