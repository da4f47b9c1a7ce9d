"""Time to verdict of the four-arm experiment over server launches, with the SGLang stand-in.

Server start-up dominates a real run (minutes for Qwen3-VL-8B: weights, CUDA-graph capture,
warm-up), so the figure that matters is how many start-ups a verdict waits for. Three ways:

- naive:      one launch per arm (4 launches, one after another), as ad-hoc scripts do;
- sequential: parity, one server per mode with the tap switched between requests (2 launches);
- concurrent: parity `--concurrent`, both servers starting at once (2 launches, ~1 start-up).

The stand-in (tests/sglang_standin.py) sleeps `--startup-delay` seconds before it is ready.

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

from parity.arms import ARM_ORDER, load_arms
from parity.backends.base import Request
from parity.fixtures import builtin_fixture
from parity.results import ArmResult, CaseResult, FixtureInfo
from parity.sglang.backend import SglangBackend, create_sglang_backend
from parity.verdict import judge_case

STANDIN = Path(__file__).resolve().parent.parent / "tests" / "sglang_standin.py"
PROMPT = "Describe the image."


@dataclass(frozen=True)
class Outcome:
    name: str
    launches: int
    seconds: float
    verdict: str


def make_backend(run_dir: Path, processor: Any, delay: float, concurrent: bool) -> SglangBackend:
    return create_sglang_backend(
        model="tiny-standin", max_new_tokens=20, run_dir=run_dir, concurrent=concurrent, processor=processor,
        launch_command=[sys.executable, str(STANDIN), "--standin-startup-delay", str(delay)],
        ready_timeout=120.0, ready_poll=0.1)


def arm_result(name: str, backend_session: Any) -> ArmResult:
    arm = load_arms()[name]
    generation = backend_session.generate(Request(builtin_fixture("rgb-stripes"), PROMPT), arm.deepstack)
    return ArmResult(name, arm.mode, arm.deepstack, generation.token_ids, generation.text,
                     generation.token_logprobs, generation.top_logprobs, generation.deepstack_record)


def verdict_of(arms: list[ArmResult]) -> str:
    fixture = builtin_fixture("rgb-stripes")
    case = CaseResult("rgb-stripes/bench", FixtureInfo(fixture.name, fixture.sha256, fixture.size), PROMPT,
                      tuple(arms))
    return judge_case(case, 0.25).verdict.code


def naive(run_dir: Path, processor: Any, delay: float) -> Outcome:
    start, arms, launches = time.monotonic(), [], 0
    for name in ARM_ORDER:
        backend = make_backend(run_dir / name, processor, delay, concurrent=False)
        try:
            with backend.session(load_arms()[name].mode) as session:
                arms.append(arm_result(name, session))
        finally:
            backend.close()
        launches += backend.launch_count
    return Outcome("naive (one launch per arm)", launches, time.monotonic() - start, verdict_of(arms))


def parity_run(run_dir: Path, processor: Any, delay: float, concurrent: bool) -> Outcome:
    start, arms = time.monotonic(), []
    backend = make_backend(run_dir, processor, delay, concurrent)
    backend.prepare(("eager", "bcg"))
    try:
        for mode in ("eager", "bcg"):
            with backend.session(mode) as session:
                arms += [arm_result(n, session) for n in ARM_ORDER if load_arms()[n].mode == mode]
    finally:
        backend.close()
    name = "parity --concurrent" if concurrent else "parity sequential"
    return Outcome(name, backend.launch_count, time.monotonic() - start, verdict_of(arms))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--startup-delay", type=float, default=5.0, help="stand-in start-up seconds")
    args = parser.parse_args()
    from parity.models.tiny import build_processor, build_tokenizer

    processor = build_processor(build_tokenizer())
    with tempfile.TemporaryDirectory(prefix="parity-bench-") as tmp:
        outcomes = [naive(Path(tmp) / "naive", processor, args.startup_delay),
                    parity_run(Path(tmp) / "sequential", processor, args.startup_delay, concurrent=False),
                    parity_run(Path(tmp) / "concurrent", processor, args.startup_delay, concurrent=True)]
    baseline = outcomes[0].seconds
    print(f"stand-in start-up delay {args.startup_delay:g} s, four arms, one case\n")
    print(f"{'way':30} {'launches':>8} {'seconds':>8} {'vs naive':>9} {'start-ups':>9}  verdict")
    for o in outcomes:
        print(f"{o.name:30} {o.launches:8d} {o.seconds:8.1f} {baseline / o.seconds:8.2f}x "
              f"{o.seconds / args.startup_delay:9.2f}  {o.verdict}")


if __name__ == "__main__":
    main()
