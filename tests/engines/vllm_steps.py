"""vLLM's own DeepStack methods, dispatcher and step preparation driven step by step on stub
objects, with parity's tap (and fix) around them: what `test_vllm_real.py` runs where vLLM is
installed (a helper module; vLLM is imported only when an Engine is built)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

from parity.engines.channel import TapChannel
from parity.engines.vllm import deepstack_clear, tap as taps

LEVELS, HIDDEN, ROWS = 3, 8, 64


class Engine:
    """vLLM's own classes on stub instances, parity's wrappers on them, one request at a time.

    `forward` does what Qwen3VLForConditionalGeneration.forward does around the language model
    (qwen3_vl.py:3205-3217): `_get` the buffer's first rows, the LM adds them, `_clear` after.
    Under FULL each capture size's forward is captured at start-up (before any request, as the
    worker does) into parity's emulated graph, and a FULL step is vLLM's own
    `CudaGraphManager.run_fullgraph` replaying it: the captured ops re-run on the tensors they
    captured, and no Python of the forward runs (no `_get`, no `_clear`).
    """

    def __init__(self, tmp_path: Path, cudagraph_mode: str, control: str = "record", fix: bool = False) -> None:
        import torch
        from vllm.config.compilation import CUDAGraphMode
        from vllm.model_executor.models.qwen3_vl import Qwen3VLForConditionalGeneration
        from vllm.v1.worker.gpu.cudagraph_utils import CudaGraphManager
        from vllm.v1.worker.gpu.model_states.default import DefaultModelState
        from vllm.v1.worker.gpu.model_states.interface import ModelState

        self.channel = TapChannel(tmp_path / f"tap-{cudagraph_mode}")
        self.channel.create()
        self.control = control
        self.tap = taps.StepTap(self.channel, capturing=lambda: False)
        model = object.__new__(Qwen3VLForConditionalGeneration)
        torch.nn.Module.__init__(model)
        embedding = torch.nn.Embedding(512, HIDDEN)
        torch.nn.init.normal_(embedding.weight, generator=torch.Generator().manual_seed(0))
        model.use_deepstack, model.deepstack_num_level = True, LEVELS
        model.visual_dim, model.multiscale_dim = HIDDEN, HIDDEN * LEVELS
        model.deepstack_input_embeds = [torch.zeros(ROWS, HIDDEN) for _ in range(LEVELS)]
        model.deepstack_input_embeds_num_tokens = 0
        model.language_model = SimpleNamespace(embed_input_ids=embedding)
        model.config = SimpleNamespace(text_config=SimpleNamespace(hidden_size=HIDDEN))
        self.model = model
        # The real setter with parity's wrappers, as the plugin installs them on the class: the fix
        # (when asked for) first, the tap around it.
        setter, prepare = Qwen3VLForConditionalGeneration._set_deepstack_input_embeds, DefaultModelState.prepare_inputs_embeds
        if fix:
            clear = deepstack_clear.DeepStackClear(None, capturing=lambda: False)
            setter, prepare = deepstack_clear.wrap_setter(setter, clear), deepstack_clear.wrap_step(prepare, clear)
        model._set_deepstack_input_embeds = taps.wrap_setter(setter, self.tap).__get__(model)

        class Gathered(ModelState):  # what DefaultModelState's super().gather_mm_embeddings returns
            def gather_mm_embeddings(self, input_batch, draft_lookahead=0):
                return self.mm

        class State(DefaultModelState, Gathered):
            pass

        state = object.__new__(State)
        state.model, state.supports_mm_inputs, state.mm_pruner, state.prompt_embeds_state = model, True, None, None
        state.execute_mm_encoder = lambda inputs: None
        persistent = torch.zeros(ROWS, HIDDEN)  # the real runner's inputs_embeds, sliced to the padded size

        def get_inputs_embeds(ids, mm, is_mm):  # as EncoderRunner.get_inputs_embeds calls the model
            persistent[:len(ids)] = model.embed_input_ids(ids, mm, is_multimodal=is_mm)
            return persistent

        state.encoder_runner = SimpleNamespace(get_inputs_embeds=get_inputs_embeds)
        self.state = state
        self.prepare = taps.wrap_step(prepare, self.tap)

        # What the manager's __init__ would set, for every supported release at once (the names each
        # reads differ: 0.34 keys prefill graphs by tokens and decode graphs by requests, versions.py).
        manager = object.__new__(CudaGraphManager)
        manager.vllm_config = SimpleNamespace(speculative_config=None, uniform_decode_query_len=1,
                                              cache_config=SimpleNamespace(use_kda_recoverssm=False))
        manager.max_num_reqs, manager.decode_query_len, manager.varlen_decode = 4, 1, False
        manager.decode_query_lens, manager.decode_request_sizes, manager.decode_max_reqs = {1: 4}, None, {1: 4}
        manager.cudagraph_mode = CUDAGraphMode[cudagraph_mode]
        sizes = [1, 2, 4, 8, 16, 24, 32, 40, 48]
        manager.compilation_config = SimpleNamespace(
            cudagraph_capture_sizes=sizes, max_cudagraph_capture_size=48, prefill_cudagraph_capture_token_sizes=sizes,
            decode_cudagraph_capture_request_sizes=[1, 2, 4], max_decode_cudagraph_capture_tokens=None)
        manager.ubatch_runner, manager.lora_capture_cases = None, [0]
        manager._lora_dispatch_map, manager._max_lora_case = {}, 0
        manager._candidates, manager._capture_descs, manager.use_breakable_cg = {}, {}, False
        manager._decode_descs = {}
        manager._init_candidates()
        manager.graphs = {}
        self.persistent, self.manager, self.outputs = persistent, manager, {}
        for desc in manager._capture_descs.get(CUDAGraphMode.FULL, ()):  # start-up: the counter is 0
            self._capture(desc)
        manager._graphs_captured = bool(manager.cudagraph_mode)
        self.dispatch = taps.wrap_dispatch(CudaGraphManager.dispatch, self.tap).__get__(manager)
        self.served = 0

    def forward(self, n: int):
        """The LM's DeepStack add on the padded rows, then the model's clear (its Python)."""
        hidden = self.persistent[:n] + sum(self.model._get_deepstack_input_embeds(n).tensors.values())
        self.model._clear_deepstack_input_embeds(n)
        return hidden

    def _capture(self, desc) -> None:
        from parity.runner.emulated_graph import EmulatedGraph, graph

        captured = EmulatedGraph()
        with graph(captured):
            self.outputs[desc.num_tokens] = self.forward(desc.num_tokens)
        self.manager.graphs[desc] = captured

    def request(self, ids: list[int], image_rows: tuple[int, int] | None, seed: int = 1):
        """One prefill step; (its hidden states [tokens, hidden], the dispatch mode, the tap's record)."""
        import torch

        self.served += 1
        tag = f"tag{self.served}"
        tokens = len(ids)
        desc = self.dispatch(1, tokens, None, 0, max_query_len=None)
        batch = SimpleNamespace(input_ids=torch.tensor(ids + [0] * (desc.num_tokens - tokens)), num_tokens=tokens,
                                num_tokens_after_padding=desc.num_tokens, req_ids=[f"chatcmpl-{tag}-0a1b2c3d"],
                                num_reqs=1)
        mm, mask = [], torch.zeros(tokens, dtype=torch.bool)
        if image_rows is not None:
            start, count = image_rows
            mask[start:start + count] = True
            features = torch.randn(count, HIDDEN * (1 + LEVELS), generator=torch.Generator().manual_seed(seed))
            mm = [features]  # the encoder output: [main | DeepStack levels]
        self.state.mm = (mm, mask)
        self.channel.arm(self.control, tag)
        try:
            embeds = self.prepare(self.state, {}, batch, None)
        finally:
            self.channel.disarm()
        # The rows a captured graph reads are the step's embeddings: the runner's persistent buffer.
        assert embeds.untyped_storage().data_ptr() == self.persistent.untyped_storage().data_ptr()
        if desc.cg_mode.name == "FULL":
            self.manager.run_fullgraph(desc)  # vLLM's own replay of the graph captured at start-up
            hidden = self.outputs[desc.num_tokens].clone()
        else:
            hidden = self.forward(desc.num_tokens)
        entry = self.channel.entries(tag)[-1]
        return hidden[:tokens], desc.cg_mode.name, entry


IMAGE_PROMPT = [1, 2, 3, *[9] * 16, 4, 5, 6, 7, 8]  # template, 16 image tokens, text: 24 tokens
TEXT_PROMPT = [1, 2, 3, *range(10, 30), 8]  # 24 tokens, no image
