"""The DeepStack replay slot for SGLang 0.5.23's prefill graph runner: the fix parity validates.

SGLang 0.5.23's `PrefillCudaGraphRunner` captures the language-model body with only
`input_embeds` bound (`_build_layer_model_forward_kwargs`), so Qwen3-VL's layers take their
"no DeepStack" branch at capture and the graph has no DeepStack add; at replay the live tensor
reaches `replay_layer_forward` and is ignored (docs/engines/sglang-0.5.23.md §6, the bug of PR #33726). This
plugin adds the slot of design §6 to the real runner, through SGLang's own hook registry:

- allocated before capture, next to the runner's other static buffers, `[max_tokens, hidden × n]`
  (n = the model's `num_deepstack_embeddings`), only when the model consumes DeepStack (n > 0 and
  the LM body takes `input_deepstack_embeds`) and the backend replays prefill (breakable, full);
- bound at capture as the body's `input_deepstack_embeds` (its bucket's rows), so the add is in
  the graph;
- refreshed before every replay, right after SGLang fills its `input_embeds` slot: a fitting live
  tensor's rows are copied and the bucket's tail zeroed; no DeepStack (a text-only batch) zeroes
  the bucket; a malformed tensor raises before any write (fail closed);
- proven in place: the runner's process appends a line to `fix.jsonl` in parity's tap channel,
  which parity checks before trusting a bcg server (parity/engines/sglang/backend.py).

It is off unless `PARITY_SGLANG_FIX` names a variant, and it refuses any SGLang version but the one
it was written against. `deepstack-slot-no-clear` is a test-only variant that never clears (the
stale-state bug the `stream` scenario must catch), and `deepstack-slot-skip-same-shape` one that
skips the refresh when two batches in a row carry DeepStack of one shape (what the stream's
normal and zeroed requests of one image reach, back to back). Nothing here depends on the device: with real
CUDA graphs on a GPU the same hooks bind the same slot.
"""

from __future__ import annotations

import contextvars
import inspect
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from parity.engines.fix_records import FixRecord, append_record, installed_version, requested_variant
from parity.runner.slot_contract import refresh

ENV_FIX = "PARITY_SGLANG_FIX"
FIX = "deepstack-slot"
NO_CLEAR = "deepstack-slot-no-clear"  # test-only: a slot that is never cleared
# test-only: a refresh skipped when a batch's DeepStack has the shape of the one before it (a copy
# "optimized" away for repeated shapes): only requests back to back reach it (design §5).
SKIP_SAME_SHAPE = "deepstack-slot-skip-same-shape"
VARIANTS = (FIX, NO_CLEAR, SKIP_SAME_SHAPE)
WRITTEN_FOR = "0.5.23"

RUNNER_MODULE = "sglang.srt.model_executor.runner.prefill_cuda_graph_runner"
RUNNER_CLASS = f"{RUNNER_MODULE}.PrefillCudaGraphRunner"
TARGETS = {  # what each hook wraps in SGLang 0.5.23; tests/engines/test_sglang_contract.py checks they exist
    "capture": f"{RUNNER_CLASS}.capture",
    "run_forward": f"{RUNNER_CLASS}._run_forward",
    "layer_kwargs": f"{RUNNER_MODULE}._build_layer_model_forward_kwargs",
    "fill": f"{RUNNER_CLASS}._fill_input_embeds_slot",
}
DEEPSTACK_KWARG = "input_deepstack_embeds"
BLOCKS_ATTRIBUTE = "num_deepstack_embeddings"  # on the served model: how many DeepStack blocks it adds
SLOT_ATTRIBUTE = "_parity_deepstack_slot"
REPLAYING_BACKENDS = ("breakable", "full")


# --- the hooks on the real runner ------------------------------------------------------------------

_LAST_SHAPE = "_parity_deepstack_last_shape"  # the shape the slot was last refreshed for
_BINDING: contextvars.ContextVar[Any] = contextvars.ContextVar("parity_deepstack_binding", default=None)


