"""The freshness witness inside vLLM's Model Runner V2 (design §6), on a small runner shaped like
0.34's where the witness touches it: a graph manager whose FULL graph is captured by parity's emulated
graph, input buffers written the way vLLM's Triton kernels write them (through memory no op-level
watch sees), an encoder runner that copies the step's embeddings into its buffer, and the model's
per-level DeepStack buffers.

The same witness inside real vLLM servers runs in the vLLM CI stage (test_vllm_real_server.py).
Nothing here needs vLLM installed.
"""

from __future__ import annotations

import types
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch

from parity.engines.channel import Control, TapChannel
from parity.engines.vllm.freshness import VllmFreshness, graph_label
from parity.runner import emulated_graph

HIDDEN, LEVELS, MAX_TOKENS, MAX_REQS, BLOCK, MAX_LEN = 4, 2, 16, 4, 4, 64
BUCKET = 8


@dataclass(frozen=True)
class Mode:
    name: str


@dataclass(frozen=True)
class Desc:
    """vLLM's BatchExecutionDescriptor, where the witness reads it."""

    cg_mode: object
    num_tokens: int


FULL = Desc(Mode("FULL"), BUCKET)


class Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(HIDDEN), requires_grad=False)
        self.deepstack_input_embeds = [torch.zeros(MAX_TOKENS, HIDDEN) for _ in range(LEVELS)]

    def embed_input_ids(self, input_ids, multimodal_embeddings=None, is_multimodal=None):
        return input_ids.to(torch.float32).unsqueeze(1).expand(-1, HIDDEN) * 0.5


def kernel_write(buffer: torch.Tensor, index, values) -> None:
    """A write the way a Triton kernel makes it: through memory, unseen by any op-level watch."""
    buffer.numpy()[index] = np.asarray(values)


