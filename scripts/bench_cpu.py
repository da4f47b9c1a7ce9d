"""CPU benchmarks of `parity` on tiny-qwen3-vl, every figure measured side by side in one invocation.

Each figure is the wall time of a whole `parity` process (what a user waits for), the median of
--rounds rounds, rounds interleaved so drift hits every variant alike; ratios are of medians.

1. Light commands: `parity --help` and `parity verdict FILE` (they must not import torch).
2. A default run, and the share of it spent importing (`python -c "import ..."` of the run path).
3. Threads: one intra-op thread (parity's default for the presets) vs torch's default vs every core,
   on this machine as it is and with two busy processes beside it.
4. Four arms vs one arm; three fixtures x two prompts in one run vs six single-case runs.
5. The arms' own time (from results.json) against --max-new-tokens 20 / 80 / 320: a prefill and a
   KV-cached decode grow linearly (a re-prefill per token would grow quadratically).

    python scripts/bench_cpu.py [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Callable

REPO = Path(__file__).resolve().parents[1]
FIXTURES = ("rgb-stripes", "checkerboard", "gradient-circle")
PROMPTS = ("Describe the image in one sentence.", "What colors do you see?")
RUN_IMPORTS = "import parity.run_command, parity.backends.transformers_backend, parity.models.tiny"


# Without these variables parity's own thread policy decides, as for a user who sets nothing.
CLEAN_ENV = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}


def timed(argv: list[str], env: dict | None = None) -> float:
    start = time.perf_counter()
    proc = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, env=env)
    elapsed = time.perf_counter() - start
    if proc.returncode not in (0, 3):
        raise SystemExit(f"{' '.join(argv)} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    return elapsed


def parity_run(*args: str, out: str | None = None) -> float:
    with tempfile.TemporaryDirectory() as tmp:
        return timed([sys.executable, "-m", "parity", "run", "--out", out or tmp, "--no-plot", *args], CLEAN_ENV)


def arm_seconds(*args: str) -> float:
    with tempfile.TemporaryDirectory() as tmp:
        parity_run(*args, out=tmp)
        doc = json.loads((Path(tmp) / "results.json").read_text())
    return sum(a["seconds"] + a["forced_seconds"] for c in doc["cases"] for a in c["arms"].values())


@contextmanager
def busy(processes: int):
    """`processes` CPU-bound processes beside the benchmark: a CI runner or a laptop doing other work."""
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(processes)]
    try:
        yield
    finally:
        for spinner in spinners:
            spinner.kill()
            spinner.wait()


def medians(variants: dict[str, Callable[[], float]], rounds: int) -> dict[str, float]:
    times: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(rounds):
        for name, fn in variants.items():
            times[name].append(fn())
    return {name: statistics.median(values) for name, values in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    rounds = parser.parse_args().rounds
    cores = str(os.cpu_count() or 1)
    with tempfile.TemporaryDirectory() as tmp:
        parity_run(out=tmp)
        results = str(Path(tmp) / "results.json")
        light = medians({
            "parity --help": lambda: timed([sys.executable, "-m", "parity", "--help"]),
            "parity verdict FILE": lambda: timed([sys.executable, "-m", "parity", "verdict", results]),
            "default parity run": lambda: parity_run(),
            "imports of the run path": lambda: timed([sys.executable, "-c", RUN_IMPORTS]),
        }, rounds)
    for name, value in light.items():
        print(f"{name:42} {value:7.2f} s")
    print(f"{'import share of a default run':42} {light['imports of the run path'] / light['default parity run']:7.2f}")

    counts = sorted({"1", "2", cores}, key=int)  # 1 is parity's default for the presets; all cores, torch's
    thread_variants = {f"--threads {n}": (lambda n=n: parity_run("--threads", n)) for n in counts}
    quiet = medians(thread_variants, rounds)
    with busy(2):
        loaded = medians(thread_variants, rounds)
    for name in thread_variants:
        print(f"{name:42} quiet {quiet[name]:6.2f} s   2 busy processes {loaded[name]:6.2f} s   "
              f"loaded/quiet {loaded[name] / quiet[name]:5.2f}")

    shape = medians({
        "one arm (bcg_normal)": lambda: parity_run("--arms", "bcg_normal"),
        "four arms": lambda: parity_run("--arms", "all"),
        "3 fixtures x 2 prompts, one run": lambda: parity_run(
            *[a for f in FIXTURES for a in ("--fixture", f)], *[a for p in PROMPTS for a in ("--prompt", p)]),
        "6 single-case runs": lambda: sum(parity_run("--fixture", f, "--prompt", p) for f in FIXTURES for p in PROMPTS),
    }, rounds)
    for name, value in shape.items():
        print(f"{name:42} {value:7.2f} s")
    print(f"{'four arms / one arm':42} {shape['four arms'] / shape['one arm (bcg_normal)']:7.2f}  (target <= 1.3)")
    print(f"{'one 3x2 run / six single runs':42} {shape['3 fixtures x 2 prompts, one run'] / shape['6 single-case runs']:7.2f}"
          "  (target <= 0.4)")

    tokens = medians({str(n): (lambda n=n: arm_seconds("--max-new-tokens", str(n))) for n in (20, 80, 320)}, rounds)
    for n, value in tokens.items():
        print(f"{'arms, --max-new-tokens ' + n:42} {value:7.2f} s")
    print(f"{'arms 320 / 80 tokens':42} {tokens['320'] / tokens['80']:7.2f}  (linear: ~4, quadratic: ~16)")


if __name__ == "__main__":
    main()