@dataclass(frozen=True)
class DeepStackSlotFix:
    variant: str
    records: Path | None  # parity's channel folder

    @property
    def clears(self) -> bool:
        return self.variant != NO_CLEAR

    def around_capture(self, original, runner, *args, **kwargs):
        if getattr(runner, SLOT_ATTRIBUTE, None) is None:
            setattr(runner, SLOT_ATTRIBUTE, self._allocate(runner))
        return original(runner, *args, **kwargs)

    def _allocate(self, runner) -> Any:
        import torch

        model = runner.model_runner.model
        blocks = int(getattr(model, BLOCKS_ATTRIBUTE, 0) or 0)
        layer_model = runner.layer_model
        takes = layer_model is not None and DEEPSTACK_KWARG in inspect.signature(layer_model.forward).parameters
        backend = str(runner.prefill_backend_name)
        if blocks <= 0 or not takes or backend not in REPLAYING_BACKENDS:
            why = (f"no slot: the model has {blocks} DeepStack blocks, its LM body "
                   f"{'takes' if takes else 'does not take'} {DEEPSTACK_KWARG}, prefill backend {backend}")
            append_record(self.records, FixRecord(os.getpid(), self.variant, None, None, why))
            return None
        unsupported = self._unsupported(runner)
        if unsupported:
            append_record(self.records, FixRecord(os.getpid(), self.variant, None, None, unsupported, refused=True))
            raise RuntimeError(f"parity {self.variant}: {unsupported}")
        width = int(runner.model_runner.model_config.hidden_size) * blocks
        slot = torch.zeros((runner.max_num_tokens, width), dtype=runner.model_runner.dtype, device=runner.device)
        append_record(self.records, FixRecord(os.getpid(), self.variant, tuple(slot.shape), str(slot.dtype),
                                        f"{blocks} DeepStack blocks, buckets {list(runner.capture_num_tokens)}"))
        return slot

    @staticmethod
    def _unsupported(runner) -> str | None:
        # The slot is refreshed where SGLang fills its input_embeds slot; a runner that skips that
        # would replay stale rows, so refuse it at start-up instead.
        if not runner.buffer_registry.has_slot("input_embeds"):
            return "the runner has no input_embeds slot, so the DeepStack slot would never be refreshed"
        if not runner.model_runner.pp_group.is_first_rank:
            return "pipeline-parallel ranks after the first are not supported"
        if getattr(runner, "enable_cp_bcg_capture", False):
            return "context-parallel breakable capture is not supported"
        return None

    def around_run_forward(self, original, runner, forward_batch, num_tokens, *args, **kwargs):
        slot = getattr(runner, SLOT_ATTRIBUTE, None)
        token = _BINDING.set(None if slot is None else slot[:num_tokens])  # [bucket, hidden x n]
        try:
            return original(runner, forward_batch, num_tokens, *args, **kwargs)
        finally:
            _BINDING.reset(token)

    def after_layer_kwargs(self, result, *args, **kwargs):
        bound = _BINDING.get()
        if bound is not None and isinstance(result, dict):
            result[DEEPSTACK_KWARG] = bound  # capture binds the slot: the add is in the graph
        return result

    def after_fill(self, result, runner, args, layer_kwargs, static_num_tokens, *rest, **kwargs):
        slot = getattr(runner, SLOT_ATTRIBUTE, None)
        if slot is None:
            return result
        live = layer_kwargs.get(DEEPSTACK_KWARG)
        shape = None if live is None else (tuple(live.shape), int(static_num_tokens))
        repeated = shape is not None and shape == getattr(runner, _LAST_SHAPE, None)
        setattr(runner, _LAST_SHAPE, shape)
        if not (repeated and self.variant == SKIP_SAME_SHAPE):
            refresh(slot, live, int(static_num_tokens), clear=self.clears)
        return result

    def register(self) -> None:
        from sglang.srt.plugins.hook_registry import HookRegistry, HookType

        HookRegistry.register(TARGETS["capture"], self.around_capture, HookType.AROUND)
        HookRegistry.register(TARGETS["run_forward"], self.around_run_forward, HookType.AROUND)
        HookRegistry.register(TARGETS["layer_kwargs"], self.after_layer_kwargs, HookType.AFTER)
        HookRegistry.register(TARGETS["fill"], self.after_fill, HookType.AFTER)


def installed_sglang() -> str | None:
    return installed_version("sglang")


def activate(environ: Mapping[str, str], records: Path | None) -> DeepStackSlotFix | None:
    """The fix this process was asked for, or None. A refusal is recorded for parity to read."""
    variant = requested_variant(environ, ENV_FIX, VARIANTS, (WRITTEN_FOR,), installed_sglang(), "SGLang", records)
    return None if variant is None else DeepStackSlotFix(variant, records)
