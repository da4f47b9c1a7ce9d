"""The DeepStack replay slot for SGLang 0.5.23's prefill graph runner: the fix parity validates.

SGLang 0.5.23's `PrefillCudaGraphRunner` captures the language-model body with only
`input_embeds` bound (`_build_layer_model_forward_kwargs`), so Qwen3-VL's layers take their
"no DeepStack" branch at capture and the graph has no DeepStack add; at replay the live tensor
reaches `replay_layer_forward` and is ignored (docs/engines/sglang-0.5.23.md §6, the bug of PR #33726). This
plugin adds the slot of design §6 to the real runner, through SGLang's own hook registry:

- allocated before capture, next to the runner's other static buffers, `[max_tokens, hidden × n]`
  (n = `num_deepstack_embeddings` of the object that computes DeepStack: the served model, or the
  sub-model it serves through, as Qwen3-Omni's wrapper serves its thinker), only when the model
  consumes DeepStack (n > 0 and the LM body takes `input_deepstack_embeds`) and the backend replays
  prefill (breakable, full); a model that computes DeepStack but says nowhere how many blocks is
  refused at capture, in one line naming its class, never given a slot of zero width;
- bound at capture as the body's `input_deepstack_embeds` (its bucket's rows), so the add is in
  the graph;
- refreshed before every replay, right after SGLang fills its `input_embeds` slot: a fitting live
  tensor's rows are copied and the bucket's tail zeroed; no DeepStack (a text-only batch) zeroes
  the bucket; a malformed tensor raises before any write (fail closed);
- proven read, not assumed: every captured body's `input_deepstack_embeds` is checked against the
  slot's storage as the body receives it (after every hook and engine edit of the kwargs); the
  runner's process then appends a line to `fix.jsonl` in parity's tap channel with the slot and how
  many captured bodies read it, which parity checks before trusting a bcg server (server_checks.py).

- the positions the captured body reads follow the same sub-model: the runner hands the body
  mRoPE positions only where the served model or its `language_model` says `is_mrope_enabled`, and
  Qwen3-Omni's wrapper has neither (its thinker says it), so a released breakable graph replays Omni
  with one-row positions where eager uses its three-row mRoPE positions, a divergence of its own with
  DeepStack zeroed (docs/engines/sglang-0.5.23.md §8). The fix hands the body the mRoPE positions
  where the DeepStack sub-model says `is_mrope_enabled` (`after_positions`).

An engine that carries DeepStack itself (SGLang PR #33726: an `input_deepstack_embeds` slot in the
runner's buffer registry, versions.py) overwrites any binding parity makes, so the fix stands aside
there: it binds nothing, and records that the engine's own slot was found and that the captured
bodies read it. The run then judges the engine's slot, and its report says so.

It is off unless `PARITY_SGLANG_FIX` names a variant, and it refuses any SGLang release it was not
validated on or that carries no slot of its own (versions.py). `deepstack-slot-no-clear` is a
test-only variant that never clears (the stale-state bug the `stream` scenario must catch), and
`deepstack-slot-skip-same-shape` one that skips the refresh when two batches in a row carry
DeepStack of one shape (what the stream's normal and zeroed requests of one image reach, back to
back), and `deepstack-slot-wrapper-width` one that sizes the slot from the served model alone (no
slot for Qwen3-Omni's wrapper); planted.py holds the variant that breaks a refresh beyond
DeepStack. Nothing here depends on the device: with real CUDA graphs on a GPU the same hooks bind the
same slot.
"""

from __future__ import annotations

import contextvars
import functools
import inspect
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from parity.engines.fix_records import FixRecord, append_record, installed_version, requested_variant
from parity.engines.sglang import planted, versions
from parity.runner.slot_contract import refresh

