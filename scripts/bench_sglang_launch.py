"""Time to verdict of the four-arm experiment over server launches, with the SGLang stand-in.

Server start-up dominates a real run (minutes for Qwen3-VL-8B: weights, CUDA-graph capture,
warm-up), so the figure that matters is how many start-ups a verdict waits for. Three ways:

- naive:      one launch per arm (4 launches, one after another), as ad-hoc scripts do;
- sequential: parity, one server per mode with the tap switched between requests (2 launches);
- concurrent: parity `--concurrent --gpus 0,1`, both servers starting at once (2 launches, ~1
  start-up). On one shared GPU `--concurrent` starts them one after the other (SGLang 0.5.23 sizes
  its memory from what is free at start), so it takes as long as sequential.

The naive way's verdict is taken from one extra four-arm run (its time is not counted).

The stand-in (tests/engines/sglang_standin.py) sleeps `--startup-delay` seconds before it is ready.

    PYTHONPATH=. python scripts/bench_sglang_launch.py --startup-delay 5
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from parity.arms import ARM_ORDER, select_arms
from parity.run.experiment import run_experiment
from parity.run.planning import CaseSpec, RunSpec
from parity.media.catalog import builtin_fixture
from parity.media.fixtures import Prompt
from parity.engines.sglang.backend import SglangBackend, create_sglang_backend

STANDIN = Path(__file__).resolve().parent.parent / "tests" / "engines" / "sglang_standin.py"
PROMPT = "Describe the image."


@dataclass(frozen=True)
class Outcome:
    name: str
    launches: int
    seconds: float
    verdict: str


def make_backend(run_dir: Path, tiny: tuple[Any, Any], delay: float, concurrent: bool) -> SglangBackend:
    processor, config = tiny
    image_token = processor.tokenizer.convert_tokens_to_ids(processor.image_token)
    # --gpus 0,1: each server on its own (pretend) GPU, so --concurrent starts both at once.
    return create_sglang_backend(
        model="tiny-standin", max_new_tokens=20, run_dir=run_dir, concurrent=concurrent, processor=processor,
        model_config=config, gpus=(0, 1) if concurrent else (), ready_timeout=120.0, ready_poll=0.1,
        launch_command=[sys.executable, str(STANDIN), "--standin-startup-delay", str(delay),
                        "--standin-image-token-id", str(image_token)])


def run(backend: SglangBackend, arms: str) -> str:
    case = CaseSpec(builtin_fixture("rgb-stripes"), Prompt("bench", PROMPT))
    spec = RunSpec(model="tiny-standin", arms=select_arms(arms), cases=(case,), max_new_tokens=20)
    return run_experiment(spec, backend, warn=lambda _: None).verdict.code  # no localization on SGLang


def naive(run_dir: Path, tiny: tuple[Any, Any], delay: float) -> Outcome:
    start, launches = time.monotonic(), 0
    for name in ARM_ORDER:
        backend = make_backend(run_dir / name, tiny, delay, concurrent=False)
        run(backend, name)  # one arm alone: INCOMPLETE, only the time counts
        launches += backend.launch_count
    seconds = time.monotonic() - start
    verdict = run(make_backend(run_dir / "verdict", tiny, 0.0, concurrent=False), "all")
    return Outcome("naive (one launch per arm)", launches, seconds, verdict)


def parity_run(run_dir: Path, tiny: tuple[Any, Any], delay: float, concurrent: bool) -> Outcome:
    start = time.monotonic()
    backend = make_backend(run_dir, tiny, delay, concurrent)
    verdict = run(backend, "all")
    name = "parity --concurrent --gpus 0,1" if concurrent else "parity sequential"
    return Outcome(name, backend.launch_count, time.monotonic() - start, verdict)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--startup-delay", type=float, default=5.0, help="stand-in start-up seconds")
    args = parser.parse_args()
    from parity.models.tiny import build_config, build_processor, build_tokenizer
    from parity.presets import PRESETS

    tokenizer = build_tokenizer()
    tiny = (build_processor(tokenizer), build_config(PRESETS["tiny-qwen3-vl"], tokenizer))
    with tempfile.TemporaryDirectory(prefix="parity-bench-") as tmp:
        outcomes = [naive(Path(tmp) / "naive", tiny, args.startup_delay),
                    parity_run(Path(tmp) / "sequential", tiny, args.startup_delay, concurrent=False),
                    parity_run(Path(tmp) / "concurrent", tiny, args.startup_delay, concurrent=True)]
    baseline = outcomes[0].seconds
    print(f"stand-in start-up delay {args.startup_delay:g} s, four arms, one case\n")
    print(f"{'way':30} {'launches':>8} {'seconds':>8} {'vs naive':>9} {'start-ups':>9}  verdict")
    for o in outcomes:
        print(f"{o.name:30} {o.launches:8d} {o.seconds:8.1f} {baseline / o.seconds:8.2f}x "
              f"{o.seconds / args.startup_delay:9.2f}  {o.verdict}")


if __name__ == "__main__":
    main()
