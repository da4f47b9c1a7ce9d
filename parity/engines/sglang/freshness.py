"""The freshness witness inside SGLang 0.5.23's prefill graph runner (design §6, "Every input a graph
reads, fresh for every request"): parity's one witness (`parity.runner.freshness`), on SGLang's buffers.

Three hooks on the real `PrefillCudaGraphRunner`, through SGLang's own hook registry, all in the
process that runs the model:

- around `capture_one_shape`: the capture of one bucket (its graph segments and the eager breaks
  between them) runs under the witness's capture mode, which lists every tensor it read that it did
  not produce and that is neither a weight of the model nor a KV or request-to-token pool (which the
  graph writes itself, or the engine's own bookkeeping holds): the graph's per-call inputs. Each is
  named by the runner's buffer registry slot that holds it (`input_embeds`, `positions`,
  `mrope_positions`, `out_cache_loc`, ...), `deepstack` for a DeepStack slot (parity's fix, or the
  engine's own `input_deepstack_embeds`), and `unnamed <shape> <dtype>` for anything else;
- around `execute`: everything written into a watched buffer from the batch's arrival to its replay
  is this forward's write, tagged with parity's request tag (`unsent` when parity sent none);
- around `_fill_input_embeds_slot`: the live embeddings and DeepStack the LM entry hands the body,
  what a correct refresh copies.

Right before the backend replays the bucket, the witness holds each input's rows to what the batch
supplies: a slot whose padding SGLang zeroes (every token-axis slot of 0.5.23's prefill registry,
`PaddingPolicy.ZERO`) must hold the live rows then zeros over the whole bucket; a DeepStack the body
never reads is dropped wherever it is non-zero. The records go to parity's channel, one line per
replay, under the request's tag; nothing is checked during the replay itself, so a GPU's real graph
is watched the same way.

Imported in the model process only when parity's tap is on (plugin.py).
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass, field
from typing import Any

from parity.engines.channel import TapChannel, process_role

RUNNER = "sglang.srt.model_executor.runner.prefill_cuda_graph_runner.PrefillCudaGraphRunner"
TARGETS = {  # tests/engines/test_sglang_contract.py checks each exists in the released wheel
    "capture_one_shape": f"{RUNNER}.capture_one_shape",
    "execute": f"{RUNNER}.execute",
    "fill": f"{RUNNER}._fill_input_embeds_slot",
}
DEEPSTACK = "deepstack"  # the witness's name for a DeepStack slot, whoever holds it
ENGINE_DEEPSTACK_SLOT = "input_deepstack_embeds"
# ForwardBatch fields a registry slot of the same name is filled from (copy_from_fb slots).
BATCH_FIELDS = ("input_ids", "positions", "out_cache_loc", "mrope_positions")
UNSENT = "unsent"  # the tag of a forward parity sent no request for (the engine's own warm-up)
_STATE = "_parity_freshness"


def graph_label(size: int, variant: str | None) -> str:
    """"prefill 48", "prefill 48 (chunked_prefix:1)": the bucket, and SGLang's variant of it where it has one."""
    return f"prefill {int(size)}" + (f" ({variant})" if variant else "")


@dataclass
class _RunnerState:
    witness: Any  # parity.runner.freshness.FreshnessWitness
    slots: dict[str, tuple[Any, int]]  # name -> (buffer, token axis)
    deepstack_model: bool  # the served model computes DeepStack: every replay lists it, supplied or not
    live: dict[str, Any] = field(default_factory=dict)  # what the batch in hand supplies
    writes: Any = None  # the open write window (a context manager), while a batch is in hand


def _prefix_variant(chunks: int) -> str:
    """The variant label SGLang gives a bucket captured for a chunked prefix (the key it replays by)."""
    from sglang.srt.model_executor.runner.prefill_cuda_graph_runner import _chunked_prefix_variant

    return _chunked_prefix_variant(chunks)


