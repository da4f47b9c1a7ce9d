"""The per-layer noise of a correct (fixed) runner: what `--localize-threshold auto` is chosen from.

For every embedded preset, dtype, built-in fixture and its prompts, the prefill of the image request
is probed by replay (fixed runner, after the case's earlier bcg request, as a localization does) and
eagerly, with DeepStack normal and zeroed; reported per (preset, dtype): the largest relative error
`||h_bcg - h_eager|| / ||h_eager||` at any probe point, and where. The known-buggy variants are run
alongside through `run_experiment` (legacy: four-arm; no-clear: reuse), reported as the smallest
relative error at their first divergent point: the threshold must sit between the two.

    python scripts/localization_noise.py [--presets ...] [--dtypes float32 bfloat16 float16]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from parity.arms import BCG_NORMAL, BCG_ZERO, EAGER_NORMAL, EAGER_ZERO, select_arms  # noqa: E402
from parity.backends.options import PRESET_THREADS  # noqa: E402
from parity.backends.protocol import Request  # noqa: E402
from parity.backends.transformers_backend import TransformersBackend  # noqa: E402
from parity.run.experiment import run_experiment  # noqa: E402
from parity.run.planning import CaseSpec, RunSpec  # noqa: E402
from parity.media.fixtures import builtin_fixtures, default_prompts  # noqa: E402
from parity.runner.graph_runner import RunnerVariant  # noqa: E402
from parity.run.localization import Step, Target, auto_threshold, localize  # noqa: E402
from parity.models import load_model  # noqa: E402
from parity.presets import PRESETS  # noqa: E402

TARGETS = (Target(BCG_ZERO, EAGER_ZERO, None, Step(0, "zero"), ()),
           Target(BCG_NORMAL, EAGER_NORMAL, None, Step(0, "normal"), (Step(0, "zero"),)))


def fixed_noise(loaded, cases) -> tuple[float, str]:
    backend = TransformersBackend(loaded, max_new_tokens=1)
    requests = [Request(c.fixture, c.prompt.text) for c in cases]
    backend.prepare(("bcg",), [backend.prompt_length(r) for r in requests])
    worst, where = 0.0, ""
    for case, request in zip(cases, requests):
        for target in TARGETS:
            loc = localize(backend, target, [request], threshold=1.0)
            point = max(loc.points, key=lambda p: p.rel_error)
            if point.rel_error >= worst:
                worst, where = point.rel_error, f"{case.id} {target.arm} {point.label}"
    backend.close()
    return worst, where


def smallest_bug(loaded, preset, cases, variant: RunnerVariant, scenario: str) -> tuple[float | None, int]:
    spec = RunSpec(model=preset, arms=select_arms("all"), cases=cases, scenarios=(scenario,), max_new_tokens=20)
    run = run_experiment(spec, TransformersBackend(loaded, max_new_tokens=20, runner_variant=variant))
    firsts = [c.localization.first_point.rel_error for c in run.cases
              if c.localization is not None and c.localization.first is not None]
    return (min(firsts) if firsts else None), sum(c.localization is not None for c in run.cases)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--presets", nargs="+", default=list(PRESETS))
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16", "float16"])
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    args = parser.parse_args()
    torch.set_num_threads(PRESET_THREADS)
    cases = tuple(CaseSpec(f, p) for f in builtin_fixtures() for p in default_prompts(f))
    print("| preset | dtype | fixed: max rel. error (where) | auto threshold | legacy: smallest first-divergent "
          "(cases) | no-clear reuse: smallest first-divergent (cases) |")
    print("|---|---|---|---|---|---|")
    for preset in args.presets:
        for dtype in args.dtypes:
            loaded = load_model(preset, device=args.device, dtype=dtype)
            worst, where = fixed_noise(loaded, cases)
            bugs = []
            for variant, scenario in ((RunnerVariant.LEGACY, "four-arm"), (RunnerVariant.NO_CLEAR, "reuse")):
                smallest, n = smallest_bug(loaded, preset, cases, variant, scenario)
                bugs.append("—" if smallest is None else f"{smallest:.3g} ({n})")
            print(f"| {preset} | {dtype} | {worst:.2g} ({where}) | {auto_threshold(dtype):g} | {bugs[0]} | {bugs[1]} |",
                  flush=True)


if __name__ == "__main__":
    main()
