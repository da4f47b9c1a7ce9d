"""parity's fix for vLLM's stale-DeepStack leak (0.33 and 0.34 alike): the fix parity validates (off unless asked).

vLLM keeps DeepStack in persistent per-model buffers that every step shares: the setter copies a
step's rows in before the forward, the forward reads them, and `_clear_deepstack_input_embeds`
zeroes them after the language model, in Python. A FULL or breakable graph replays the forward
without Python, so the clear never runs and a later step reads an earlier step's image rows
(docs/engines/vllm-0.33.md §3.3). This fix keeps one invariant instead, in eager code that runs
before every forward step and outside any captured region: when a step's forward starts, every row
of the buffers that the step did not write itself is zero.

- The setter (`_set_deepstack_input_embeds`, called on steps that carry image rows: a whole
  prefill or a prefill chunk) first zeroes the rows an earlier step left beyond this step's rows,
  then writes this step's rows.
- `prepare_inputs_embeds` (every step) zeroes, for a step whose setter did not run (text, decode,
  a text-only chunk), every row an earlier step left.
- It never zeroes rows the current step wrote, and it tracks the highest row an earlier step may
  have left (a high-water mark), so the cost is one memset of those rows, once.

MossAudio keeps its audio DeepStack otherwise: each step's embedding sets `deepstack_input_embeds` to
new tensors (an `IntermediateTensors`, or None) and the forward reads and resets it, so a FULL or
breakable graph reads the attribute as captured, None, and drops DeepStack (vllm-0.34.md §6). For
such a model the fix gives the attribute a slot: persistent rows, one tensor per DeepStack level,
sized for the scheduler's largest step and made with the model (`wrap_attribute_owner`). The forward (`wrap_attribute_forward`) always hands the
language model views of the slot, at capture as in eager steps, so a graph reads the slot; the
step's setter (`wrap_attribute_setter`) copies the step's rows into it, and the rows outside them
are zeroed by the same rule as the buffers'. A model whose DeepStack width or level count cannot be
read is refused in one line naming its class, never given an empty slot; a step wider than the slot
fails closed, never truncated.

Nothing is done while a graph is being captured (the clearing must not be recorded into it). The
same code runs under real CUDA graphs on a GPU: it touches only the persistent buffers, between
steps, exactly where vLLM's setter does. It refuses any vLLM it was not validated on, and stands
aside, recording so, on a release that clears its own buffers (versions.py).
Stdlib only at import (vLLM imports the plugin in every process); torch comes with the model.
"""

from __future__ import annotations

import inspect
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping

from parity.engines.after_import import around
from parity.engines.fix_records import FixRecord, append_record, installed_version, requested_variant
from parity.engines.vllm import planted, versions

ENV_FIX = "PARITY_VLLM_FIX"
FIX = "deepstack-clear"
# test-only: a clear that passes over the Qwen3-Omni thinker's buffers, as a fix written for
# Qwen3-VL's class alone would: Omni's rows leak as on the released engine.
SKIP_THINKER = "deepstack-clear-skip-thinker"
VARIANTS = (FIX, SKIP_THINKER, *planted.VARIANTS)
OMNI_THINKER = "Qwen3OmniMoeThinkerForConditionalGeneration"
BUFFER_ATTR = "deepstack_input_embeds"
DIRTY_ATTR = "_parity_deepstack_dirty"  # on the model: rows [0, dirty) may hold an earlier step's features
SLOT_ATTR = "_parity_deepstack_slot"  # on a model with a per-step attribute: parity's persistent rows
LEVEL_KEY = "deepstack_input_embeds_{}"  # how such a model names a level's rows
FIXED_FLAG = planted.FIXED_FLAG  # one flag for every wrapper of the fix, its planted variants' included
STOOD_ASIDE = ("stood aside: vLLM {version} clears its own DeepStack buffers between graph steps "
               "(parity/engines/vllm/versions.py), so parity wraps nothing")


def _capturing() -> bool:
    try:
        import torch

        return bool(torch.cuda.is_available() and torch.cuda.is_current_stream_capturing())
    except Exception:  # no CUDA build, no device: nothing can be capturing
        return False


