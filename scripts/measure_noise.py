"""The numeric noise of a correct (fixed) runner, and the effect of every planted runner bug: what
`--logprob-tol auto` is chosen from (docs/verdicts.md, "Tolerances").

The sweep is several times wider than the tests': every embedded preset with DeepStack, several
seeds, every built-in fixture plus generated images of other sizes and aspect ratios, two prompts
each (one the tests never use), 64 new tokens, fp32 and bf16, the four-arm and stream scenarios. For every
comparison a correct runtime must match (bcg vs eager, in four-arm and in every stream request) it
records the largest and the mean |Δ logprob| over the compared steps, whether the tokens flipped,
and for every flip its margins (in each arm, how far the other arm's token scored below its own),
its flip deltas (both tokens scored by both arms at the flip step) and its teacher-forced deltas:
what a near-tie's margin (`--tie-margin auto`) is chosen from. Then every planted bug (tests/mutants.py, `--runner legacy`,
`--runner no-clear`) runs on a smaller plan, and its effect is the strongest signal among the
comparisons that a correct runtime would match.

    python scripts/measure_noise.py [--seeds 0 1] [--dtypes float32 bfloat16]
        [--max-new-tokens 64] [--device cpu|cuda] [--jsonl OUT.jsonl]

Prints one summary block per dtype; `--jsonl` keeps every comparison's figures, written as they are made.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
import torch  # noqa: E402
from PIL import Image  # noqa: E402

from parity.arms import select_arms  # noqa: E402
from parity.backends.options import PRESET_THREADS  # noqa: E402
from parity.backends.transformers_backend import TransformersBackend  # noqa: E402
from parity.run.experiment import run_experiment  # noqa: E402
from parity.run.planning import CaseSpec, RunSpec  # noqa: E402
from parity.media.fixtures import Fixture, Prompt, builtin_fixtures, default_prompts  # noqa: E402
from parity.runner.graph_runner import PrefillGraphRunner, RunnerVariant  # noqa: E402
from parity.judge.metrics import (  # noqa: E402
    auto_tolerances, first_divergence, flip_deltas, flip_margins, forced_deltas, position_deltas,
)
from parity.models import load_model  # noqa: E402
from parity.judge.verdict import checks_for  # noqa: E402

sys.path.insert(0, str(ROOT / "tests"))
import mutants  # noqa: E402
import user_images  # noqa: E402

PRESETS = ("tiny-qwen3-vl", "tiny-qwen3-vl-moe")
EXTRA_PROMPTS = (Prompt("extra-unusual", "What is unusual about this picture? Answer briefly."),
                 Prompt("extra-colors", "What colors do you see?"), Prompt("extra-where", "Where is the circle?"))
# Sizes and aspect ratios the built-in fixtures do not have (width, height).
GENERATED_SIZES = ((64, 64), (224, 56), (56, 224), (160, 120))


def generated_images() -> list[Fixture]:
    """Smooth random colour fields of other sizes: 'user images' the tests never use."""
    out = []
    for i, (w, h) in enumerate(GENERATED_SIZES):
        rng = np.random.default_rng(1000 + i)
        coarse = rng.integers(0, 256, size=(4, 4, 3), dtype=np.uint8)
        image = Image.fromarray(coarse, mode="RGB").resize((w, h), Image.BICUBIC)
        out.append(Fixture(f"generated-{w}x{h}", image))
    return out


def drawn_images() -> list[Fixture]:
    return [Fixture(f"drawn-{shape}-{w}x{h}", user_images.drawn(w, h, shape)) for w, h, shape in user_images.DRAWN]


def images() -> list[Fixture]:
    return builtin_fixtures() + generated_images() + drawn_images()


def cases(stream: bool) -> tuple[CaseSpec, ...]:
    """Four-arm: every image with its own first prompt and three others; stream: the first prompt only."""
    prompts = (lambda f: (default_prompts(f)[0],)) if stream else (lambda f: (default_prompts(f)[0], *EXTRA_PROMPTS))
    return tuple(CaseSpec(f, p) for f in images() for p in prompts(f))


@dataclass(frozen=True)
class Flip:
    """A flip of a must-match comparison: the larger of its two margins, its largest flip delta, and
    its teacher-forced deltas (max, mean); None where a token is outside the other arm's top-k."""

    margin: float | None
    flip: float | None
    forced: tuple[float, float] | None


