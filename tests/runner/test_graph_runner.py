"""The slot contract of design §6 on the emulated graph backend (CPU)."""

import pytest
import torch
from torch import nn

from parity.runner.buckets import BucketPolicy, prefill_bucket_ladder
from parity.runner.graph_runner import PrefillGraphRunner, RunnerVariant, deepstack_slot_width

HIDDEN, N_DS = 4, 2
WIDTH = HIDDEN * N_DS


class ToyBody(nn.Module):
    """hidden = embeds + sum of DeepStack blocks; every row visible, so leaks show up."""

    deepstack_count = N_DS
    hidden_size = HIDDEN

    def forward(self, embeds, positions, deepstack, probe=False):
        out = embeds + positions[0].unsqueeze(1).to(embeds.dtype)
        if deepstack is not None:
            for k in range(N_DS):
                out = out + deepstack[:, k * HIDDEN:(k + 1) * HIDDEN]
        return (out,)


class PlainBody(nn.Module):
    """A body that does not declare the DeepStack capability."""

    def forward(self, embeds, positions, deepstack, probe=False):
        return (embeds,)


def make_runner(variant=RunnerVariant.FIXED, body=None, buckets=(4, 8)):
    return PrefillGraphRunner(body or ToyBody(), hidden_size=HIDDEN, dtype=torch.float32,
                              device=torch.device("cpu"), buckets=buckets, variant=variant)


def inputs(n, ds_value=1.0):
    embeds = torch.zeros(n, HIDDEN)
    positions = torch.zeros(3, n, dtype=torch.long)
    deepstack = torch.full((n, WIDTH), ds_value)
    return embeds, positions, deepstack


def eager(n, deepstack):
    embeds, positions, _ = inputs(n)
    return ToyBody()(embeds, positions, deepstack)[0]


def replay(runner, *args):
    return runner.replay(*args)[0]


def test_replay_sees_deepstack_through_the_slot_and_equals_eager():
    runner = make_runner()
    embeds, positions, deepstack = inputs(6, 0.5)
    assert torch.equal(replay(runner, embeds, positions, deepstack), eager(6, deepstack))
    assert torch.equal(runner.deepstack_slot[:6], deepstack)


def test_shorter_request_zeroes_the_tail_of_its_bucket():
    runner = make_runner()
    replay(runner, *inputs(8, 1.0))
    replay(runner, *inputs(5, 2.0))
    slot = runner.deepstack_slot
    assert torch.equal(slot[:5], torch.full((5, WIDTH), 2.0)) and not slot[5:8].any()


@pytest.mark.parametrize("absent", [None, torch.empty(0, WIDTH), torch.empty(0)])
def test_absence_clears_the_bucket_slice(absent):
    runner = make_runner()
    replay(runner, *inputs(7, 3.0))
    embeds, positions, _ = inputs(6)
    out = replay(runner, embeds, positions, absent)
    assert not runner.deepstack_slot[:8].any()
    assert torch.equal(out, eager(6, None))


@pytest.mark.parametrize("bad, problem", [
    (torch.ones(6, WIDTH, dtype=torch.float64), "dtype"),
    (torch.ones(6, WIDTH, 1), "rank"),
    (torch.ones(6, WIDTH + 1), "width"),
    (torch.ones(7, WIDTH), "7 rows for a request of 6 tokens"),
    (torch.ones(6, WIDTH, device="meta"), "device"),
])
def test_malformed_input_raises_and_leaves_the_slot_byte_identical(bad, problem):
    runner = make_runner()
    replay(runner, *inputs(8, 4.0))
    before = runner.deepstack_slot.clone()
    embeds, positions, _ = inputs(6)
    with pytest.raises(RuntimeError, match=problem):
        replay(runner, embeds, positions, bad)
    assert torch.equal(runner.deepstack_slot, before)


def slot_contract_violations(runner) -> list[str]:
    """Drive a runner through the contract's lifecycle and name every broken promise."""
    violations = []
    embeds, positions, deepstack = inputs(8, 1.0)
    if not torch.equal(replay(runner, embeds, positions, deepstack), eager(8, deepstack)):
        violations.append("replay does not see the live DeepStack")
    embeds, positions, deepstack = inputs(5, 2.0)
    if not torch.equal(replay(runner, embeds, positions, deepstack), eager(5, deepstack)):
        violations.append("a second request does not see its own DeepStack")
    if runner.deepstack_slot is not None and runner.deepstack_slot[5:8].any():
        violations.append("padded tail not zeroed")
    embeds, positions, _ = inputs(7)
    out = replay(runner, embeds, positions, None)
    if not torch.equal(out, eager(7, None)):
        violations.append("absence leaks stale rows")
    return violations


