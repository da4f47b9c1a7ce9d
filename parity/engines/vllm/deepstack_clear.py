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

Nothing is done while a graph is being captured (the clearing must not be recorded into it). The
same code runs under real CUDA graphs on a GPU: it touches only the persistent buffers, between
steps, exactly where vLLM's setter does. It refuses any vLLM it was not validated on, and stands
aside, recording so, on a release that clears its own buffers (versions.py).
Stdlib only at import (vLLM imports the plugin in every process); torch comes with the model.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping

from parity.engines.after_import import around
from parity.engines.fix_records import FixRecord, append_record, installed_version, requested_variant
from parity.engines.vllm import versions

ENV_FIX = "PARITY_VLLM_FIX"
FIX = "deepstack-clear"
VARIANTS = (FIX,)
BUFFER_ATTR = "deepstack_input_embeds"
DIRTY_ATTR = "_parity_deepstack_dirty"  # on the model: rows [0, dirty) may hold an earlier step's features
FIXED_FLAG = "__parity_fix__"
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
    _wrote: bool = field(default=False, repr=False)  # the setter ran in the step in progress

    def step(self, original: Callable, state: Any, *args: Any, **kwargs: Any) -> Any:
        self._wrote = False
        result = original(state, *args, **kwargs)
        model = getattr(state, "model", None)
        if not self._wrote and model is not None and not self.capturing():
            _zero_rows(model, 0, _dirty(model))
            object.__setattr__(model, DIRTY_ATTR, 0)
        return result

    def set_deepstack(self, original: Callable, model: Any, embeds: Any) -> Any:
        if self.capturing():
            return original(model, embeds)
        rows = int(embeds.shape[1])  # [levels, tokens, hidden]
        _zero_rows(model, rows, _dirty(model))  # what earlier steps left past this step's rows
        result = original(model, embeds)
        object.__setattr__(model, DIRTY_ATTR, rows)
        self._wrote = True
        return result

    def installed(self, where: str) -> None:
        append_record(self.records, FixRecord(os.getpid(), FIX, None, None, f"wrapped {where}"))


def _buffers(model: Any) -> list | tuple:
    """The model's persistent DeepStack buffers: a list of tensors, one per level. MossAudio keeps a
    new IntermediateTensors (or None) under the same name each step: no buffer, nothing to zero."""
    found = getattr(model, BUFFER_ATTR, None)
    return found if isinstance(found, (list, tuple)) else ()


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
    return DeepStackClear(records)