class Runner:
    """vLLM's pieces the witness reads. `clears`: the DeepStack buffers are zeroed after each step (parity's
    fix); `mrope_stale` / `embeds_stale`: that refresh is skipped when the step is as long as the last."""

    def __init__(self, clears: bool = True, mrope_stale: bool = False, embeds_stale: bool = False,
                 reads_deepstack: bool = True, tables_stale: bool = False) -> None:
        self.model = Model()
        self.input_buffers = types.SimpleNamespace(
            input_ids=torch.zeros(MAX_TOKENS, dtype=torch.int32), positions=torch.zeros(MAX_TOKENS, dtype=torch.int64),
            query_start_loc=torch.zeros(MAX_REQS + 1, dtype=torch.int32), seq_lens=torch.zeros(MAX_REQS, dtype=torch.int32),
            is_padding=torch.zeros(MAX_TOKENS, dtype=torch.bool))
        self.block_tables = types.SimpleNamespace(
            input_block_tables=[torch.zeros(MAX_REQS, 8, dtype=torch.int32)], slot_mappings=torch.zeros(1, MAX_TOKENS, dtype=torch.int64),
            block_tables=[torch.arange(MAX_REQS * 8, dtype=torch.int32).reshape(MAX_REQS, 8) + 1], block_sizes=[BLOCK])
        rope = types.SimpleNamespace(num_dims=3, positions=torch.zeros(3, MAX_TOKENS + 1, dtype=torch.int64),
                                     prefill_positions=torch.zeros(3 * MAX_REQS, MAX_LEN, dtype=torch.int32),
                                     prefill_delta=np.zeros(MAX_REQS, dtype=np.int32))
        encoder = types.SimpleNamespace(inputs_embeds=torch.zeros(MAX_TOKENS, HIDDEN), model=self.model)
        self.model_state = types.SimpleNamespace(rope_state=rope, encoder_runner=encoder)
        self.manager = types.SimpleNamespace(use_breakable_cg=False)
        self.clears, self.mrope_stale, self.embeds_stale = clears, mrope_stale, embeds_stale
        self.reads_deepstack, self.tables_stale = reads_deepstack, tables_stale
        self.requests = 0  # each request gets its own row of vLLM's per-request state
        self.last_tokens = None
        self.witness = None
        self.graph = None

    def body(self, n: int) -> torch.Tensor:
        x = self.model_state.encoder_runner.inputs_embeds[:n] * self.model.weight
        x = x + self.model_state.rope_state.positions[:, :n].sum(0).unsqueeze(1)
        for level in self.model.deepstack_input_embeds if self.reads_deepstack else ():
            x = x + level[:n]
        tables = self.block_tables
        return (x.sum() + self.input_buffers.seq_lens[:1].sum() + self.input_buffers.query_start_loc[:2].sum()
                + tables.input_block_tables[0][:1].sum() + tables.slot_mappings[:, :n].sum())

    def capture(self, witness: VllmFreshness) -> None:
        self.witness = witness
        witness.manager_capture(self.manager, self.model, self.model_state, self.input_buffers, self.block_tables,
                                self.model.deepstack_input_embeds)

        def create_forward_fn(desc, warmup):
            return lambda cg_mode: self.body(desc.num_tokens)

        forward = witness.forward_factory(self.manager, create_forward_fn)(FULL, False)
        self.graph, _ = emulated_graph.capture(lambda: forward("NONE"), graph_class=emulated_graph.EngineEmulatedGraph)

    def prefill(self, tag: str, tokens: list[int], image_rows: range = range(0)) -> None:
        """One request's whole prompt in one FULL replay of the bucket."""
        n = len(tokens)
        witness, buffers, rope = self.witness, self.input_buffers, self.model_state.rope_state
        witness.open(Control("normal", tag))
        repeated, self.last_tokens = self.last_tokens == n, n
        req, self.requests = self.requests % MAX_REQS, self.requests + 1
        source = self.block_tables.block_tables[0][req]
        kernel_write(buffers.input_ids, slice(0, n), tokens)
        kernel_write(buffers.positions, slice(0, n), range(n))
        kernel_write(buffers.query_start_loc, slice(0, 2), [0, n])
        kernel_write(buffers.seq_lens, slice(0, 1), [n])
        positions = np.stack([np.arange(n)] * 3) + np.array([[0], [len(image_rows)], [2 * len(image_rows)]])
        kernel_write(rope.prefill_positions, (slice(3 * req, 3 * req + 3), slice(0, n)), positions)
        if not (self.mrope_stale and repeated):
            kernel_write(rope.positions, (slice(0, 3), slice(0, n)), rope.prefill_positions[3 * req:3 * req + 3, :n])
        blocks = -(-n // BLOCK)
        if not (self.tables_stale and repeated):  # the gather writes the request's blocks alone, as vLLM's
            kernel_write(self.block_tables.input_block_tables[0], (0, slice(0, blocks)), source[:blocks])
        kernel_write(self.block_tables.slot_mappings, (0, slice(0, n)),
                     source.numpy()[np.arange(n) // BLOCK] * BLOCK + np.arange(n) % BLOCK)
        witness.dispatched(FULL)
        witness.step(types.SimpleNamespace(
            num_reqs=1, num_tokens=n, idx_mapping_np=np.array([req]), num_scheduled_tokens=np.array([n]),
            num_computed_tokens_np=np.array([0]), query_start_loc_np=np.array([0, n]), prefill_len_np=np.array([n]),
            has_prefill=True))
        embeds = self.model.embed_input_ids(torch.tensor(tokens))  # the encoder runner's embedding
        if not (self.embeds_stale and repeated):
            self.model_state.encoder_runner.inputs_embeds[:n] = embeds
        if image_rows:
            rows = torch.zeros(LEVELS, image_rows.stop, HIDDEN)
            rows[:, image_rows.start:] = 1.0 + torch.arange(LEVELS).view(-1, 1, 1)
            witness.set_deepstack(rows)
            for level, buffer in enumerate(self.model.deepstack_input_embeds):
                buffer[:image_rows.stop].copy_(rows[level])
        witness.replay()
        self.graph.replay()
        witness.close()
        if self.clears:
            for buffer in self.model.deepstack_input_embeds:
                buffer.zero_()


@pytest.fixture
def channel(tmp_path: Path) -> TapChannel:
    channel = TapChannel(tmp_path)
    channel.create()
    return channel


def served(channel: TapChannel, runner: Runner, requests) -> dict:
    runner.capture(VllmFreshness(channel))
    for tag, tokens, image in requests:
        runner.prefill(tag, tokens, image)
    return {tag: [r for _, records in channel.freshness(tag) for r in records] for tag, _, _ in requests}


IMAGE = ("image", [1, 2, 3, 4, 5, 6], range(2, 5))
TEXT = ("text", [7, 8, 9, 10, 11, 12], range(0))


def test_every_input_the_graph_reads_is_listed_and_a_correct_runner_keeps_each_fresh(channel) -> None:
    records = served(channel, Runner(), [IMAGE, TEXT])
    names = {r.input for r in records["text"]}
    assert names == {"input_embeds", "mrope_positions", "deepstack", "seq_lens", "query_start_loc",
                     "block_table[0]", "slot_mapping"}
    assert all(r.fresh for tag in records for r in records[tag]), records
    assert {r.graph for r in records["image"]} == {graph_label(FULL, True, False)} == {"prefill 8 (full)"}


def test_block_table_entries_past_a_request_s_blocks_may_hold_an_earlier_request_s(channel) -> None:
    """vLLM's gather writes a request's blocks alone; the entries past them, which attention never
    reads, keep a longer earlier request's: not stale."""
    records = served(channel, Runner(), [("long", list(range(1, 15)), range(0)), TEXT])
    assert all(r.fresh for r in records["text"]), records["text"]


def test_rows_a_kernel_rewrote_with_the_same_values_are_fresh(channel) -> None:
    """A write no op-level watch sees and no write look alike: a row holding what the step supplies
    is not judged stale (the same prompt twice, every buffer rewritten by 'kernels' with its values)."""
    records = served(channel, Runner(), [IMAGE, ("again", *IMAGE[1:])])
    assert all(r.fresh for r in records["again"]), records["again"]


def test_deepstack_an_image_left_uncleared_is_stale_and_names_the_image_request(channel) -> None:
    records = served(channel, Runner(clears=False), [IMAGE, TEXT])
    (deepstack,) = [r for r in records["text"] if r.input == "deepstack"]
    assert (deepstack.stale, deepstack.first[:3], deepstack.left_by) == (3, (2, 3, 4), "image")
    assert all(r.fresh for r in records["text"] if r.input != "deepstack")


@pytest.mark.parametrize("planted, name", [("mrope_stale", "mrope_positions"), ("embeds_stale", "input_embeds"),
                                           ("tables_stale", "block_table[0]")])
def test_an_input_left_from_the_last_step_of_the_same_length_is_stale_and_named(channel, planted, name) -> None:
    records = served(channel, Runner(**{planted: True}), [IMAGE, TEXT])
    (record,) = [r for r in records["text"] if not r.fresh]
    assert (record.input, record.left_by) == (name, "image")
    assert record.stale > 0 and record.miswritten == 0


def test_deepstack_a_step_supplies_to_a_graph_that_never_reads_it_is_a_drop(channel) -> None:
    """A graph captured without DeepStack (MossAudio's attribute as released, vllm-0.34.md §6): the
    image's rows are dropped; the text request supplies only zeros and loses nothing."""
    records = served(channel, Runner(reads_deepstack=False), [IMAGE, TEXT])
    (image,) = [r for r in records["image"] if r.input == "deepstack"]
    assert (image.unwritten, image.first) == (3, (2, 3, 4))
    assert [r for r in records["text"] if r.input == "deepstack"][0].fresh