ENV_FIX = "PARITY_SGLANG_FIX"
FIX = "deepstack-slot"
NO_CLEAR = "deepstack-slot-no-clear"  # test-only: a slot that is never cleared
# test-only: a refresh skipped when a batch's DeepStack has the shape of the one before it (a copy
# "optimized" away for repeated shapes): only requests back to back reach it (design §5).
SKIP_SAME_SHAPE = "deepstack-slot-skip-same-shape"
# test-only: the slot sized from the served model's own count, as a fix blind to sub-models would size
# it: Qwen3-Omni's wrapper has none, so it gets no slot and its DeepStack is dropped (the seed's warning).
WRAPPER_WIDTH = "deepstack-slot-wrapper-width"
VARIANTS = (FIX, NO_CLEAR, SKIP_SAME_SHAPE, WRAPPER_WIDTH, *planted.VARIANTS)

RUNNER_MODULE = "sglang.srt.model_executor.runner.prefill_cuda_graph_runner"
RUNNER_CLASS = f"{RUNNER_MODULE}.PrefillCudaGraphRunner"
TARGETS = {  # what each hook wraps in SGLang 0.5.23; tests/engines/test_sglang_contract.py checks they exist
    "capture": f"{RUNNER_CLASS}.capture",
    "run_forward": f"{RUNNER_CLASS}._run_forward",
    "layer_kwargs": f"{RUNNER_MODULE}._build_layer_model_forward_kwargs",
    "fill": f"{RUNNER_CLASS}._fill_input_embeds_slot",
    "positions": f"{RUNNER_CLASS}._get_layer_model_positions",
}
DEEPSTACK_KWARG = "input_deepstack_embeds"
BLOCKS_ATTRIBUTE = "num_deepstack_embeddings"  # on the served model: how many DeepStack blocks it adds
SLOT_ATTRIBUTE = "_parity_deepstack_slot"  # on the runner: its _Binding (None: nothing to bind)
REPLAYING_BACKENDS = ("breakable", "full")
ENGINE_SLOT = (f"SGLang's prefill runner registers its own {DEEPSTACK_KWARG} graph slot (buffer_registry, "
               "SGLang PR #33726's mechanism) and binds it at capture")


# --- the hooks on the real runner ------------------------------------------------------------------

_LAST_SHAPE = "_parity_deepstack_last_shape"  # the shape the slot was last refreshed for
_BINDING: contextvars.ContextVar[Any] = contextvars.ContextVar("parity_deepstack_binding", default=None)


@dataclass
class _Binding:
    """What one runner's captured bodies must read as `input_deepstack_embeds`: parity's slot, or,
    where the fix stood aside, the engine's own; and how many of them did, counted at capture."""

    slot: Any | None  # parity's slot [max_tokens, hidden x n]; None: the engine's own slot
    note: str
    captures: int = 0
    reads: int = 0
    capturing: bool = False

    def expected(self, runner, num_tokens: int) -> Any:
        if self.slot is not None:
            return self.slot[:num_tokens]
        return runner.buffer_registry.get_slot(DEEPSTACK_KWARG).slice_for(1, num_tokens)

    def saw(self, received: Any, expected: Any) -> None:
        self.captures += 1
        # The same storage from the same first element, the same rows: the graph's input is the slot.
        self.reads += int(received is not None and received.data_ptr() == expected.data_ptr()
                          and tuple(received.shape) == tuple(expected.shape))


