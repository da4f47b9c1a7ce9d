"""CPU benchmarks of `parity run` on tiny-qwen3-vl, measured side by side in one invocation.

1. Four arms vs one arm (issue: target ratio <= 1.6): the model is built once and each bucket
   captured once, shared by the normal and zero arms.
2. 3 fixtures x 2 prompts in one run vs 6 single-case runs: the loaded model is shared by cases.

Each figure is the wall time of a whole `parity run` process (what a user waits for), the median
of --rounds rounds, rounds interleaved so drift hits every variant alike.

    python scripts/bench_cpu.py [--rounds 3]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
FIXTURES = ("rgb-stripes", "checkerboard", "gradient-circle")
PROMPTS = ("Describe the image in one sentence.", "What colors do you see?")


def parity_run(*args: str) -> float:
    with tempfile.TemporaryDirectory() as out:
        start = time.perf_counter()
        proc = subprocess.run([sys.executable, "-m", "parity", "run", "--out", out, "--no-plot", *args],
                              cwd=REPO, capture_output=True, text=True)
        elapsed = time.perf_counter() - start
    if proc.returncode not in (0, 3):
        raise SystemExit(f"parity run {' '.join(args)} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    return elapsed


def many_cases() -> float:
    args = [a for f in FIXTURES for a in ("--fixture", f)] + [a for p in PROMPTS for a in ("--prompt", p)]
    return parity_run(*args)


def separate_cases() -> float:
    return sum(parity_run("--fixture", f, "--prompt", p) for f in FIXTURES for p in PROMPTS)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    rounds = parser.parse_args().rounds
    variants = {
        "one arm (eager_normal)": lambda: parity_run("--arms", "eager_normal"),
        "one arm (bcg_normal)": lambda: parity_run("--arms", "bcg_normal"),
        "four arms": lambda: parity_run("--arms", "all"),
        "3 fixtures x 2 prompts, one run": many_cases,
        "6 single-case runs": separate_cases,
    }
    times: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(rounds):
        for name, fn in variants.items():
            times[name].append(fn())
    median = {name: statistics.median(values) for name, values in times.items()}
    for name, value in median.items():
        print(f"{name:34} {value:7.2f} s  (median of {rounds})")
    print(f"four arms / one arm (bcg_normal):   {median['four arms'] / median['one arm (bcg_normal)']:.2f}  (target <= 1.6)")
    print(f"four arms / one arm (eager_normal): {median['four arms'] / median['one arm (eager_normal)']:.2f}")
    print(f"6 separate runs / one 3x2 run:      {median['6 single-case runs'] / median['3 fixtures x 2 prompts, one run']:.2f}")


if __name__ == "__main__":
    main()
