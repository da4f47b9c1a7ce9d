"""The embedded engine's scenario table (docs/scenarios.md): every runner variant against every
scenario, on every built-in fixture, in one dtype; each cell is the verdicts of that scenario's
cases (one code when they agree).

    python scripts/scenario_table.py [--model PRESET] [--dtype bfloat16] [--fixture NAME ...] [--videos]
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from parity.arms import select_arms  # noqa: E402
from parity.backends.options import apply_thread_policy  # noqa: E402
from parity.backends.transformers_backend import TransformersBackend  # noqa: E402
from parity.design import RUNNER_VARIANTS, SCENARIOS  # noqa: E402
from parity.run.experiment import run_experiment  # noqa: E402
from parity.media.catalog import builtin_fixture  # noqa: E402
from parity.media.fixtures import builtin_fixtures, default_prompts  # noqa: E402
from parity.runner.graph_runner import RunnerVariant  # noqa: E402
from parity.models import load_model  # noqa: E402
from parity.run.planning import CaseSpec, RunSpec  # noqa: E402
from parity.media.videos import builtin_videos  # noqa: E402

TOKENS = 12


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--fixture", action="append",
                        help="a built-in image or video (default: every image, or with --videos every video)")
    parser.add_argument("--videos", action="store_true", help="every built-in video (with the images named)")
    parser.add_argument("--model", default="tiny-qwen3-vl", help="an embedded preset")
    args = parser.parse_args()
    apply_thread_policy(None, True)
    loaded = load_model(args.model, dtype=args.dtype)
    fixtures = [builtin_fixture(n) for n in args.fixture] if args.fixture else [] if args.videos else builtin_fixtures()
    fixtures += builtin_videos() if args.videos else []
    cases = tuple(CaseSpec(f, default_prompts(f)[0]) for f in fixtures)
    print(f"{args.model}, {args.dtype}, {len(cases)} fixture(s), {TOKENS} new tokens; rows: scenarios, "
          "columns: --runner\n")
    print("| scenario | " + " | ".join(f"`{v}`" for v in RUNNER_VARIANTS) + " |")
    print("|---" * (len(RUNNER_VARIANTS) + 1) + "|")
    cells: dict[str, dict[str, str]] = {s: {} for s in SCENARIOS}
    for variant in RUNNER_VARIANTS:
        spec = RunSpec(model=loaded.name, arms=select_arms("all"), cases=cases, scenarios=SCENARIOS,
                       max_new_tokens=TOKENS)
        run = run_experiment(spec, TransformersBackend(loaded, max_new_tokens=TOKENS,
                                                       runner_variant=RunnerVariant(variant)))
        for scenario in SCENARIOS:
            codes = Counter(c.verdict.code for c in run.cases if c.scenario == scenario)
            cells[scenario][variant] = ", ".join(f"{code} ×{n}" if len(codes) > 1 else code
                                                 for code, n in codes.most_common())
    for scenario in SCENARIOS:
        print(f"| `{scenario}` | " + " | ".join(cells[scenario][v] for v in RUNNER_VARIANTS) + " |")


if __name__ == "__main__":
    main()
