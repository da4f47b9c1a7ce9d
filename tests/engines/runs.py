"""Runs of the experiment against an engine's stand-in, for the engine test modules (a helper module)."""

from __future__ import annotations

import sys
from pathlib import Path

from parity.arms import select_arms
from parity.engines.sglang import backend as sglang_backend
from parity.run.experiment import run_experiment
from parity.media.catalog import builtin_fixture
from parity.media.fixtures import Prompt
from parity.run.planning import CaseSpec, RunSpec
from parity.results import FOUR_ARM, RunResult
from tests.engines.servers import SGLANG_STANDIN as STANDIN
from tests.engines.servers import standin_identity

MAX_NEW_TOKENS = 6


def make_backend(run_dir: Path, tiny_parts, *standin_args: str, concurrent: bool = True,
                 **kwargs) -> sglang_backend.SglangBackend:
    """Two servers on their own (pretend) GPUs by default: their start-ups overlap, the suite stays fast."""
    if concurrent:
        kwargs.setdefault("gpus", (0, 1))
    processor, config = tiny_parts
    image_token = str(processor.tokenizer.convert_tokens_to_ids(processor.image_token))
    kwargs.setdefault("ready_timeout", 30.0)
    return sglang_backend.create_sglang_backend(
        model="tiny-standin", max_new_tokens=MAX_NEW_TOKENS, run_dir=run_dir, concurrent=concurrent,
        processor=processor, model_config=config, identity=standin_identity, stop_grace=5.0, ready_poll=0.05,
        launch_command=[sys.executable, str(STANDIN), "--standin-image-token-id", image_token, *standin_args],
        **kwargs)


def run(backend, scenarios=(FOUR_ARM,), arms: str = "all") -> RunResult:
    case = CaseSpec(builtin_fixture("rgb-stripes"), Prompt("describe", "Describe the image."))
    spec = RunSpec(model="tiny-standin", arms=select_arms(arms), cases=(case,), scenarios=tuple(scenarios),
                   max_new_tokens=backend.settings.max_new_tokens)
    warnings: list[str] = []
    result = run_experiment(spec, backend, warn=warnings.append)
    # Localization probes a graph parity captures itself: on an engine a failing case says so and stays.
    assert all(f"not available on the {backend.name} backend" in w for w in warnings)
    assert all(case.localization is None for case in result.cases)
    return result


def four_arms(result: RunResult) -> dict:
    return {arm.name: arm for arm in result.cases[0].arms}
