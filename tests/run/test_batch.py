"""Requests that share a forward (the batch scenario, design §10, docs/scenarios.md): the graph
runner packs them side by side, each request's DeepStack at its offset, and answers each as the
eager engine answers it alone; a batch that did not share a forward is never a PASS."""

from __future__ import annotations

from contextlib import contextmanager

import pytest
import torch

from parity.arms import select_arms
from parity.backends.transformers_backend import TransformersBackend
from parity.design import BATCH, SEQUENCE_REQUESTS
from parity.media.catalog import builtin_fixture
from parity.media.fixtures import default_prompts
from parity.run.experiment import run_experiment
from parity.run.planning import CaseSpec, RunSpec
from parity.runner.buckets import BucketPolicy
from parity.runner.graph_runner import RunnerVariant
from parity.runner.lm_body import Past, fill_packed_mask
from parity.runner.packing import Member, Packed

TOKENS = 8


@pytest.fixture(scope="module")
def tiny_bf16():
    from parity.models import load_model

    return load_model("tiny-qwen3-vl", device="cpu", dtype="bfloat16")


def _run(loaded, runner="fixed", backend_class=TransformersBackend, **backend):
    fx = builtin_fixture("rgb-stripes")
    spec = RunSpec(model=loaded.name, arms=select_arms("all"), cases=(CaseSpec(fx, default_prompts(fx)[0]),),
                   scenarios=(BATCH,), max_new_tokens=TOKENS)
    return run_experiment(spec, backend_class(loaded, max_new_tokens=TOKENS, runner_variant=RunnerVariant(runner),
                                              **backend))


def _batch(case, request: int, arm: str = "bcg_normal"):
    evidence = case.arm(arm, request).evidence
    return None if evidence.serving is None else evidence.serving.batch


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_fixed_runner_answers_each_batched_request_as_eager_alone(request, dtype):
    loaded = request.getfixturevalue("tiny" if dtype == "float32" else "tiny_bf16")
    case = _run(loaded).cases[0]
    assert case.verdict.code == "PASS", case.verdict
    specs = SEQUENCE_REQUESTS[BATCH]
    by_forward: dict[int, list] = {}
    for i, spec in enumerate(specs):
        batch = _batch(case, i)
        assert batch is not None and batch.requests == 2 and batch.bucket is not None
        by_forward.setdefault(batch.forward, []).append((spec.forward, batch))
        assert _batch(case, i, "eager_normal") is None  # the reference served it alone
    # Three forwards, each held exactly the two requests the design puts in it, side by side.
    assert len(by_forward) == 3
    for members in by_forward.values():
        assert len({planned for planned, _ in members}) == 1
        spans = sorted((b.start, b.end) for _, b in members)
        assert spans[0][0] == 0 and spans[0][1] == spans[1][0] and spans[1][1] == members[0][1].rows
    # The chunked request's earlier chunks ran alone; its last shared the forward with the twin image.
    chunked = case.arm("bcg_normal", 4).evidence.serving
    assert len(chunked.chunks) > 1 and chunked.chunks[-1].bucket == chunked.batch.bucket
    assert chunked.batch.end - chunked.batch.start == chunked.chunks[-1].end - chunked.chunks[-1].start
    # Every input of every shared forward was written for it.
    records = [r for i in range(len(specs)) for r in case.arm("bcg_normal", i).evidence.freshness]
    assert {"input_embeds", "positions", "deepstack", "past_mask"} <= {r.input for r in records}
    assert all(r.fresh for r in records)


def test_the_witness_names_the_request_whose_rows_were_missing(tiny):
    case = _run(tiny, "batch-first-only").cases[0]
    assert case.verdict.code == "FAIL_DEEPSTACK_DROPPED", case.verdict
    assert "request 2's rows (text only, beside the image) in forward 1" in case.verdict.reason, case.verdict
    # The small image's answer moved too; the localization probes the shared forward, where it happens.
    assert case.localization is not None and case.localization.request == 3
    assert case.localization.first_point.label == "L0+DS0"


