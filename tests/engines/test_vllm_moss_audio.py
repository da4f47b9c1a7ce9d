"""parity's fix for MossAudio's per-step DeepStack attribute, with vLLM's own MossAudioModel methods.

MossAudio keeps its audio DeepStack as an attribute that each step's embedding sets to new tensors
and the forward reads, then resets (vllm-0.34.md §6): a FULL or breakable graph captured at start-up
reads it as it was then, None, and drops DeepStack for every later step. parity's fix gives it a slot
(deepstack_clear.py). Here vLLM's real `embed_input_ids`, `_cache_deepstack_input_embeds` and `forward`
run on a stub instance that holds only what they read, around a stand-in language model that adds
each level's rows to the embeddings; a FULL step is the forward captured into parity's emulated graph
at start-up and replayed, so none of its Python runs. No MossAudio checkpoint exists to serve, so
this is where the fix meets the released code (CI's vLLM stages).
"""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

from parity.engines.vllm import deepstack_clear  # noqa: E402
from tests.engines.servers import installed, real_vllm_marks  # noqa: E402

_FOUND = installed("vllm")
pytestmark = real_vllm_marks()

LEVELS, HIDDEN, ROWS, SIZES = 2, 8, 32, (8, 16)
AUDIO = ([1, 2, *[9] * 5, 3], (2, 5))  # 8 tokens, 5 of them audio at rows 2..6
LONG_AUDIO = ([1, *[9] * 12, 3, 4, 5], (1, 12))  # 16 tokens, 12 audio rows
TEXT = ([1, 2, 3, 4, 5, 6, 7, 8], None)


class Server:
    """One model process: the model built, each capture size's forward captured (FULL) at start-up
    with the attribute as the profile run leaves it (None), then one prefill step per request."""

    def __init__(self, mode: str, fix: bool = False, levels: int = LEVELS) -> None:
        import torch
        from vllm.model_executor.models.moss_audio import MossAudioModel

        class LanguageModel(torch.nn.Module):  # MossQwen3ForCausalLM's DeepStack add, without its layers
            def __init__(self) -> None:
                super().__init__()
                self.embed = torch.nn.Embedding(64, HIDDEN)
                torch.nn.init.normal_(self.embed.weight, generator=torch.Generator().manual_seed(0))

            def embed_input_ids(self, ids):
                return self.embed(ids)

            def forward(self, input_ids, positions, intermediate_tensors=None, inputs_embeds=None,
                        deepstack_input_embeds=None):
                hidden = inputs_embeds * 1.0
                for level in range(levels):
                    key = f"deepstack_input_embeds_{level}"
                    if deepstack_input_embeds is not None and key in deepstack_input_embeds.tensors:
                        hidden = hidden + deepstack_input_embeds[key]
                return hidden

        cls = MossAudioModel
        self.fix = deepstack_clear.DeepStackClear(None, capturing=lambda: False) if fix else None
        model = object.__new__(cls)
        torch.nn.Module.__init__(model)
        model.language_model = LanguageModel()
        model.deepstack_audio_merger_list = torch.nn.ModuleList(torch.nn.Identity() for _ in range(levels))
        model.config = SimpleNamespace(language_config=SimpleNamespace(hidden_size=HIDDEN))
        model.vllm_config = SimpleNamespace(scheduler_config=SimpleNamespace(max_num_batched_tokens=ROWS),
                                            model_config=SimpleNamespace(dtype=torch.float32))
        model._has_oov_mm_tokens = False
        model.deepstack_input_embeds = None
        self.model = model
        self.embed, self.forward = cls.embed_input_ids, cls.forward
        if fix:  # as the plugin installs the fix on the class (plugin.TARGETS); the model is built, then
            deepstack_clear.wrap_attribute_owner(lambda built: None, self.fix)(model)  # __init__'s wrapper ends
            cache = deepstack_clear.wrap_attribute_setter(cls._cache_deepstack_input_embeds, self.fix)
            model._cache_deepstack_input_embeds = cache.__get__(model)
            self.forward = deepstack_clear.wrap_attribute_forward(cls.forward, self.fix)
        self.mode = mode
        self.persistent = torch.zeros(2 * ROWS, HIDDEN)  # the runner's inputs_embeds, sliced to the padded size
        self.positions = torch.arange(2 * ROWS)
        self.graphs, self.outputs = {}, {}
        if mode == "FULL":
            from parity.runner.emulated_graph import EmulatedGraph, graph

            for size in SIZES:
                self.graphs[size] = EmulatedGraph()
                with graph(self.graphs[size]):
                    self.outputs[size] = self._forward(size)

    def _forward(self, size: int):
        return self.forward(self.model, None, self.positions[:size], inputs_embeds=self.persistent[:size])

    def _prepare(self, state, ids, features, mask):
        """DefaultModelState.prepare_inputs_embeds, as far as the model sees it."""
        embeds = self.embed(self.model, ids, features, is_multimodal=mask)
        self.persistent[:len(ids)] = embeds
        return self.persistent

    def request(self, prompt: tuple[list[int], tuple[int, int] | None], seed: int = 1):
        """One prefill step's hidden states (the stand-in LM's output) for the prompt's rows."""
        import torch

        ids, audio = prompt
        size = min((s for s in SIZES if s >= len(ids)), default=len(ids))  # eager past the largest size
        features, mask = None, torch.zeros(len(ids), dtype=torch.bool)
        if audio is not None:
            start, count = audio
            mask[start:start + count] = True
            # The encoder's output, packed as MossAudio packs it: [main | level 0 | level 1 ...].
            features = [torch.randn(count, HIDDEN * (1 + LEVELS), generator=torch.Generator().manual_seed(seed))]
        state = SimpleNamespace(model=self.model)
        prepare = deepstack_clear.wrap_step(self._prepare, self.fix) if self.fix else self._prepare
        prepare(state, torch.tensor(ids), features, mask)
        if self.mode == "FULL":
            self.graphs[size].replay()
            hidden = self.outputs[size].clone()
        else:
            hidden = self._forward(size)
        return hidden[:len(ids)]


