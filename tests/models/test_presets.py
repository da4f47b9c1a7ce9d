"""The embedded presets are decisive for any seed, not for a picked one.

Zeroing DeepStack changes the first token by a margin far above a tie, in fp32 and bf16, and
padding a prefill to its bucket moves the logprobs by far less than a tie. Each (preset, seed,
dtype) is built once per module. The forward here is Hugging Face's decoder layers called the way
parity's LM body calls them (one sequence, causal SDPA, DeepStack block k added after layer k),
checked against HF's own forward, so these checks do not depend on parity's body or backends.
"""

from __future__ import annotations

import pytest
import torch

from parity.errors import UsageError
from parity.media.catalog import builtin_fixture
from parity.media.fixtures import builtin_fixtures, default_prompts
from parity.models import load_model
from parity.presets import PRESETS

SEEDS = range(5)
WITH_DEEPSTACK = ("tiny-qwen3-vl", "tiny-qwen3-vl-moe", "tiny-qwen3-omni")
TIE_MARGIN = 0.1  # design §2: a divergence within this is a coin flip of noise
POWER_MARGIN = 0.5  # what "well above a tie" means here
# Fixtures whose first prompt is padded the least (31 -> 32) and the most (49 -> 64).
PADDED = {"quadrants": 32, "diagonal-stripes": 64}


@pytest.fixture(scope="module")
def model():
    built = {}

    def get(preset: str, seed: int, dtype: str = "float32"):
        if (preset, seed, dtype) not in built:
            built[preset, seed, dtype] = load_model(preset, device="cpu", dtype=dtype, seed=seed)
        return built[preset, seed, dtype]

    return get


@torch.inference_mode()
def last_logprobs(adapter, prepared, deepstack: str = "normal", pad_to: int | None = None) -> torch.Tensor:
    """Log-probabilities of the next token after the prompt, optionally zero-padded to a bucket."""
    embeds, positions = prepared.input_embeds, prepared.positions  # [T, H], [3, T]
    ds = prepared.deepstack if deepstack == "normal" else None  # [T, H * n]
    rows = embeds.shape[0]
    if pad_to is not None:  # padded rows after the real ones, zeroed, as the graph runner pads
        extra = pad_to - rows
        embeds = torch.cat([embeds, embeds.new_zeros(extra, embeds.shape[1])])
        positions = torch.cat([positions, positions.new_zeros(3, extra)], dim=1)
        ds = None if ds is None else torch.cat([ds, ds.new_zeros(extra, ds.shape[1])])
    lm = adapter.model.model.language_model
    hidden = embeds.unsqueeze(0)
    rope = lm.rotary_emb(hidden, positions.unsqueeze(1))
    width = embeds.shape[1]
    for index, layer in enumerate(lm.layers):
        out = layer(hidden, position_embeddings=rope, attention_mask=None, position_ids=None)
        hidden = out[0] if isinstance(out, tuple) else out
        if ds is not None and index < adapter.deepstack_count:
            hidden = hidden + ds[:, index * width:(index + 1) * width].unsqueeze(0)
    return torch.log_softmax(adapter.lm_head(lm.norm(hidden)[0, rows - 1]).float(), dim=-1)


def power_margin(normal: torch.Tensor, zero: torch.Tensor) -> float:
    """How far each run's first token beats the other run's, in that run (<= 0: same token)."""
    a, b = int(normal.argmax()), int(zero.argmax())
    return min(float(normal[a] - normal[b]), float(zero[b] - zero[a]))


def test_the_forward_here_is_hf_forward(model):
    adapter = model("tiny-qwen3-vl", 0).adapter
    fixture = builtin_fixture("mosaic")
    prompt = default_prompts(fixture)[0].text
    with torch.inference_mode():
        reference = torch.log_softmax(adapter.model(**adapter.processor_inputs(fixture, prompt)).logits[0, -1], -1)
    assert torch.allclose(last_logprobs(adapter, adapter.prepare(fixture, prompt)), reference, atol=1e-5, rtol=0)


@pytest.mark.parametrize("preset", WITH_DEEPSTACK)
def test_zeroing_deepstack_changes_the_first_token_by_a_clear_margin_for_every_seed(preset, model):
    for seed in SEEDS:
        adapter = model(preset, seed).adapter
        for fixture in builtin_fixtures():
            for prompt in default_prompts(fixture):
                prepared = adapter.prepare(fixture, prompt.text)
                margin = power_margin(last_logprobs(adapter, prepared), last_logprobs(adapter, prepared, "zero"))
                assert margin >= POWER_MARGIN, (seed, fixture.name, prompt.id, margin)


@pytest.mark.parametrize("preset", WITH_DEEPSTACK)
def test_bf16_keeps_the_power_and_padding_moves_logprobs_by_less_than_a_tie(preset, model):
    for seed in SEEDS:
        adapter = model(preset, seed, "bfloat16").adapter
        for name, bucket in PADDED.items():
            fixture = builtin_fixture(name)
            prepared = adapter.prepare(fixture, default_prompts(fixture)[0].text)
            assert prepared.input_ids.shape[0] < bucket
            normal, zero = last_logprobs(adapter, prepared), last_logprobs(adapter, prepared, "zero")
            assert power_margin(normal, zero) >= POWER_MARGIN, (seed, name)
            for deepstack, unpadded in (("normal", normal), ("zero", zero)):
                padded = last_logprobs(adapter, prepared, deepstack, pad_to=bucket)
                assert float((padded - unpadded).abs().max()) < TIE_MARGIN, (seed, name, deepstack)


@pytest.mark.parametrize("preset", WITH_DEEPSTACK)
def test_fp32_padding_changes_no_token(preset, model):
    for seed in SEEDS:
        adapter = model(preset, seed).adapter
        for name, bucket in PADDED.items():
            fixture = builtin_fixture(name)
            prepared = adapter.prepare(fixture, default_prompts(fixture)[0].text)
            for deepstack in ("normal", "zero"):
                unpadded = last_logprobs(adapter, prepared, deepstack)
                padded = last_logprobs(adapter, prepared, deepstack, pad_to=bucket)
                assert int(padded.argmax()) == int(unpadded.argmax())
                assert float((padded - unpadded).abs().max()) < 1e-4


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_without_deepstack_the_channel_tokens_are_exactly_out_of_the_race(dtype, model):
    """The mechanism behind the margin: zeroed DeepStack leaves the channel, so even logits, at 0."""
    adapter = model("tiny-qwen3-vl", 0, dtype).adapter
    fixture = builtin_fixture("rgb-stripes")
    prepared = adapter.prepare(fixture, default_prompts(fixture)[0].text)
    zero, normal = last_logprobs(adapter, prepared, "zero"), last_logprobs(adapter, prepared)
    even = torch.arange(zero.shape[0]) % 2 == 0
    assert torch.equal(zero[even], zero[even][:1].expand(int(even.sum())))  # one shared logit: 0
    assert int(zero.argmax()) % 2 == 1 and int(normal.argmax()) % 2 == 0


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