def test_fixed_runner_keeps_the_contract():
    assert slot_contract_violations(make_runner()) == []


def test_negative_control_refresh_removed_turns_red(monkeypatch):
    runner = make_runner()
    monkeypatch.setattr(runner, "refresh_deepstack", lambda *args: None)
    assert "replay does not see the live DeepStack" in slot_contract_violations(runner)


def test_negative_control_tail_clear_skipped_turns_red():
    violations = slot_contract_violations(make_runner(RunnerVariant.NO_CLEAR))
    assert "padded tail not zeroed" in violations and "absence leaks stale rows" in violations


def test_negative_control_legacy_never_sees_deepstack():
    assert "replay does not see the live DeepStack" in slot_contract_violations(make_runner(RunnerVariant.LEGACY))


def test_zero_cost_without_capability_count_or_capture():
    assert make_runner(RunnerVariant.LEGACY).deepstack_slot is None
    assert make_runner(body=PlainBody()).deepstack_slot is None
    assert make_runner(buckets=()).deepstack_slot is None
    assert make_runner().deepstack_slot_bytes == 8 * WIDTH * 4
    assert deepstack_slot_width(ToyBody(), captured=False, variant=RunnerVariant.FIXED) is None


def test_zero_cost_for_nodeepstack_model_and_exact_cost_for_tiny(tiny, tiny_nodeepstack):
    from parity.backends.transformers_backend import TransformersBackend

    def slot_bytes(loaded):
        backend = TransformersBackend(loaded, max_new_tokens=1, buckets=BucketPolicy((16, 64), 4096))
        backend.prepare(["bcg"], [10, 50])
        try:
            return backend.runner.deepstack_slot_bytes, backend.runner.deepstack_slot
        finally:
            backend.close()

    assert slot_bytes(tiny_nodeepstack) == (0, None)
    nbytes, slot = slot_bytes(tiny)
    assert nbytes == 64 * tiny.adapter.hidden_size * 3 * 4 and slot.shape == (64, tiny.adapter.hidden_size * 3)


def test_buckets_are_captured_as_a_server_has_them(tiny):
    """auto: SGLang's ladder up to the largest bucket the prompts need, the smaller ones included,
    so a single-fixture run meets buckets smaller than its own; an explicit list: all of it."""
    from parity.backends.transformers_backend import TransformersBackend

    explicit = TransformersBackend(tiny, max_new_tokens=1, buckets=BucketPolicy((16, 32, 64, 128), 4096))
    explicit.prepare(["bcg"], [39, 40, 20])
    auto = TransformersBackend(tiny, max_new_tokens=1)
    auto.prepare(["bcg"], [39, 49, 4])
    try:
        assert explicit.runner.buckets == (16, 32, 64, 128)
        assert auto.runner.buckets == (4, 8, 12, 16, 20, 24, 28, 32, 48, 64) and auto.max_bucket == 64
    finally:
        explicit.close()
        auto.close()


def test_auto_buckets_follow_sglangs_ladder_and_cover_the_context():
    policy = BucketPolicy.parse("auto", 4096)
    assert [policy.bucket_of(n) for n in (1, 4, 5, 32, 33, 48, 49, 257, 4096)] == [4, 4, 8, 32, 48, 48, 64, 288, 4096]
    assert policy.bucket_of(4097) is None and policy.bucket_of(0) is None
    assert prefill_bucket_ladder(8192)[-1] == 8192 and len(prefill_bucket_ladder(8192)) == 58
    assert BucketPolicy.parse((64, 16), 4096).bucket_of(39) == 64 and BucketPolicy.parse((16,), 4096).bucket_of(39) is None


def test_bucket_choice_and_limits():
    runner = make_runner(buckets=(8, 4))
    assert runner.buckets == (4, 8) and runner.bucket_for(3) == 4 and runner.bucket_for(5) == 8
    assert not runner.can_replay(9) and not runner.can_replay(0)
    with pytest.raises(ValueError, match="no captured bucket"):
        replay(runner, *inputs(9))


def test_outputs_are_copies_not_borrowed_buffers():
    runner = make_runner()
    first = replay(runner, *inputs(4, 1.0))
    kept = first.clone()
    replay(runner, *inputs(4, 9.0))
    assert torch.equal(first, kept)
