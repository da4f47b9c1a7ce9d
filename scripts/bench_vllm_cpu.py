"""Wall time of a whole `--scenario all` run (four-arm, reuse and stream) on real vLLM 0.33 servers
on this CPU, per graph mode, as released and with parity's fix, measured side by side.

Each round runs every (graph mode, fix) pair once, one after the other, so the fixed/released ratio
of a mode compares runs made minutes apart on the same machine. A run is the user's command, as a
subprocess (two server launches, the arms, the verdict); the issue's budget is 3 minutes per mode on
an idle 2-core machine. Run it with the vLLM environment's Python (scripts/setup_vllm_env.sh):

    VLLM_TARGET_DEVICE=cpu ~/.cache/parity/vllm-0.33.0-torch-2.14.1/bin/python scripts/bench_vllm_cpu.py --rounds 2
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BUDGET_S = 180.0


def one_run(graph_mode: str, fixed: bool, out: Path) -> tuple[float, str, int]:
    command = [sys.executable, "-m", "parity", "run", "--backend", "vllm", "--device", "cpu",
               "--graph-mode", graph_mode, "--scenario", "all", "--no-plot", "--out", str(out)]
    if fixed:
        command += ["--vllm-fix", "deepstack-clear"]
    started = time.monotonic()
    done = subprocess.run(command, capture_output=True, text=True)
    wall = time.monotonic() - started
    results = out / "results.json"
    verdict = json.loads(results.read_text())["verdict"]["code"] if results.exists() else "no results"
    return wall, verdict, done.returncode


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--modes", default="full,breakable")
    args = parser.parse_args()
    pairs = [(mode, fixed) for mode in args.modes.split(",") for fixed in (False, True)]
    walls: dict[tuple[str, bool], list[float]] = {p: [] for p in pairs}
    verdicts: dict[tuple[str, bool], set[str]] = {p: set() for p in pairs}
    with tempfile.TemporaryDirectory(prefix="bench-vllm-cpu-") as root:
        for round_ in range(args.rounds):
            for mode, fixed in pairs:
                wall, verdict, code = one_run(mode, fixed, Path(root) / f"{round_}-{mode}-{fixed}")
                walls[(mode, fixed)].append(wall)
                verdicts[(mode, fixed)].add(f"{verdict} (exit {code})")
                print(f"round {round_ + 1}: {mode:9s} {'fixed' if fixed else 'released':8s} {wall:6.1f} s  {verdict}",
                      flush=True)
    print(f"\n{'mode':9s} {'variant':8s} {'min':>7s} {'median':>7s} {'max':>7s}  within {BUDGET_S:.0f} s  verdict")
    for (mode, fixed), values in walls.items():
        print(f"{mode:9s} {'fixed' if fixed else 'released':8s} {min(values):7.1f} {statistics.median(values):7.1f} "
              f"{max(values):7.1f}  {'yes' if max(values) <= BUDGET_S else 'NO':>10s}  "
              f"{', '.join(sorted(verdicts[(mode, fixed)]))}")
    for mode in args.modes.split(","):
        ratios = [f / r for f, r in zip(walls[(mode, True)], walls[(mode, False)])]
        print(f"{mode}: fixed/released wall ratio, median {statistics.median(ratios):.3f} "
              f"(min {min(ratios):.3f}, max {max(ratios):.3f})")


if __name__ == "__main__":
    main()