def _served(server: Server, *prompts):
    return [server.request(p, seed=i + 1) for i, p in enumerate(prompts)]


def test_the_released_full_graph_drops_the_audio_deepstack_and_the_fix_carries_it() -> None:
    import torch

    order = (AUDIO, TEXT, LONG_AUDIO, AUDIO, TEXT)
    eager = _served(Server("NONE"), *order)
    released = _served(Server("FULL"), *order)
    fixed = _served(Server("FULL", fix=True), *order)
    # The negative control: the released graph adds nothing on an audio request's rows 2..6, as if
    # DeepStack were zeroed; the text rows it leaves alone.
    dropped = (released[0] - eager[0]).abs().sum(dim=1) > 0
    assert dropped.nonzero().flatten().tolist() == [2, 3, 4, 5, 6]
    # With the fix every step answers as the eager server: each audio step's own rows, and no row an
    # earlier step left (the text after audio, the shorter audio after the longer one).
    for got, want in zip(fixed, eager):
        assert torch.equal(got, want)


def test_the_fix_changes_nothing_eagerly() -> None:
    import torch

    order = (AUDIO, TEXT, LONG_AUDIO, TEXT)
    for got, want in zip(_served(Server("NONE", fix=True), *order), _served(Server("NONE"), *order)):
        assert torch.equal(got, want)


def test_a_step_longer_than_the_slot_fails_closed() -> None:
    server = Server("NONE", fix=True)
    with pytest.raises(deepstack_clear.FixRefused, match="exceeds the slot's 32"):
        server.request(([1, *[9] * 33, 2], (1, 33)))


def test_a_model_without_a_width_is_refused_in_one_line_naming_its_class() -> None:
    model = Server("NONE").model
    del model.config
    fix = deepstack_clear.DeepStackClear(None, capturing=lambda: False)
    with pytest.raises(deepstack_clear.FixRefused, match="^MossAudioModel keeps DeepStack as a per-step attribute"):
        deepstack_clear.wrap_attribute_owner(lambda built: None, fix)(model)


def test_a_model_without_deepstack_levels_gets_no_slot() -> None:
    import torch

    plain = Server("FULL", fix=True, levels=0)
    plain.request(TEXT)
    assert getattr(plain.model, deepstack_clear.SLOT_ATTR, None) is None
    assert torch.equal(plain.request(TEXT), Server("NONE", levels=0).request(TEXT))


def test_a_capture_before_the_slot_was_made_is_refused() -> None:
    """A slot made inside a capture would be the graph's own memory, zeroed by every replay: the
    forward refuses to capture a model whose slot was not made with it."""
    server = Server("NONE")
    fix = deepstack_clear.DeepStackClear(None, capturing=lambda: True)
    forward = deepstack_clear.wrap_attribute_forward(type(server.model).forward, fix)
    with pytest.raises(deepstack_clear.FixRefused, match="no DeepStack slot was made with it"):
        forward(server.model, None, server.positions[:8], inputs_embeds=server.persistent[:8])
