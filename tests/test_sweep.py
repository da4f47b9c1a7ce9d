"""The verdicts hold on every preset, fixture and dtype, and for any seed: not a picked seed.

Over 5 seeds x every preset with DeepStack x every built-in fixture x {fp32, bf16}, the fixed
runner PASSes every case and the legacy runner (the upstream drop) is FAIL_DEEPSTACK_DROPPED in
every case; and `--scenario all` passes on every preset and fixture in both dtypes.

The seed sweep generates SWEEP_TOKENS tokens per arm to fit the suite's time budget: the drop shows
at the first token, and noise flips are exercised at full length by the scenario test (20 tokens,
three scenarios) and by `scripts/measure_noise.py` (every prompt, 20 tokens, the same 5 seeds).
"""

import pytest

from parity.arms import select_arms
from parity.backends.transformers_backend import TransformersBackend
from parity.experiment import CaseSpec, RunSpec, run_experiment
from parity.fixtures import builtin_fixtures, default_prompts
from parity.graph_runner import RunnerVariant
from parity.models import load_model
from parity.results import SCENARIOS

SEEDS = (0, 1, 2, 3, 4)
DTYPES = ("float32", "bfloat16")
SWEEP_TOKENS = 10
CASES = tuple(CaseSpec(f, default_prompts(f)[0]) for f in builtin_fixtures())


def _verdicts(preset: str, dtype: str, seed: int = 0, variant: RunnerVariant = RunnerVariant.FIXED,
              scenarios: tuple[str, ...] = ("four-arm",), max_new_tokens: int = SWEEP_TOKENS) -> dict[str, str]:
    loaded = load_model(preset, device="cpu", dtype=dtype, seed=seed)
    spec = RunSpec(model=preset, arms=select_arms("all"), cases=CASES, scenarios=scenarios,
                   max_new_tokens=max_new_tokens)
    run = run_experiment(spec, TransformersBackend(loaded, max_new_tokens=max_new_tokens, runner_variant=variant))
    return {case.id: case.verdict.code for case in run.cases}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("preset", ["tiny-qwen3-vl", "tiny-qwen3-vl-moe"])
def test_fixed_passes_and_legacy_drops_for_every_seed_fixture_and_dtype(preset, seed, dtype):
    assert set(_verdicts(preset, dtype, seed).values()) == {"PASS"}
    assert set(_verdicts(preset, dtype, seed, RunnerVariant.LEGACY).values()) == {"FAIL_DEEPSTACK_DROPPED"}


@pytest.mark.parametrize("preset, dtype", [
    ("tiny-qwen3-vl", "float32"), ("tiny-qwen3-vl", "bfloat16"),
    ("tiny-qwen3-vl-moe", "float32"), ("tiny-qwen3-vl-moe", "bfloat16"),
    ("tiny-qwen3-vl-nodeepstack", "float32"),
])
def test_every_scenario_passes_on_every_preset_and_fixture(preset, dtype):
    verdicts = _verdicts(preset, dtype, scenarios=SCENARIOS, max_new_tokens=20)
    assert len(verdicts) == 3 * len(CASES)
    for case_id, code in verdicts.items():
        # A model without DeepStack has nothing to prove in the four-arm case; its sequences must agree.
        four_arm = not case_id.startswith(("reuse/", "stream/"))
        assert code == ("INCONCLUSIVE_NO_POWER" if four_arm and "nodeepstack" in preset else "PASS"), (case_id, code)
