"""Every planted runner bug against the replay check, per dtype (docs/verdicts.md, "Replay against
eager on its own shape"): the verdict each gets in its own scenario, and the size of its first
departure against the bound; then the correct runner's largest replay delta, bound and padding
noise over `--scenario all`.

    python scripts/departure_table.py [--presets tiny-qwen3-vl tiny-qwen3-vl-moe]
        [--dtypes float32 bfloat16 float16] [--device cpu|cuda] [--out TABLE.md]

A bug the token-level comparison cannot see in reduced precision (its effect under the dtype's
tolerance) still departs by orders of magnitude more than the bound, which is 0 where the
kernels are deterministic.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from parity.arms import select_arms  # noqa: E402
from parity.backends.transformers_backend import TransformersBackend  # noqa: E402
from parity.design import PLANTED_BUGS, SCENARIOS  # noqa: E402
from parity.media.catalog import builtin_fixture  # noqa: E402
from parity.media.fixtures import default_prompts  # noqa: E402
from parity.models import load_model  # noqa: E402
from parity.run.experiment import run_experiment  # noqa: E402
from parity.run.planning import CaseSpec, RunSpec  # noqa: E402
from parity.runner.graph_runner import PrefillGraphRunner, RunnerVariant  # noqa: E402

sys.path.insert(0, str(ROOT / "tests"))
import mutants  # noqa: E402

# (label, runner variant, runner class, scenario): each bug in the scenario that reaches it, the ones
# only the replay check catches in reduced precision first (a run stopped at a time limit keeps them).
FIRST = ("layout-keyed", "clears-own-rows", "mutant NudgesEveryReplayInBf16")
_BUGS = (("legacy", RunnerVariant.LEGACY, PrefillGraphRunner, "four-arm"),
         ("no-clear", RunnerVariant.NO_CLEAR, PrefillGraphRunner, "stream"),
         *((name, RunnerVariant(name), PrefillGraphRunner, scenario) for name, (scenario, _) in PLANTED_BUGS.items()),
         ("mutant SkipsCopyWhenShapeRepeats", RunnerVariant.FIXED, mutants.SkipsCopyWhenShapeRepeats, "stream"),
         ("mutant RefreshesAfterReplay", RunnerVariant.FIXED, mutants.RefreshesAfterReplay, "stream"),
         ("mutant NudgesEveryReplayInBf16", RunnerVariant.FIXED, mutants.NudgesEveryReplayInBf16, "four-arm"))
BUGS = tuple(sorted(_BUGS, key=lambda bug: FIRST.index(bug[0]) if bug[0] in FIRST else len(FIRST)))


def run(loaded, variant, runner_class, scenarios, max_new_tokens=12):
    fixture = builtin_fixture("rgb-stripes")
    spec = RunSpec(model=loaded.name, arms=select_arms("all"), cases=(CaseSpec(fixture, default_prompts(fixture)[0]),),
                   scenarios=scenarios, max_new_tokens=max_new_tokens)
    return run_experiment(spec, TransformersBackend(loaded, max_new_tokens=max_new_tokens, runner_variant=variant,
                                                    runner_class=runner_class))


def checks(run_result):
    for case in run_result.cases:
        for arm in case.all_arms():
            if arm.evidence is not None and arm.evidence.replay_check is not None:
                yield arm.evidence.replay_check


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--presets", nargs="+", default=["tiny-qwen3-vl", "tiny-qwen3-vl-moe"])
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16", "float16"])
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--out", type=Path, help="also write the table here, row by row")
    args = parser.parse_args()
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text("")

    def row(line: str) -> None:
        print(line, flush=True)
        if args.out is not None:
            with args.out.open("a") as f:
                f.write(line + "\n")

    row("| preset | dtype | runner | scenario | verdict | first departure | Δ | bound |")
    row("|---|---|---|---|---|---|---|---|")
    for preset in args.presets:
        for dtype in args.dtypes:
            loaded = load_model(preset, device=args.device, dtype=dtype)
            for label, variant, runner_class, scenario in BUGS:
                result = run(loaded, variant, runner_class, (scenario,))
                first = next((c.departure for c in checks(result) if c.departure is not None), None)
                where = "—" if first is None else f"{first.tensor} at {first.point}, row {first.position}"
                delta = "—" if first is None else f"{first.delta:.3g}"
                bound = "—" if first is None else f"{first.bound:.3g}"
                row(f"| {preset} | {dtype} | {label} | {scenario} | {result.verdict.code} | {where} | {delta} | {bound} |")
            correct = run(loaded, RunnerVariant.FIXED, PrefillGraphRunner, SCENARIOS)
            found = list(checks(correct))
            worst = max((t.delta for c in found for t in c.tensors), default=0.0)
            bound = max((t.bound for c in found for t in c.tensors), default=0.0)
            noise = max((c.padding_noise or 0.0 for c in found), default=0.0)
            row(f"| {preset} | {dtype} | fixed | all | {correct.verdict.code} | {len(found)} checked arms, "
                f"largest Δ {worst:.3g}, padding noise {noise:.3g} | {worst:.3g} | {bound:.3g} |")


if __name__ == "__main__":
    main()