@dataclass
class Figures:
    """Every must-match comparison's (max |Δ|, mean |Δ|) over its compared steps, when tokens match."""

    matched: list[tuple[float, float]] = field(default_factory=list)
    flips: list[Flip] = field(default_factory=list)  # every token flip (a correct runner's are noise)
    comparisons: int = 0

    def add(self, a, b, rows: list, tag: dict) -> None:
        self.comparisons += 1
        divergence = first_divergence(a.token_ids, b.token_ids)
        if divergence is None:
            d = position_deltas(a.token_logprobs, b.token_logprobs, None)
            self.matched.append((max(d, default=0.0), float(np.mean(d)) if d else 0.0))
            rows.append({**tag, "a": a.name, "b": b.name, "kind": "match", "max": max(d, default=0.0),
                         "mean": float(np.mean(d)) if d else 0.0})
            return
        margins = flip_margins(a, b, divergence) if divergence < min(len(a.token_ids), len(b.token_ids)) else None
        flips = flip_deltas(a, b, divergence) if margins is not None else None
        forced = forced_deltas(a, b)
        flip = Flip(None if margins is None else max(margins), None if flips is None else max(flips),
                    None if not forced else (max(forced), float(np.mean(forced))))
        self.flips.append(flip)
        rows.append({**tag, "a": a.name, "b": b.name, "kind": "flip", "step": divergence, "margin": flip.margin,
                     "flip_delta": flip.flip, "forced": flip.forced})


class JsonLines(list):
    """The comparisons' rows, each also appended to `path` as it is made: a sweep stopped at a time
    limit keeps what it measured."""

    def __init__(self, path: Path | None):
        super().__init__()
        self.path = path
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text("")

    def append(self, row: dict) -> None:
        super().append(row)
        if self.path is not None:
            with self.path.open("a") as f:
                f.write(json.dumps(row) + "\n")


def must_match(run):
    for case in run.cases:
        for group, check in checks_for(case):
            if check.expect_match and check.a in group.arms and check.b in group.arms:
                a, b = group.arms[check.a], group.arms[check.b]
                if not a.failed and not b.failed:
                    yield case, a, b


def run_once(loaded, plan, scenarios, max_new_tokens, runner_class=PrefillGraphRunner,
             variant=RunnerVariant.FIXED, backend_class=TransformersBackend):
    spec = RunSpec(model=loaded.name, arms=select_arms("all"), cases=plan, scenarios=scenarios,
                   max_new_tokens=max_new_tokens)
    backend = backend_class(loaded, max_new_tokens=max_new_tokens, runner_variant=variant, runner_class=runner_class)
    return run_experiment(spec, backend)


def noise(args, rows) -> dict[str, Figures]:
    figures: dict[str, Figures] = {}
    for dtype in args.dtypes:
        fig = figures.setdefault(dtype, Figures())
        for preset in args.presets:
            for seed in args.seeds:
                start = time.perf_counter()
                loaded = load_model(preset, device=args.device, dtype=dtype, seed=seed)
                runs = [run_once(loaded, cases(stream), (scenario,), args.max_new_tokens)
                        for stream, scenario in ((False, "four-arm"), (True, "stream"))]
                for run in runs:
                    for case, a, b in must_match(run):
                        fig.add(a, b, rows, {"dtype": dtype, "preset": preset, "seed": seed, "case": case.id})
                print(f"  noise {preset} seed {seed} {dtype}: {sum(len(r.cases) for r in runs)} cases, "
                      f"{time.perf_counter() - start:.0f} s", file=sys.stderr, flush=True)
    return figures


BUGS = {
    "legacy (no DeepStack slot)": dict(variant=RunnerVariant.LEGACY),
    "no-clear (slot never cleared)": dict(variant=RunnerVariant.NO_CLEAR),
    **{cls.__name__: dict(runner_class=cls) for cls in mutants.ANSWER_BUGS},
}


