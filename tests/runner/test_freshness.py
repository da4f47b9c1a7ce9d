"""The freshness witness (design §6, "Every input a graph reads, fresh for every request"): every
per-call input of every graph the runner replays, held to the rows its request must write, whatever
the answer does."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from parity.arms import select_arms
from parity.backends.transformers_backend import TransformersBackend
from parity.design import WITNESSED_BUGS
from parity.media.catalog import builtin_fixture
from parity.media.fixtures import default_prompts
from parity.reporting.report import arm_evidence_text
from parity.run.experiment import run_experiment
from parity.run.planning import CaseSpec, RunSpec
from parity.runner.freshness import FreshnessWitness, Supplied
from parity.runner.graph_runner import RunnerVariant
from tests.runner.test_graph_runner import HIDDEN, WIDTH, inputs, make_runner

TOKENS = 6


def _run(loaded, runner: str, scenario: str, poison: bool = False):
    fx = builtin_fixture("rgb-stripes")
    spec = RunSpec(model=loaded.name, arms=select_arms("all"), cases=(CaseSpec(fx, default_prompts(fx)[0]),),
                   scenarios=(scenario,), max_new_tokens=TOKENS)
    return run_experiment(spec, TransformersBackend(loaded, max_new_tokens=TOKENS, runner_variant=RunnerVariant(runner),
                                                    poison=poison))


def _records(run):
    return [r for case in run.cases for req in case.requests for arm in req.arms for r in arm.evidence.freshness]


@pytest.fixture(scope="module")
def tiny_bf16_witness():
    from parity.models import load_model

    return load_model("tiny-qwen3-vl", device="cpu", dtype="bfloat16")


# Each variant, the scenario that reaches it first, what the witness must say and the input it names.
CAUGHT = [
    ("mrope-one-row", "four-arm", "FAIL_INPUT_NOT_FRESH", "positions", "written with other values"),
    ("mrope-stale", "four-arm", "FAIL_STALE_STATE", "positions", "that another arm's request of this case left"),
    ("embeds-tail-kept", "four-arm", "FAIL_INPUT_NOT_FRESH", "input_embeds", "never written for it"),
    ("embeds-stale", "four-arm", "FAIL_STALE_STATE", "input_embeds", "that another arm's request of this case left"),
    ("legacy", "four-arm", "FAIL_DEEPSTACK_DROPPED", "deepstack", "never written for it"),
    ("no-clear", "reuse", "FAIL_STALE_STATE", "deepstack", "that request 1 (primer (image)) left"),
    ("clears-own-rows", "four-arm", "FAIL_DEEPSTACK_DROPPED", "deepstack", "never written for it"),
]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("variant, scenario, code, name, says", CAUGHT, ids=[c[0] for c in CAUGHT])
def test_each_variant_fails_on_the_witness_naming_its_input(request, dtype, variant, scenario, code, name, says):
    loaded = request.getfixturevalue("tiny" if dtype == "float32" else "tiny_bf16_witness")
    verdict = _run(loaded, variant, scenario).cases[0].verdict
    assert verdict.code == code, verdict
    assert f"graph read {name} rows [" in verdict.reason and says in verdict.reason, verdict.reason
    assert "freshness witness" in verdict.reason


def test_every_planted_input_variant_is_in_the_witness_table():
    assert set(WITNESSED_BUGS) == {c[0] for c in CAUGHT} - {"legacy", "no-clear", "clears-own-rows"}


def test_the_witness_needs_no_answer_to_move(tiny):
    """embeds-stale in four-arm: the graph arm served second reads the first one's embeddings, which
    are its own too (same prompt): every answer agrees, and the witness alone fails it (the negative
    control of an answer-only check)."""
    case = _run(tiny, "embeds-stale", "four-arm").cases[0]
    assert case.verdict.code == "FAIL_STALE_STATE"
    bcg, eager = case.arm("bcg_normal"), case.arm("eager_normal")
    assert bcg.token_ids == eager.token_ids
    record = next(r for r in bcg.evidence.freshness if r.input == "input_embeds")
    assert record.stale == record.rows and record.first[:3] == (0, 1, 2)
    # The report says it on the arm's evidence line; the arm served first is fresh.
    assert "INPUT NOT FRESH: input_embeds of the prefill 48 graph, 48 stale row(s)" in arm_evidence_text(bcg)
    assert "every input fresh (3 input(s) of prefill 48)" in arm_evidence_text(case.arm("bcg_zero_deepstack"))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_fixed_runner_lists_every_input_of_every_graph_and_each_is_fresh(request, dtype):
    loaded = request.getfixturevalue("tiny" if dtype == "float32" else "tiny_bf16_witness")
    run = _run(loaded, "fixed", "chunked")
    assert run.verdict.code == "PASS", run.verdict
    graphs = {}
    for case in run.cases:
        for req in case.requests:
            for arm in req.arms:
                for record in arm.evidence.freshness:
                    assert record.offending == 0 and record.rows > 0, record
                    graphs.setdefault(record.graph, set()).add(record.input)
    # A chunk's context graph reads the past too; nothing is read that the runner does not hold.
    context = next(names for graph, names in graphs.items() if graph.startswith("context"))
    assert context == {"input_embeds", "positions", "deepstack", "past_keys", "past_values", "past_mask"}
    assert not any(name.startswith("unnamed") for names in graphs.values() for name in names)


# --- --poison: the sentinel before every refresh, read back from the buffers -------------------------

@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_poison_leaves_the_fixed_runner_s_answers_as_they_were(request, dtype):
    """Every row the fixed runner must write is written, so the sentinel is gone from all of them and
    the replays read what they read without it: the same tokens, the same verdict, chunks and their
    context graphs included (the mask, a boolean, gets no sentinel and says so)."""
    loaded = request.getfixturevalue("tiny" if dtype == "float32" else "tiny_bf16_witness")
    plain, poisoned = _run(loaded, "fixed", "chunked"), _run(loaded, "fixed", "chunked", poison=True)
    assert poisoned.verdict.code == plain.verdict.code == "PASS", poisoned.verdict
    for a, b in zip(plain.cases, poisoned.cases):
        for x, y in zip(a.requests, b.requests):
            assert [arm.token_ids for arm in x.arms] == [arm.token_ids for arm in y.arms]
    counted = {r.input: r.poisoned for r in _records(poisoned)}
    assert counted == {"input_embeds": 0, "positions": 0, "deepstack": 0, "past_keys": 0, "past_values": 0,
                       "past_mask": None}
    assert all(r.poisoned is None for r in _records(plain))


# The rows each variant leaves holding the sentinel, per input: a skipped refresh leaves every row
# it must write, a kept tail the padding; a write with wrong values (one mRoPE row for three) leaves
# none, and the witness alone sees it.
POISONED = [("embeds-stale", "input_embeds", "all"), ("mrope-stale", "positions", "all"),
            ("embeds-tail-kept", "input_embeds", "padding"), ("mrope-one-row", "positions", "none")]


@pytest.mark.parametrize("variant, name, rows", POISONED, ids=[p[0] for p in POISONED])
def test_poison_stays_in_the_rows_a_variant_did_not_write(tiny, variant, name, rows):
    run = _run(tiny, variant, "four-arm", poison=True)
    assert run.cases[0].verdict.code.startswith("FAIL_"), run.cases[0].verdict
    bcg = run.cases[0].arm("bcg_normal")
    record = next(r for r in bcg.evidence.freshness if r.input == name)
    bucket, tokens = bcg.evidence.buckets[0], bcg.evidence.prompt_tokens
    expected = {"all": record.rows, "padding": bucket - tokens, "none": 0}[rows]
    assert record.poisoned == expected > 0 or rows == "none" and record.poisoned == 0, record


def test_rows_that_kept_the_sentinel_fail_even_where_the_witness_saw_a_write():
    """The second opinion stands on its own: a record the witness found fresh whose rows still held
    the sentinel (a write the witness credited that never landed) is a FAIL naming the input."""
    from parity.evidence import Evidence, InputFreshness
    from parity.judge.verdict import _freshness_verdict

    class Arm:
        name = "bcg_normal"
        evidence = Evidence(1, 1, True, (48,), 1, freshness=(InputFreshness("prefill 48", "positions", 1, 39, poisoned=3),))

    class Group:
        needed, arms = ("bcg_normal",), {"bcg_normal": Arm()}

        @staticmethod
        def where(n):
            return ""

    verdict = _freshness_verdict((Group(),), 1)
    assert verdict.code == "FAIL_INPUT_NOT_FRESH" and "still held the poison sentinel" in verdict.reason


# --- the witness on a toy body: which rows a write covers, what a graph reads ------------------------

def test_a_write_through_any_slice_marks_exactly_its_rows():
    witness = FreshnessWitness([])
    positions = torch.zeros(3, 10, dtype=torch.long)
    embeds = torch.zeros(10, 4)
    witness.watch("positions", positions, token_axis=1)
    witness.watch("input_embeds", embeds)
    with witness.writes("a"):
        positions[:, 2:5].fill_(1)
        embeds[6:8].copy_(torch.ones(2, 4))
    owners = {w.name: w.owners for w in witness._watched.values()}
    assert [r for r in range(10) if owners["positions"].owner(r) is not None] == [2, 3, 4]
    assert [r for r in range(10) if owners["input_embeds"].owner(r) is not None] == [6, 7]
    with witness.writes("b"):
        embeds.view(-1)[5:9].zero_()  # a flat view inside row 1: covers that row only
    assert owners["input_embeds"].owner(1).tag == "b" and owners["input_embeds"].owner(0) is None


class _ReadsAGlobal(nn.Module):
    """A body that reads a tensor the runner does not hold: an unnamed per-call input."""

    deepstack_count = 0
    hidden_size = HIDDEN

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(HIDDEN))  # a parameter: not a per-call input
        self.side = torch.ones(HIDDEN)  # neither parameter nor buffer, nor a runner's slot

    def forward(self, embeds, positions, deepstack, probe=False):
        return (embeds * self.scale + self.side,)


def test_capture_lists_the_runners_buffers_and_any_other_tensor_the_graph_reads():
    runner = make_runner(body=_ReadsAGlobal(), buckets=(8,))
    embeds, positions, _ = inputs(5)
    runner.replay(embeds, positions, None)
    records = {r.input: r for r in runner.freshness(embeds, positions, None)}
    # The parameter is not an input; positions, supplied and never read, is listed with nothing lost.
    assert set(records) == {"input_embeds", "unnamed (4,) float32", "positions"}
    assert records["positions"].offending == 0 and records["unnamed (4,) float32"].rows == 0


def test_a_runner_that_skips_a_refresh_is_named_by_the_request_that_wrote_last():
    runner = make_runner(RunnerVariant.EMBEDS_STALE, buckets=(8,))
    embeds, positions, deepstack = inputs(5)
    runner.replay(embeds, positions, deepstack, owner="first")
    runner.replay(embeds, positions, deepstack, owner="second")  # same shape: embeddings not copied
    record = next(r for r in runner.freshness(embeds, positions, deepstack) if r.input == "input_embeds")
    assert (record.stale, record.left_by, record.first[:2]) == (8, "first", (0, 1))
    fresh = make_runner(buckets=(8,))
    for owner in ("first", "second"):
        fresh.replay(embeds, positions, deepstack, owner=owner)
    assert all(r.offending == 0 for r in fresh.freshness(embeds, positions, deepstack))


def test_a_grown_buffer_keeps_its_rows_writers_and_a_graph_left_on_the_old_one_is_caught():
    runner = make_runner(RunnerVariant.GROWTH_REBIND, buckets=(4,))
    embeds, positions, deepstack = inputs(3)
    runner.replay(embeds, positions, deepstack, owner="before")
    runner.eager(*inputs(6), owner="long")  # past every bucket: the DeepStack buffer grows
    runner.replay(embeds, positions, deepstack * 2, owner="after")
    record = next(r for r in runner.freshness(embeds, positions, deepstack * 2) if r.input == "deepstack")
    assert record.stale == 4 and record.left_by == "before"  # the graph still reads the old buffer


def test_supplied_rows_count_along_the_token_axis():
    assert Supplied(torch.zeros(3, 7), token_axis=1).rows == 7 and Supplied(torch.zeros(5, WIDTH)).rows == 5


# --- power from the witness: a checkpoint whose DeepStack does not move the answer ------------------------

@pytest.fixture(scope="module")
def weak_deepstack(tmp_path_factory):
    """tiny-qwen3-vl saved with its DeepStack mergers scaled by 1e-8 (`parity models save
    --deepstack-scale`): the features stay non-zero, their effect on the answer is far below any
    dtype's tolerance."""
    from click.testing import CliRunner

    from parity.cli import cli

    folder = tmp_path_factory.mktemp("weak") / "checkpoint"
    result = CliRunner().invoke(cli, ["models", "save", "tiny-qwen3-vl", str(folder), "--device", "cpu",
                                      "--dtype", "float32", "--deepstack-scale", "1e-8"], prog_name="parity")
    assert result.exit_code == 0, result.output
    return folder


def _weak_run(folder, runner: str, dtype: str):
    from parity.models import load_model

    return _run(load_model(str(folder), device="cpu", dtype=dtype), runner, "four-arm")


def test_without_power_the_answers_prove_nothing(weak_deepstack) -> None:
    (case,) = _weak_run(weak_deepstack, "fixed", "float32").cases
    assert case.verdict.code == "INCONCLUSIVE_NO_POWER", case.verdict.reason


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_without_power_the_witness_still_fails_a_runner_that_drops_deepstack(weak_deepstack, dtype: str) -> None:
    (case,) = _weak_run(weak_deepstack, "legacy", dtype).cases
    assert case.verdict.code == "FAIL_DEEPSTACK_DROPPED", case.verdict.reason
    assert "graph read deepstack rows" in case.verdict.reason and "freshness witness" in case.verdict.reason
