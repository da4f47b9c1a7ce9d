"""parity's tap inside an SGLang server: a general plugin and the channel that steers it.

SGLang loads `register()` through the `sglang.srt.plugins` entry point in every server process
(docs/engines/sglang-0.5.23.md §4.1). It does nothing unless `PARITY_SGLANG_TAP` names a channel folder (or
`PARITY_SGLANG_FIX` asks for parity's DeepStack slot fix, deepstack_slot.py), so
installing parity next to a production server changes nothing. When set, it adds an AFTER hook
on `prepare_mm_inputs`, the last eager point before the language model in both execution modes
(docs/engines/sglang-0.5.23.md §3.4), called once per LM entry (prefill, or an eagerly run decode step) in the process that
runs the model. For a tagged request the hook records every entry: which process saw it, whether
it was an extend (prompt) batch, its padded and real token counts, whether BCG replay was active
(`replay_layer_forward` installed on the LM instance) and, where `input_deepstack_embeds` is
present, hands it to parity's one tap (`parity.runner.tap.apply_tap`) and stores the fingerprint.

The hook is steered through parity's channel (`parity.engines.channel`): a control file set only
while a tagged request runs, so the server's own warm-up request is never tapped or recorded, and
one record line per LM entry.

A "plugin loaded" marker would prove nothing (SGLang's launcher process loads plugins too, and
`apply_hooks` only logs its failures): the proof that the tap works is an entry recorded by the
hook for the request itself.

Nothing here imports sglang or torch at module import time: the hook is unit-tested without
SGLang, and an inactive plugin costs one environment lookup.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Mapping

from parity.engines.channel import FRESHNESS_OFF_ENV, TapChannel, TapEntry, process_role

if TYPE_CHECKING:  # imported lazily below: an inactive plugin must not pull in torch
    from parity.evidence import DeepStackRecord

# What the hook relies on in SGLang 0.5.23; tests/engines/test_sglang_contract.py checks each one
# against the released wheel, and tests/engines/test_sglang_real.py calls the real code where installed.
ENV_VAR = "PARITY_SGLANG_TAP"
ENTRY_POINT_GROUP = "sglang.srt.plugins"
ENTRY_POINT_NAME = "parity"
HOOK_TARGET = "sglang.srt.managers.mm_utils.prepare_mm_inputs"
INPUT_IDS_ARG = (0, "input_ids")
FORWARD_BATCH_ARG = (1, "forward_batch")
LANGUAGE_MODEL_ARG = (2, "language_model")
KWARGS_ARG = (3, "kwargs")  # the dict later spread into language_model(...)
DEEPSTACK_KEY = "input_deepstack_embeds"
RAW_LENGTHS_FIELD = "extend_seq_lens_cpu"  # ForwardBatch: per-request extend lengths, unpadded
FORWARD_MODE_FIELD = "forward_mode"  # ForwardBatch: ForwardMode, with is_extend()
REPLAY_FORWARD_NAME = "replay_layer_forward"  # what BCG installs as the LM instance's forward
CAPTURE_TARGET = "sglang.srt.model_executor.runner.prefill_cuda_graph_runner.PrefillCudaGraphRunner.capture"
CAPTURED_FIELD = "capture_num_tokens"  # PrefillCudaGraphRunner: the prefill buckets it captures


# --- the hook --------------------------------------------------------------------------------------

def _capturing() -> bool:
    # The decode CUDA-graph capture runs the embed routine inside a capture: no sync allowed.
    import torch

    return bool(torch.cuda.is_available() and torch.cuda.is_current_stream_capturing())


def _argument(args: tuple, kwargs: Mapping[str, Any], position: tuple[int, str]) -> Any:
    index, name = position
    return args[index] if len(args) > index else kwargs.get(name)


def _raw_tokens(forward_batch: Any) -> int | None:
    # Under BCG the batch is padded to its bucket; the real tokens are the sum of extend lengths.
    lengths = getattr(forward_batch, RAW_LENGTHS_FIELD, None)
    return None if lengths is None else int(sum(int(n) for n in lengths))


def _is_extend(forward_batch: Any) -> bool | None:
    mode = getattr(forward_batch, FORWARD_MODE_FIELD, None)
    return None if mode is None else bool(mode.is_extend())


def _rows(input_ids: Any) -> int | None:
    shape = getattr(input_ids, "shape", None)
    return int(shape[0]) if shape else None


def _dtype(embeddings: Any) -> str | None:
    # prepare_mm_inputs returns the embeddings the LM gets (None on later pipeline ranks).
    dtype = getattr(embeddings, "dtype", None)
    return None if dtype is None else str(dtype)


def _is_replay(language_model: Any) -> bool:
    # BCG shadows the LM's class forward with an instance attribute for the replay; `forward` is
    # absent from the instance dict until the first replay, hence the getattr form.
    installed = getattr(language_model, "__dict__", {}).get("forward")
    return getattr(installed, "__name__", None) == REPLAY_FORWARD_NAME


@dataclass(frozen=True)
class TapHook:
    """The AFTER hook on prepare_mm_inputs: `hook(result, *args, **kwargs)`, returns None."""

    channel: TapChannel
    capturing: Callable[[], bool] = _capturing

    def __call__(self, result: Any, *args: Any, **kwargs: Any) -> None:
        if self.capturing():
            return None  # a graph capture at start-up: no request, and no sync allowed
        control = self.channel.read_control()
        if control is None:
            return None  # start-up and warm-up: pass through, record nothing
        forward_batch = _argument(args, kwargs, FORWARD_BATCH_ARG)
        lm_kwargs = _argument(args, kwargs, KWARGS_ARG)
        raw = _raw_tokens(forward_batch)
        tensor = lm_kwargs.get(DEEPSTACK_KEY) if isinstance(lm_kwargs, dict) else None
        record = None
        if tensor is not None:  # text-only and decode batches never carry the key
            handed, record = self._tap(control.mode, tensor, raw)
            lm_kwargs[DEEPSTACK_KEY] = handed  # the same dict is spread into language_model(...)
        replay = _is_replay(_argument(args, kwargs, LANGUAGE_MODEL_ARG))
        tokens = _rows(_argument(args, kwargs, INPUT_IDS_ARG))
        if tokens is None and tensor is not None:
            tokens = int(tensor.shape[0])
        entry = TapEntry(control.tag, os.getpid(), process_role(), _is_extend(forward_batch), tokens, raw, replay,
                         None if record is None else replace(record, replay=replay), _dtype(result))
        self.channel.append(entry)
        return None

    @staticmethod
    def _tap(mode: str, tensor: Any, raw: int | None) -> tuple[Any, DeepStackRecord]:
        from parity.runner.tap import apply_tap
        import torch

        # Fingerprint and zero only the real rows: a BCG bucket's padded tail would make eager and
        # graph fingerprints differ for the same input.
        rows = tensor[: min(raw, tensor.shape[0]) if raw is not None else tensor.shape[0]]  # [raw, hidden * n_ds]
        handed, record = apply_tap(mode, rows)
        assert record is not None  # record and zero always fingerprint a tensor
        if handed is rows:
            return tensor, record  # pass-through: hand on the very object SGLang built
        if rows.shape[0] < tensor.shape[0]:
            # Keep the bucket's padded tail so the LM gets the shape it expects.
            handed = torch.cat([handed, tensor[rows.shape[0]:]], dim=0)
        return handed, record


@dataclass(frozen=True)
class CaptureRecorder:
    """An AFTER hook on the prefill runner's `capture`: which buckets were captured, and so existed
    before any request (the warm-up scenario's proof, design §10)."""

    channel: TapChannel

    def __call__(self, result: Any, runner: Any, *args: Any, **kwargs: Any) -> None:
        self.channel.record_capture(getattr(runner, CAPTURED_FIELD, ()) or ())
        return None


# --- entry point -----------------------------------------------------------------------------------

def activate(environ: Mapping[str, str] = os.environ) -> TapHook | None:
    """The hook for this process, or None when parity's control variable is not set."""
    folder = environ.get(ENV_VAR)
    return TapHook(TapChannel(Path(folder))) if folder else None


def register() -> None:
    """SGLang general-plugin entry point: inert unless PARITY_SGLANG_TAP or PARITY_SGLANG_FIX is set.

    The tap, and the DeepStack replay slot fix when parity asks for it (parity/engines/sglang/deepstack_slot.py).
    """
    from parity.engines.sglang import deepstack_slot

    hook = activate()
    folder = os.environ.get(ENV_VAR)
    fix = deepstack_slot.activate(os.environ, Path(folder) if folder else None)
    if hook is None and fix is None:
        return
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    if fix is not None:
        fix.register_planted()  # first: the innermost wrapper of SGLang's own refresh
    if hook is not None:
        from parity.engines.sglang.freshness import SGLangFreshness

        HookRegistry.register(HOOK_TARGET, hook, HookType.AFTER)
        HookRegistry.register(CAPTURE_TARGET, CaptureRecorder(hook.channel), HookType.AFTER)
        if os.environ.get(FRESHNESS_OFF_ENV) != "off":  # off: scripts/bench_witness.py measures what it costs
            SGLangFreshness(hook.channel).register()
    if fix is not None:
        fix.register()
