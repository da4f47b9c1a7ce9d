"""The freshness witness's hooks inside SGLang's prefill graph runner (design §6), on a small runner
shaped like 0.5.23's `PrefillCudaGraphRunner` where the hooks touch it: `capture_one_shape` captures
a bucket's body with parity's emulated graph; `execute` fills the registry's slots from the batch,
hands the body its live embeddings through `_fill_input_embeds_slot`, and has the backend replay.

The same hooks on the real runner, with real SGLang servers, run in the SGLang CI stage
(test_sglang_real_server.py). Nothing here needs SGLang installed.
"""

from __future__ import annotations

import types
from pathlib import Path

import pytest
import torch

from parity.engines.channel import TapChannel
from parity.engines.evidence import freshness
from parity.engines.sglang.freshness import SGLangFreshness
from parity.evidence import merge_freshness
from parity.runner import emulated_graph

HIDDEN, BLOCKS, MAX_TOKENS = 4, 2, 16


class Registry:
    """The runner's buffer registry: its named slots, each over the most tokens a bucket holds."""

    def __init__(self) -> None:
        self.slots = {"input_ids": torch.zeros(MAX_TOKENS, dtype=torch.long),
                      "positions": torch.zeros(MAX_TOKENS, dtype=torch.long),
                      "mrope_positions": torch.zeros(3, MAX_TOKENS, dtype=torch.long),
                      "input_embeds": torch.zeros(MAX_TOKENS, HIDDEN)}

    def slot_names(self):
        return list(self.slots)

    def get_slot(self, name: str):
        return types.SimpleNamespace(buffer=self.slots[name])


class Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(HIDDEN), requires_grad=False)
        self.num_deepstack_embeddings = BLOCKS


class Runner:
    """Where the hooks touch SGLang's runner. `deepstack`: the body reads a DeepStack slot (parity's
    fix); `mrope`: it rotates by the mRoPE slot, else by the one-row positions (Omni's released body);
    `stale_on_repeat`: a slot the refresh leaves as it was when the bucket repeats (a planted bug)."""

    def __init__(self, deepstack: bool = True, mrope: bool = True, stale_on_repeat: str | None = None) -> None:
        self.buffer_registry = Registry()
        self.max_num_tokens = MAX_TOKENS
        self.model_runner = types.SimpleNamespace(model=Model(), token_to_kv_pool=None, req_to_token_pool=None)
        self._input_embeds_arg_idx = 3
        self._parity_deepstack_slot = types.SimpleNamespace(
            slot=torch.zeros(MAX_TOKENS, HIDDEN * BLOCKS) if deepstack else None)
        self.mrope, self.stale_on_repeat, self.last_bucket, self.repeat = mrope, stale_on_repeat, None, False
        self.graphs: dict = {}
        self.backend = types.SimpleNamespace(replay=lambda key, batch: self.graphs[key.size].replay())

    def _body(self, size: int) -> torch.Tensor:
        slots = self.buffer_registry.slots
        x = slots["input_embeds"][:size] * self.model_runner.model.weight
        rotation = slots["mrope_positions"][:, :size].sum(0) if self.mrope else slots["positions"][:size]
        x = x + rotation.unsqueeze(1).to(x.dtype)
        slot = self._parity_deepstack_slot.slot
        if slot is not None:
            x = x + slot[:size].reshape(size, BLOCKS, HIDDEN).sum(1)
        return x

    def capture_one_shape(self, size: int, *, prefix_num_chunks: int = 0) -> None:
        self.buffer_registry.slots["input_ids"][:size].zero_()  # the capture's own preparation: not the graph's
        self.graphs[size], _ = emulated_graph.capture(lambda: self._body(size), graph_class=emulated_graph.EngineEmulatedGraph)

    def execute(self, forward_batch) -> None:
        n = forward_batch.input_ids.shape[0]
        bucket = next(b for b in sorted(self.graphs) if b >= n)
        slots = self.buffer_registry.slots
        self.repeat, self.last_bucket = bucket == self.last_bucket, bucket
        for name in ("input_ids", "positions", "mrope_positions"):
            if name == self.stale_on_repeat and self.repeat:
                continue
            live = getattr(forward_batch, name)
            slots[name].narrow(-1, 0, bucket).zero_()
            slots[name].narrow(-1, 0, n).copy_(live)
        # The eager model forward, then the body's replay (replay_layer_forward).
        embeds = forward_batch.embeds
        layer_kwargs = {"input_deepstack_embeds": forward_batch.deepstack}
        self._fill_input_embeds_slot((forward_batch.input_ids, None, forward_batch, embeds), layer_kwargs, bucket)
        self.backend.replay(types.SimpleNamespace(size=bucket, variant_label=None), types.SimpleNamespace(
            input_ids=slots["input_ids"][:bucket]))

    def _fill_input_embeds_slot(self, args, layer_kwargs, static_num_tokens: int) -> None:
        if not (self.stale_on_repeat == "input_embeds" and self.repeat):
            slot = self.buffer_registry.slots["input_embeds"]
            slot[:static_num_tokens].zero_()
            slot[:args[3].shape[0]].copy_(args[3])
        deepstack = self._parity_deepstack_slot.slot
        if deepstack is not None:
            deepstack[:static_num_tokens].zero_()
            if layer_kwargs["input_deepstack_embeds"] is not None:
                deepstack[:args[3].shape[0]].copy_(layer_kwargs["input_deepstack_embeds"])