def test_a_batch_no_graph_fits_is_not_replayed(tiny):
    """The requests fit their own bucket but not a shared one: each ran alone, so nothing was tested."""
    run = _run(tiny, buckets=BucketPolicy((48, 96), tiny.adapter.max_positions))
    assert run.verdict.code == "INCONCLUSIVE_NOT_REPLAYED", run.verdict
    assert "ran alone, in no forward shared with another request" in run.verdict.reason
    assert all(_batch(run.cases[0], i) is None or _batch(run.cases[0], i).requests == 2
               for i in range(len(SEQUENCE_REQUESTS[BATCH])))


class _OneAtATime(TransformersBackend):
    """A backend whose sessions cannot submit requests at once (an engine parity does not batch on)."""

    @contextmanager
    def session(self, mode):
        with super().session(mode) as inner:
            class Plain:
                answer, score = inner.answer, inner.score
            yield Plain()


def test_a_backend_that_serves_one_request_at_a_time_is_not_replayed(tiny):
    run = _run(tiny, backend_class=_OneAtATime)
    assert run.verdict.code == "INCONCLUSIVE_NOT_REPLAYED", run.verdict
    assert "(shared forward)" in run.verdict.reason


def test_the_packed_mask_keeps_each_request_to_its_rows():
    mask = torch.zeros(8, 3 + 8, dtype=torch.bool)
    fill_packed_mask(mask, ((0, 2, 0), (2, 5, 3)))  # a request of 2 rows, then one of 3 after 3 past rows
    own = mask[:, 3:]
    assert not mask[:2, :3].any() and mask[2:5, :3].all()  # only the continued request sees the past
    assert own[:2, :2].tolist() == [[True, False], [True, True]] and not own[:2, 2:].any()
    assert own[2:5, 2:5].tolist() == [[True, False, False], [True, True, False], [True, True, True]]
    assert not own[2:5, :2].any() and not own[2:5, 5:].any()  # never another request's rows
    assert [own[r, r].item() for r in range(5, 8)] == [True] * 3 and own[5:].sum() == 3  # padding: itself


def test_packing_puts_each_request_s_deepstack_at_its_offset():
    def member(rows, value, past=None):
        return Member(torch.zeros(rows, 4), torch.zeros(3, rows, dtype=torch.long),
                      None if value is None else torch.full((rows, 2), float(value)), past, None)

    packed = Packed((member(2, 1.0), member(3, None), member(2, 7.0)))
    assert packed.ranges == ((0, 2), (2, 5), (5, 7))
    assert packed.deepstack()[:, 0].tolist() == [1, 1, 0, 0, 0, 7, 7]
    assert packed.deepstack(at=[0, 0, 0])[:, 0].tolist() == [7, 7, 0, 0, 0, 0, 0]  # the planted offset-0
    empty = Past(torch.zeros(1, 1), torch.zeros(1, 1), torch.ones(1, 1, dtype=torch.bool))
    with pytest.raises(ValueError, match="at most one request's earlier rows"):
        Packed((member(2, None, empty), member(2, None, empty)))


def test_poison_leaves_no_sentinel_in_a_correct_batch_and_finds_the_missed_rows(tiny):
    """--poison (design §6) on packed forwards: the fix writes every row each request must, so no
    sentinel survives; a refresh of the first request's rows only leaves it in the second's."""
    fixed = _run(tiny, poison=True).cases[0]
    assert fixed.verdict.code == "PASS", fixed.verdict
    records = [r for i in range(len(SEQUENCE_REQUESTS[BATCH])) for r in fixed.arm("bcg_normal", i).evidence.freshness]
    assert any(r.poisoned is not None for r in records) and not any(r.poisoned for r in records)
    missed = _run(tiny, "batch-first-only", poison=True).cases[0]
    assert missed.verdict.code == "FAIL_DEEPSTACK_DROPPED" and "still held the poison sentinel" in missed.verdict.reason