@dataclass
class DeepStackClear:
    """The per-process fix: wraps the setter and the per-step input preparation."""

    records: Path | None  # parity's channel folder (None: running without parity's tap)
    capturing: Callable[[], bool] = _capturing
    variant: str = FIX
    _wrote: bool = field(default=False, repr=False)  # the setter ran in the step in progress

    def step(self, original: Callable, state: Any, *args: Any, **kwargs: Any) -> Any:
        self._wrote = False
        result = original(state, *args, **kwargs)
        model = getattr(state, "model", None)
        if not self._wrote and model is not None and not self.capturing():
            self._zero(model, 0, _dirty(model))
            object.__setattr__(model, DIRTY_ATTR, 0)
        return result

    def set_deepstack(self, original: Callable, model: Any, embeds: Any) -> Any:
        if self.capturing():
            return original(model, embeds)
        rows = int(embeds.shape[1])  # [levels, tokens, hidden]
        self._zero(model, rows, _dirty(model))  # what earlier steps left past this step's rows
        result = original(model, embeds)
        object.__setattr__(model, DIRTY_ATTR, rows)
        self._wrote = True
        return result

    def make_slot(self, original: Callable, model: Any, *args: Any, **kwargs: Any) -> Any:
        """MossAudio's `__init__`: the slot is made with the model, so it exists before any graph is
        captured (one made inside a capture would be the graph's own memory, zeroed by every replay)."""
        result = original(model, *args, **kwargs)
        _attribute_slot(model)
        return result

    def cache_attribute(self, original: Callable, model: Any, *args: Any, **kwargs: Any) -> Any:
        """MossAudio's `_cache_deepstack_input_embeds`: the step's rows, set on the attribute as new
        tensors, are copied into the slot the graphs read."""
        result = original(model, *args, **kwargs)
        if self.capturing():
            return result
        slot = _attribute_slot(model)
        step = getattr(model, BUFFER_ATTR, None)
        rows = 0
        if slot is not None and step is not None:
            if set(step.tensors) != set(slot.tensors):
                raise FixRefused(f"{type(model).__name__}: the step's DeepStack levels {sorted(step.tensors)} are not "
                                 f"the slot's {sorted(slot.tensors)}; parity's fix refuses the step")
            rows = _fits(model, slot, int(next(iter(step.tensors.values())).shape[0]))
            for key, level in step.tensors.items():
                slot.tensors[key][:rows].copy_(level)
        self._zero(model, rows, _dirty(model))
        object.__setattr__(model, DIRTY_ATTR, rows)
        self._wrote = True
        return result

    def forward_from_slot(self, original: Callable, model: Any, *args: Any, **kwargs: Any) -> Any:
        """MossAudio's forward: the language model reads the slot's rows (this step's, or zeros),
        whether the forward runs eagerly or is being captured."""
        bound = inspect.signature(original).bind(model, *args, **kwargs)
        if bound.arguments.get("intermediate_tensors") is None:  # a first pipeline rank reads the attribute
            if self.capturing() and SLOT_ATTR not in vars(model):
                raise FixRefused(f"{type(model).__name__} is being captured, but no DeepStack slot was made with it; "
                                 "one made now would be the graph's own memory")
            slot = _attribute_slot(model)
            if slot is not None:
                embeds = bound.arguments.get("inputs_embeds")
                rows = int((embeds if embeds is not None else bound.arguments["input_ids"]).shape[0])
                object.__setattr__(model, BUFFER_ATTR, slot[:_fits(model, slot, rows)])
        return original(*bound.args, **bound.kwargs)

    def _zero(self, model: Any, start: int, stop: int) -> None:
        if self.variant == SKIP_THINKER and OMNI_THINKER in (c.__name__ for c in type(model).__mro__):
            return
        _zero_rows(model, start, stop)

    def installed(self, where: str) -> None:
        append_record(self.records, FixRecord(os.getpid(), self.variant, None, None, f"wrapped {where}"))


class FixRefused(RuntimeError):
    """A model the fix cannot give a sound slot, or a step that does not fit it: the server fails
    closed rather than serve DeepStack dropped or truncated."""


def _buffers(model: Any) -> list | tuple:
    """The rows the fix keeps clean: the model's persistent DeepStack buffers (a list of tensors, one
    per level), or the slot parity gave a model that keeps a per-step attribute under that name."""
    found = getattr(model, BUFFER_ATTR, None)
    if isinstance(found, (list, tuple)):
        return found
    slot = getattr(model, SLOT_ATTR, None)
    return tuple(slot.tensors.values()) if slot is not None else ()