def hooked(runner: Runner, channel: TapChannel) -> Runner:
    """The witness's hooks on the runner, as SGLang's hook registry applies AROUND hooks."""
    witness = SGLangFreshness(channel)
    for name, hook in (("capture_one_shape", witness.around_capture_one_shape), ("execute", witness.around_execute),
                       ("_fill_input_embeds_slot", witness.around_fill)):
        original = getattr(Runner, name)
        setattr(runner, name, lambda *a, _h=hook, _o=original, **k: _h(_o, runner, *a, **k))
    return runner


def batch(n: int, seed: int, image: bool = True):
    g = torch.Generator().manual_seed(seed)
    positions = torch.arange(n) + seed
    return types.SimpleNamespace(
        input_ids=torch.randint(1, 100, (n,), generator=g), positions=positions,
        mrope_positions=torch.stack([positions, positions + 1, positions + 2]), out_cache_loc=torch.arange(n),
        embeds=torch.randn(n, HIDDEN, generator=g),
        deepstack=torch.randn(n, HIDDEN * BLOCKS, generator=g) if image else None)


@pytest.fixture
def channel(tmp_path: Path) -> TapChannel:
    channel = TapChannel(tmp_path)
    channel.create()
    return channel


def serve(runner: Runner, channel: TapChannel, batches) -> list:
    """Each batch as a tagged request (tags r0, r1, ...); the witness's records per request."""
    runner.capture_one_shape(8)
    runner.capture_one_shape(16)
    records = []
    for i, b in enumerate(batches):
        channel.arm("record", f"r{i}")
        runner.execute(b)
        channel.disarm()
        records.append([r for _, rs in channel.freshness(f"r{i}") for r in rs])
    return records


def by_input(records) -> dict:
    return {r.input: r for r in records}


def test_a_fixed_runner_lists_what_its_graph_reads_and_every_input_is_fresh(channel) -> None:
    runner = hooked(Runner(), channel)
    seen = serve(runner, channel, [batch(6, 1), batch(5, 2, image=False), batch(7, 3), batch(12, 4)])
    for records in seen:
        assert set(by_input(records)) == {"input_embeds", "mrope_positions", "deepstack"}  # not input_ids, not weights
        assert all(r.fresh and r.rows > 0 for r in records), records
    assert {r.graph for r in seen[3]} == {"prefill 16"}


def test_a_released_body_without_deepstack_drops_the_rows_the_image_supplies(channel) -> None:
    runner = hooked(Runner(deepstack=False), channel)
    image, text = serve(runner, channel, [batch(6, 1), batch(5, 2, image=False)])
    dropped = by_input(image)["deepstack"]
    assert dropped.unwritten == 6 and dropped.first[:3] == (0, 1, 2)
    assert by_input(text)["deepstack"].fresh and by_input(text)["deepstack"].rows == 0  # listed, nothing to drop


def test_a_body_rotating_by_one_row_positions_drops_the_mrope_positions(channel) -> None:
    runner = hooked(Runner(mrope=False), channel)
    (records,) = serve(runner, channel, [batch(6, 1)])
    assert "positions" in by_input(records) and by_input(records)["positions"].fresh
    assert by_input(records)["mrope_positions"].unwritten == 6


@pytest.mark.parametrize("planted", ["mrope_positions", "input_embeds"])
def test_a_refresh_skipped_when_the_bucket_repeats_is_stale_and_names_who_left_it(channel, planted: str) -> None:
    runner = hooked(Runner(stale_on_repeat=planted), channel)
    first, second = serve(runner, channel, [batch(6, 1), batch(6, 2)])
    assert all(r.fresh for r in first)
    stale = by_input(second)[planted]
    assert stale.stale == 8 and stale.left_by == "r0"  # the bucket's rows: SGLang zeroes its padding per batch
    assert all(r.fresh for r in second if r.input != planted)
    # The file names the image whose request left them, not the server's tag.
    assert freshness([tuple(second)], {"r0": "a" * 64})[[r.input for r in second].index(planted)].left_by == "a" * 64


def test_records_of_unsent_forwards_stay_in_the_server(channel) -> None:
    runner = hooked(Runner(), channel)
    runner.capture_one_shape(8)
    runner.execute(batch(6, 1))  # the engine's own warm-up: no tag armed
    assert not (channel.folder / "freshness.jsonl").exists()
    channel.arm("record", "r0")
    runner.execute(batch(6, 2))
    assert merge_freshness(*(rs for _, rs in channel.freshness("r0")))[0].replays == 1
