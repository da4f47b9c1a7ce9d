"""What the freshness witness (design §6) costs a user: one whole `parity run` process with it, or
with a witness that watches nothing, so that a paired timer can run the two in turn (A B A B ...)
and take the ratio pair by pair. Issue 50 holds the four-arm run to 1.1x.

    python scripts/bench_witness.py on|off [parity run options]   (default: the embedded four arms)

`off` swaps in a witness whose capture, writes and check do nothing, and lets the run's self-check
accept an arm without freshness records; everything else (the arms, the replay check, the files)
is the same work. Each call writes into a fresh temporary folder.
"""

from __future__ import annotations

import sys
import tempfile
from contextlib import nullcontext


def _without_witness() -> None:
    from parity.runner import freshness, graph_runner
    from parity.trust import requirements

    class NoWitness(freshness.FreshnessWitness):
        def captured(self, key, fn):
            return fn

        def writes(self, tag):
            return nullcontext()

        def check(self, key, graph, supplied):
            return ()

    graph_runner.FreshnessWitness = NoWitness
    requirements._freshness_shape_problem = lambda *args: None


def main() -> None:
    if len(sys.argv) < 2 or sys.argv[1] not in ("on", "off"):
        sys.exit("usage: python scripts/bench_witness.py on|off [parity run options]")
    if sys.argv[1] == "off":
        _without_witness()
    from parity.cli import main as parity

    with tempfile.TemporaryDirectory() as out:
        sys.argv = ["parity", "run", "--out", out, *sys.argv[2:]]
        parity()


if __name__ == "__main__":
    main()