def _attribute_slot(model: Any) -> Any:
    """The model's slot, made when the model is (`make_slot`): one zeroed level per
    DeepStack merger, as wide as the language model, as long as the scheduler's largest step. None for
    a model with no DeepStack levels: nothing reaches its language model to carry."""
    if SLOT_ATTR in vars(model):  # made (None: the model has no DeepStack levels)
        return vars(model)[SLOT_ATTR]
    try:
        levels = len(model.deepstack_audio_merger_list)
        width = int(model.config.language_config.hidden_size)
        rows = int(model.vllm_config.scheduler_config.max_num_batched_tokens)
        dtype = model.vllm_config.model_config.dtype
    except (AttributeError, TypeError, ValueError) as exc:
        raise FixRefused(f"{type(model).__name__} keeps DeepStack as a per-step attribute but offers no level count, "
                         f"width or step size ({exc}); parity's fix refuses to give it a slot") from None
    if levels == 0:
        object.__setattr__(model, SLOT_ATTR, None)
        return None
    if width <= 0 or rows <= 0:
        raise FixRefused(f"{type(model).__name__}: a DeepStack slot of {rows} rows x {width} is empty; "
                         "parity's fix refuses it")
    import torch
    from vllm.sequence import IntermediateTensors

    device = next(model.parameters()).device
    slot = IntermediateTensors({LEVEL_KEY.format(level): torch.zeros(rows, width, dtype=dtype, device=device)
                                for level in range(levels)})
    object.__setattr__(model, SLOT_ATTR, slot)
    object.__setattr__(model, DIRTY_ATTR, 0)
    return slot


def _fits(model: Any, slot: Any, rows: int) -> int:
    capacity = int(next(iter(slot.tensors.values())).shape[0])
    if rows > capacity:
        raise FixRefused(f"{type(model).__name__}: a step of {rows} DeepStack rows exceeds the slot's {capacity} "
                         "(the scheduler's largest step); parity's fix refuses to truncate it")
    return rows


def _dirty(model: Any) -> int:
    buffers = _buffers(model)
    # Unknown (first step, or a fresh model): every row may be stale.
    default = int(buffers[0].shape[0]) if buffers else 0
    return int(getattr(model, DIRTY_ATTR, default))


def _zero_rows(model: Any, start: int, stop: int) -> None:
    for level in _buffers(model):
        end = min(stop, int(level.shape[0]))
        if end > start:
            level[start:end].zero_()


def wrap_step(original: Callable, fix: DeepStackClear) -> Callable:
    return around(original, fix.step, FIXED_FLAG)


def wrap_setter(original: Callable, fix: DeepStackClear) -> Callable:
    return around(original, fix.set_deepstack, FIXED_FLAG)


def wrap_attribute_owner(original: Callable, fix: DeepStackClear) -> Callable:
    return around(original, fix.make_slot, FIXED_FLAG)


def wrap_attribute_setter(original: Callable, fix: DeepStackClear) -> Callable:
    return around(original, fix.cache_attribute, FIXED_FLAG)


def wrap_attribute_forward(original: Callable, fix: DeepStackClear) -> Callable:
    return around(original, fix.forward_from_slot, FIXED_FLAG)


def is_fixed(method: Callable) -> bool:
    """Whether `method`, or one it wraps, is the fix's wrapper."""
    while method is not None:
        if getattr(method, FIXED_FLAG, False):
            return True
        method = getattr(method, "__wrapped__", None)
    return False


def installed_vllm() -> str | None:
    return installed_version("vllm")


def activate(environ: Mapping[str, str], records: Path | None,
             version: Callable[[], str | None] = installed_vllm) -> DeepStackClear | None:
    """The fix this process was asked for, or None. A refusal, or standing aside for a release that
    clears its own buffers (versions.py), is recorded for parity to read."""
    found = version()
    variant = requested_variant(environ, ENV_FIX, VARIANTS, versions.fix_accepted(), found, "vLLM", records)
    if variant is None:
        return None
    if versions.release(found).clears_own_buffer:
        append_record(records, FixRecord(os.getpid(), variant, None, None, STOOD_ASIDE.format(version=found),
                                         stood_aside=True))
        return None
    return DeepStackClear(records, variant=variant)
