"""Building an embedded preset from another seed."""

from __future__ import annotations

import pytest
import torch

from parity.errors import UsageError
from parity.models import load_model
from parity.models.tiny import PRESETS


@pytest.fixture(scope="module")
def model():
    built = {}

    def get(preset: str, seed: int, dtype: str = "float32"):
        if (preset, seed, dtype) not in built:
            built[preset, seed, dtype] = load_model(preset, device="cpu", dtype=dtype, seed=seed)
        return built[preset, seed, dtype]

    return get


def test_a_seed_builds_another_preset_under_the_same_name(model):
    seed = PRESETS["tiny-qwen3-vl"].seed
    default, other = model("tiny-qwen3-vl", seed), model("tiny-qwen3-vl", seed + 1)
    assert (default.name, default.seed, other.name, other.seed) == ("tiny-qwen3-vl", seed, "tiny-qwen3-vl", seed + 1)
    assert load_model("tiny-qwen3-vl", device="cpu").seed == PRESETS["tiny-qwen3-vl"].seed
    again = load_model("tiny-qwen3-vl", device="cpu", seed=seed + 1)
    weights = [m.adapter.lm_head.weight for m in (default, other, again)]
    assert not torch.equal(weights[0], weights[1]) and torch.equal(weights[1], weights[2])
    assert weights[1] is not weights[2]  # every load gets its own copy of the cached build


def test_a_seed_for_a_checkpoint_is_a_usage_error(tmp_path):
    with pytest.raises(UsageError, match="seed builds an embedded preset"):
        load_model(str(tmp_path / "checkpoint"), device="cpu", seed=1)