def _segment_capturing() -> bool:
    """Whether a segment of the breakable graph is capturing (not its eager breaks, not the batch's
    preparation): on a GPU, the stream's capture; on a CPU, parity's emulated graph."""
    import torch

    from parity.runner import emulated_graph

    return emulated_graph.capturing() or (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing())


def _token_axis(buffer: Any, max_tokens: int) -> int:
    return next((d for d, n in enumerate(buffer.shape) if n == max_tokens), 0)


def _slots(runner: Any) -> dict[str, tuple[Any, int]]:
    """Every buffer the runner refreshes per call, by the name the witness gives it."""
    registry = runner.buffer_registry
    found = {}
    for name in registry.slot_names():
        slot = registry.get_slot(name)
        buffer = getattr(slot, "buffer", None)
        if buffer is None:
            continue
        found[DEEPSTACK if name == ENGINE_DEEPSTACK_SLOT else name] = (buffer, _token_axis(buffer, runner.max_num_tokens))
    from parity.engines.sglang.deepstack_slot import SLOT_ATTRIBUTE

    binding = getattr(runner, SLOT_ATTRIBUTE, None)
    if binding is not None and binding.slot is not None:
        found[DEEPSTACK] = (binding.slot, 0)
    return found


def _engine_state(runner: Any) -> list[Any]:
    """What the graph reads that is the model's or the engine's, not the call's: weights, buffers
    and any other tensor a module of the model holds, the KV pool the graph writes, the
    request-to-token table."""
    from parity.runner.freshness import tensors_held

    model_runner = runner.model_runner
    state = [*model_runner.model.parameters(), *model_runner.model.buffers()]
    for holder in (*model_runner.model.modules(), getattr(model_runner, "token_to_kv_pool", None),
                   getattr(model_runner, "req_to_token_pool", None)):
        state += list(tensors_held(holder).values())
    return state


def _held(runner: Any) -> dict[str, Any]:
    """Tensors the runner, its model runner and its attention backend hold, by attribute: what an
    input the registry does not hold may be."""
    from parity.runner.freshness import tensors_held

    model_runner = runner.model_runner
    holders = {"runner": runner, "model_runner": model_runner,
               "attn_backend": getattr(model_runner, "attn_backend", None)}
    return {name: t for prefix, holder in holders.items() for name, t in tensors_held(holder, prefix).items()}


