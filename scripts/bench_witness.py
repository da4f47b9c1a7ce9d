"""What the freshness witness (design §6) costs a user: one whole `parity run` process with it, or
with a witness that watches nothing, so that a paired timer can run the two in turn (A B A B ...)
and take the ratio pair by pair. Issue 50 holds the four-arm run to 1.1x.

    python scripts/bench_witness.py on|off [parity run options]   (default: the embedded four arms)
    python scripts/bench_witness.py off --backend vllm --device cpu --graph-mode full   (an engine's)

`off` swaps in a witness whose capture, writes and check do nothing, and lets the run's self-check
accept an arm without freshness records; everything else (the arms, the replay check, the files)
is the same work. On a server backend it also sets `PARITY_FRESHNESS=off` for the servers, whose
witness (SGLang's, vLLM's) then watches nothing. Each call writes into a fresh temporary folder.
"""

from __future__ import annotations

import sys
import tempfile
from contextlib import nullcontext


def _without_witness() -> None:
    import os

    from parity.engines.channel import FRESHNESS_OFF_ENV
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
    os.environ[FRESHNESS_OFF_ENV] = "off"  # the servers parity starts inherit it
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
