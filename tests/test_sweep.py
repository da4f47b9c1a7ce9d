"""The verdicts hold on every preset, fixture and dtype, and for any seed: not a picked seed.

Over 5 seeds x every preset with DeepStack x every built-in fixture x {fp32, bf16}, the fixed
runner PASSes every case and the legacy runner (the upstream drop) is FAIL_DEEPSTACK_DROPPED in
every case; and `--scenario all` passes on every preset and fixture in both dtypes.
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
CASES = tuple(CaseSpec(f, default_prompts(f)[0]) for f in builtin_fixtures())


def _verdicts(loaded, variant=RunnerVariant.FIXED, scenarios=("four-arm",)):
    spec = RunSpec(model=loaded.name, arms=select_arms("all"), cases=CASES, scenarios=scenarios)
    run = run_experiment(spec, TransformersBackend(loaded, max_new_tokens=spec.max_new_tokens, runner_variant=variant))
    return {case.id: case.verdict.code for case in run.cases}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("preset", ["tiny-qwen3-vl", "tiny-qwen3-vl-moe"])
def test_fixed_passes_and_legacy_drops_for_every_seed_fixture_and_dtype(preset, seed, dtype):
    loaded = load_model(preset, device="cpu", dtype=dtype, seed=seed)
    assert set(_verdicts(loaded).values()) == {"PASS"}
    assert set(_verdicts(loaded, RunnerVariant.LEGACY).values()) == {"FAIL_DEEPSTACK_DROPPED"}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("preset", ["tiny-qwen3-vl", "tiny-qwen3-vl-moe", "tiny-qwen3-vl-nodeepstack"])
def test_every_scenario_passes_on_every_preset_and_fixture(preset, dtype):
    verdicts = _verdicts(load_model(preset, device="cpu", dtype=dtype), scenarios=SCENARIOS)
    assert len(verdicts) == 3 * len(CASES)
    for case_id, code in verdicts.items():
        # A model without DeepStack has nothing to prove in the four-arm case; its sequences must agree.
        no_power = "nodeepstack" in preset and "/" in case_id and not case_id.startswith(("reuse/", "stream/"))
        assert code == ("INCONCLUSIVE_NO_POWER" if no_power else "PASS"), (case_id, code)