@dataclass(frozen=True)
class DeepStackSlotFix:
    variant: str
    records: Path | None  # parity's channel folder

    @property
    def clears(self) -> bool:
        return self.variant != NO_CLEAR

    def around_capture(self, original, runner, *args, **kwargs):
        if not hasattr(runner, SLOT_ATTRIBUTE):
            setattr(runner, SLOT_ATTRIBUTE, self._bind(runner))
        binding = getattr(runner, SLOT_ATTRIBUTE)
        if binding is None:
            return original(runner, *args, **kwargs)
        binding.captures = binding.reads = 0
        binding.capturing = True
        try:
            result = original(runner, *args, **kwargs)
        finally:
            binding.capturing = False
        slot = binding.slot
        append_record(self.records, FixRecord(
            os.getpid(), self.variant, None if slot is None else tuple(slot.shape),
            None if slot is None else str(slot.dtype), binding.note, stood_aside=slot is None,
            captures=binding.captures, reads=binding.reads))
        return result

    def _bind(self, runner) -> _Binding | None:
        """Stand aside for the engine's own slot; else parity's slot, where the model consumes DeepStack."""
        if runner.buffer_registry.has_slot(DEEPSTACK_KWARG):
            return _Binding(None, f"stood aside: {ENGINE_SLOT}; parity's slot is not bound")
        import torch

        model = runner.model_runner.model
        holder = model if self.variant == WRAPPER_WIDTH else deepstack_holder(model)
        blocks = int(getattr(holder, BLOCKS_ATTRIBUTE, 0) or 0)
        layer_model = runner.layer_model
        takes = layer_model is not None and DEEPSTACK_KWARG in inspect.signature(layer_model.forward).parameters
        backend = str(runner.prefill_backend_name)
        if holder is None and takes and backend in REPLAYING_BACKENDS and _computes_deepstack(runner.model_runner):
            # Never a slot of zero width: a replay would drop DeepStack as silently as no fix at all.
            refused = (f"{type(model).__name__} computes DeepStack (its config declares "
                       f"{_declared_levels(runner.model_runner.model_config)} levels) and its LM body takes "
                       f"{DEEPSTACK_KWARG}, but neither it nor a sub-model says how many blocks it adds "
                       f"({BLOCKS_ATTRIBUTE}): parity cannot size a slot for it")
            append_record(self.records, FixRecord(os.getpid(), self.variant, None, None, refused, refused=True))
            raise RuntimeError(f"parity {self.variant}: {refused}")
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
        where = "" if holder is model else f" (from its {type(holder).__name__})"
        return _Binding(slot, f"{blocks} DeepStack blocks{where}, buckets {list(runner.capture_num_tokens)}")

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
        found = versions.release(installed_sglang())
        if found is not None and not found.fix_validated:
            return (f"SGLang {found.version} carries its own DeepStack slot, but registered none for this model, "
                    "and parity's fix was not validated on that release")
        return None

    def around_run_forward(self, original, runner, forward_batch, num_tokens, *args, **kwargs):
        binding = getattr(runner, SLOT_ATTRIBUTE, None)
        slot = None if binding is None else binding.slot
        token = _BINDING.set(None if slot is None else slot[:num_tokens])  # [bucket, hidden x n]
        restore = _watch_body(runner, binding, num_tokens) if binding is not None and binding.capturing else None
        try:
            return original(runner, forward_batch, num_tokens, *args, **kwargs)
        finally:
            _BINDING.reset(token)
            if restore is not None:
                restore()

    def after_layer_kwargs(self, result, *args, **kwargs):
        bound = _BINDING.get()
        if bound is not None and isinstance(result, dict):
            result[DEEPSTACK_KWARG] = bound  # capture binds the slot: the add is in the graph
        return result

    def after_fill(self, result, runner, args, layer_kwargs, static_num_tokens, *rest, **kwargs):
        binding = getattr(runner, SLOT_ATTRIBUTE, None)
        if binding is None or binding.slot is None:  # no slot, or the engine refreshes its own
            return result
        live = layer_kwargs.get(DEEPSTACK_KWARG)
        shape = None if live is None else (tuple(live.shape), int(static_num_tokens))
        repeated = shape is not None and shape == getattr(runner, _LAST_SHAPE, None)
        setattr(runner, _LAST_SHAPE, shape)
        if not (repeated and self.variant == SKIP_SAME_SHAPE):
            refresh(binding.slot, live, int(static_num_tokens), clear=self.clears)
        return result

    def after_positions(self, result, runner, forward_batch, *args, **kwargs):
        """mRoPE positions for a body whose model serves through a sub-model that uses them (Omni)."""
        mrope = getattr(forward_batch, "mrope_positions", None)
        if mrope is None or result is mrope:
            return result
        holder = deepstack_holder(runner.model_runner.model)
        return mrope if getattr(holder, "is_mrope_enabled", False) else result

    def register_planted(self) -> None:
        """A test-only refresh bug beyond DeepStack (planted.py); registered before parity's other
        hooks, so that it skips SGLang's own copy and nothing of parity's around it."""
        if self.variant in planted.VARIANTS:
            planted.SkippedFill(self.variant).register()

    def register(self) -> None:
        from sglang.srt.plugins.hook_registry import HookRegistry, HookType

        HookRegistry.register(TARGETS["capture"], self.around_capture, HookType.AROUND)
        HookRegistry.register(TARGETS["run_forward"], self.around_run_forward, HookType.AROUND)
        HookRegistry.register(TARGETS["layer_kwargs"], self.after_layer_kwargs, HookType.AFTER)
        HookRegistry.register(TARGETS["fill"], self.after_fill, HookType.AFTER)
        HookRegistry.register(TARGETS["positions"], self.after_positions, HookType.AFTER)