@dataclass(frozen=True)
class SGLangFreshness:
    """The witness's hooks on the real runner, writing to parity's channel."""

    channel: TapChannel

    def _state(self, runner: Any) -> _RunnerState:
        state = getattr(runner, _STATE, None)
        if state is None:
            from parity.engines.sglang.deepstack_slot import deepstack_holder
            from parity.runner.freshness import FreshnessWitness

            state = _RunnerState(FreshnessWitness(_engine_state(runner), _held(runner)), _slots(runner),
                                 deepstack_holder(runner.model_runner.model) is not None)
            for name, (buffer, axis) in state.slots.items():
                state.witness.watch(name, buffer, axis)
            setattr(runner, _STATE, state)
            self._wrap_replay(runner, state)
        return state

    def around_capture_one_shape(self, original, runner, size, *args, **kwargs):
        state = self._state(runner)
        chunks = kwargs.get("prefix_num_chunks") or 0
        key = graph_label(size, _prefix_variant(chunks) if chunks else None)
        return state.witness.captured(key, lambda: original(runner, size, *args, **kwargs), _segment_capturing)()

    def around_execute(self, original, runner, forward_batch, *args, **kwargs):
        state = getattr(runner, _STATE, None)
        if state is None:  # nothing captured: nothing replays
            return original(runner, forward_batch, *args, **kwargs)
        control = self.channel.read_control()
        state.live = {name: getattr(forward_batch, name).clone() for name in BATCH_FIELDS
                      if getattr(forward_batch, name, None) is not None and name in state.slots}
        state.live["tag"] = UNSENT if control is None else control.tag
        state.writes = state.witness.writes(state.live["tag"])
        state.writes.__enter__()
        try:
            return original(runner, forward_batch, *args, **kwargs)
        finally:
            self._close(state)

    @staticmethod
    def _close(state: _RunnerState) -> bool:
        """End the batch's write window; False: none was open (it ended at the replay already)."""
        writes, state.writes = state.writes, None
        if writes is not None:
            writes.__exit__(None, None, None)
        return writes is not None

    def around_fill(self, original, runner, args, layer_kwargs, static_num_tokens, *rest, **kwargs):
        state = getattr(runner, _STATE, None)
        if state is not None:
            embeds = layer_kwargs.get("input_embeds")
            if embeds is None:
                embeds = layer_kwargs.get("inputs_embeds")
            index = runner._input_embeds_arg_idx
            if embeds is None and index is not None and len(args) > index:
                embeds = args[index]
            state.live["input_embeds"] = embeds  # None: a text batch, embedded by the fill itself
            # The ids the body gets: the embedding routine rewrites a multimodal batch's placeholder
            # ids in place after the registry copied them, so the batch's own ids are not these.
            ids = layer_kwargs.get("input_ids", args[0] if args else None)
            if ids is not None:
                state.live["input_ids"] = ids.clone()
            state.live[DEEPSTACK] = layer_kwargs.get("input_deepstack_embeds")
        return original(runner, args, layer_kwargs, static_num_tokens, *rest, **kwargs)

    def _wrap_replay(self, runner: Any, state: _RunnerState) -> None:
        backend = runner.backend
        replay = backend.replay

        @functools.wraps(replay)
        def checked_replay(shape_key, static_forward_batch, *args, **kwargs):
            # The batch's writes end where the graph starts reading; a forward parity did not send
            # (the engine's warm-up) leaves its writers, but nobody reads its records.
            if self._close(state) and state.live["tag"] != UNSENT:
                self._check(runner, state, shape_key, len(static_forward_batch.input_ids))
            return replay(shape_key, static_forward_batch, *args, **kwargs)

        backend.replay = checked_replay

    def _check(self, runner: Any, state: _RunnerState, shape_key: Any, bucket: int) -> None:
        import torch

        from parity.runner.freshness import Supplied, padded

        label = graph_label(shape_key.size, shape_key.variant_label)
        # What the graph read, and what it must read whenever the batch supplies it: DeepStack, and the
        # mRoPE positions eager attention rotates by (a body given one-row positions drops them).
        judged = dict.fromkeys([*(i.name for i in state.witness.inputs(label)), DEEPSTACK, "mrope_positions"])
        supplied = {}
        for name in judged:
            live = state.live.get(name)
            if name == "input_embeds" and live is None:
                ids = state.live.get("input_ids")
                embed = getattr(runner.model_runner.model, "get_input_embeddings", None)
                live = None if ids is None or embed is None else embed()(ids)
            if name in state.slots and (live is not None or name == DEEPSTACK):
                buffer, axis = state.slots[name]
                supplied[name] = Supplied(padded(live, buffer, bucket, axis), axis)
            elif live is not None:  # no slot holds it: what the graph drops
                supplied[name] = Supplied(live, 1 if name == "mrope_positions" else 0)
            elif name == DEEPSTACK and state.deepstack_model:  # none supplied, none read: listed all the same
                supplied[name] = Supplied(torch.zeros(0))
        records = state.witness.check(label, label, supplied)
        self.channel.append_freshness(state.live["tag"], os.getpid(), process_role(), records)

    def register(self) -> None:
        from sglang.srt.plugins.hook_registry import HookRegistry, HookType

        HookRegistry.register(TARGETS["capture_one_shape"], self.around_capture_one_shape, HookType.AROUND)
        HookRegistry.register(TARGETS["execute"], self.around_execute, HookType.AROUND)
        HookRegistry.register(TARGETS["fill"], self.around_fill, HookType.AROUND)