def bug_effects(args) -> dict[str, dict[str, tuple[float, float, int]]]:
    """Per dtype and bug: the smallest, over cases where a correct runner matches, of the bug's
    strongest signal (max |Δ| of its worst must-match comparison; inf when tokens flip), and the
    number of cases."""
    plan = tuple(CaseSpec(f, default_prompts(f)[0]) for f in builtin_fixtures()[:3])
    out: dict[str, dict[str, tuple[float, float, int]]] = {}
    for dtype in args.dtypes:
        for name, how in BUGS.items():
            smallest_max, smallest_mean, n = math.inf, math.inf, 0
            for preset in args.presets:
                loaded = load_model(preset, device=args.device, dtype=dtype, seed=args.seeds[0])
                run = run_once(loaded, plan, ("four-arm", "stream"), min(args.max_new_tokens, 20), **how)
                worst: dict[str, tuple[float, float]] = {}
                for case, a, b in must_match(run):
                    key = case.id.split("/", 1)[-1] if case.scenario != "four-arm" else case.id
                    if first_divergence(a.token_ids, b.token_ids) is not None:
                        signal = (math.inf, math.inf)
                    else:
                        d = position_deltas(a.token_logprobs, b.token_logprobs, None)
                        signal = (max(d, default=0.0), float(np.mean(d)) if d else 0.0)
                    worst[key] = max(worst.get(key, (0.0, 0.0)), signal)
                for signal in worst.values():
                    smallest_max, smallest_mean = min(smallest_max, signal[0]), min(smallest_mean, signal[1])
                    n += 1
            out.setdefault(dtype, {})[name] = (smallest_max, smallest_mean, n)
            print(f"  bug {name} {dtype}: done", file=sys.stderr, flush=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--presets", nargs="+", default=list(PRESETS))
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1])
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--jsonl", type=Path, help="write every must-match comparison's figures here")
    parser.add_argument("--skip-bugs", action="store_true", help="only the noise sweep")
    args = parser.parse_args()
    torch.set_num_threads(PRESET_THREADS)
    rows = JsonLines(args.jsonl)
    figures = noise(args, rows)
    effects = {} if args.skip_bugs else bug_effects(args)
    print(f"sweep: {len(args.presets)} presets x {len(args.seeds)} seeds x ({len(cases(False))} four-arm + "
          f"{len(cases(True))} stream cases) x {args.max_new_tokens} new tokens, device {args.device}")
    for dtype, fig in figures.items():
        tol = auto_tolerances(dtype)
        scored = [f.forced for f in fig.flips if f.forced is not None]
        maxes = [m for m, _ in fig.matched + scored]
        means = [m for _, m in fig.matched + scored]
        print(f"{dtype}: auto tolerance max {tol.logprob_tol:g}, mean {tol.mean_tol}, tie margin {tol.tie_margin:g}")
        ties = [f for f in fig.flips if f.margin is not None and f.margin <= tol.tie_margin]
        print(f"  must-match comparisons {fig.comparisons}: {len(fig.matched)} token-equal, {len(fig.flips)} flips "
              f"({len(ties)} near-ties at the auto margin, {len(fig.flips) - len(ties)} not)")
        margins = [f.margin for f in fig.flips if f.margin is not None]
        flip_largest = [f.flip for f in fig.flips if f.flip is not None]
        if margins:
            print(f"  flips: largest margin {max(margins):.3g} (tie margin / largest = "
                  f"{tol.tie_margin / max(margins):.3g}x), largest flip delta {max(flip_largest):.3g}; "
                  f"{sum(f.margin is None for f in fig.flips)} with a token outside the other arm's top-k")
        if maxes:
            print(f"  largest max |Δ| {max(maxes):.3g} (p99 {np.percentile(maxes, 99):.3g}), "
                  f"largest mean |Δ| {max(means):.3g} (p99 {np.percentile(means, 99):.3g})")
            print(f"  margin: max bound / largest max = {tol.logprob_tol / max(max(maxes), 1e-12):.3g}x"
                  + (f", mean bound / largest mean = {tol.mean_tol / max(max(means), 1e-12):.3g}x"
                     if tol.mean_tol is not None else ""))
        for name, (smax, smean, n) in effects.get(dtype, {}).items():
            print(f"  bug {name:36} smallest effect over {n} cases: max |Δ| {smax:.3g}, mean |Δ| {smean:.3g}")


if __name__ == "__main__":
    main()