def _model_and_children(model) -> tuple:
    children = model.named_children() if hasattr(model, "named_children") else vars(model).items()
    return (model, *(child for _, child in children))


def deepstack_holder(model) -> Any | None:
    """The object that computes DeepStack and says how many blocks it adds: the served model itself
    (Qwen3-VL and its subclasses), else a direct sub-model (Qwen3-Omni's wrapper serves its thinker's
    forward, and only the thinker sets `num_deepstack_embeddings`)."""
    return next((m for m in _model_and_children(model) if getattr(m, BLOCKS_ATTRIBUTE, None) is not None), None)


def _declared_levels(model_config) -> int:
    """DeepStack levels the checkpoint's config declares, at its top or under `thinker_config`."""
    config = getattr(model_config, "hf_config", None)
    for scope in (config, getattr(config, "thinker_config", None)):
        indexes = getattr(getattr(scope, "vision_config", None), "deepstack_visual_indexes", None)
        if indexes:
            return len(indexes)
    return 0


def _computes_deepstack(model_runner) -> bool:
    """The served model builds a vision tower whose config declares DeepStack (an MTP draft head,
    which reuses the body but never builds a tower, computes none)."""
    towers = [m for m in _model_and_children(model_runner.model) if getattr(m, "visual", None) is not None]
    return bool(towers) and _declared_levels(model_runner.model_config) > 0


def _watch_body(runner, binding: _Binding, num_tokens: int):
    """Check, as the captured body is called, which tensor it takes as DeepStack (the runner calls
    `layer_model.forward`, and replaces it the same way at replay); returns the undo."""
    layer_model = runner.layer_model
    own = "forward" in vars(layer_model)
    inner = layer_model.forward

    # The runner builds the body's kwargs from `inspect.signature(layer_model.forward)`: a bare
    # (*args, **kwargs) would silently drop input_embeds from every capture.
    @functools.wraps(inner)
    def forward(*args, **kwargs):
        binding.saw(kwargs.get(DEEPSTACK_KWARG), binding.expected(runner, num_tokens))
        return inner(*args, **kwargs)

    layer_model.forward = forward

    def restore() -> None:
        if own:
            layer_model.forward = inner
        else:
            del layer_model.forward

    return restore


def installed_sglang() -> str | None:
    return installed_version("sglang")


def activate(environ: Mapping[str, str], records: Path | None) -> DeepStackSlotFix | None:
    """The fix this process was asked for, or None. A refusal is recorded for parity to read."""
    variant = requested_variant(environ, ENV_FIX, VARIANTS, versions.fix_accepted(), installed_sglang(), "SGLang",
                                records)
    return None if variant is None else DeepStackSlotFix(variant, records)
