"""parity's tap inside vLLM's model process: one record per engine step, with the DeepStack it saw.

Three points of vLLM 0.33's Model Runner V2 are wrapped for each step (docs/engines/vllm-0.33.md §5.2);
all of them run eagerly, before the step's forward, in every graph mode (and `CudaGraphManager.capture`,
to record which token counts have graphs once captured):

- `CudaGraphManager.dispatch` returns the step's execution decision (FULL, PIECEWISE or NONE,
  and the padded token count) earlier in the same `execute_model`: kept for the step, with
  PIECEWISE named BREAKABLE when the manager replays breakable graphs.
- `DefaultModelState.prepare_inputs_embeds` is the step: its batch names the requests and the
  real and padded token counts. The tap opens a step there and writes its record when the step's
  inputs are ready, just before the forward reads the DeepStack buffer.
- `Qwen3VLForConditionalGeneration._set_deepstack_input_embeds(t)` copies the step's DeepStack
  (`t`: [levels, tokens, hidden]) into the model's persistent per-level buffers. The tap
  fingerprints `t` in parity's `[tokens, hidden * levels]` layout and, for the zero arm, hands
  the setter zeros, so the buffer every mode reads holds zeros.

The leak witness: vLLM clears the buffers in Python after the language model, so a step replayed
whole (FULL, breakable) leaves its rows there. A step that did not write its real rows itself
(a text-only prefill, a decode step, the text tail of a chunked prompt) reads whatever is left:
the record counts the real rows that hold DeepStack there, and which tagged request's setter
wrote them. It also keeps the engine's own counter of uncleared rows at the step's start.

The freshness witness (freshness.py, design §6) rides on the same tap: `ModelCudaGraphManager.capture`
hands it the buffers the graphs can read and each graph captures under it (the factory handed to
`CudaGraphManager.capture`); `GPUModelRunner.execute_model` is a step's write window, and
`run_fullgraph` / `run_pw_graph` are where it holds the step's inputs, right before the replay.

Reads of the control file and tensor work happen only while parity has armed a request (the
witness's write window aside, which only follows writes); the wrappers pass through otherwise.
Nothing here imports vllm; torch only inside a tapped step.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from typing import Any, Callable

from parity.engines.after_import import around
from parity.evidence import DeepStackRecord
from parity.engines.channel import Control, TapChannel, TapEntry, process_role
from parity.engines.vllm.freshness import VllmFreshness
from parity.row_owners import RowOwners

# What the wrappers rely on in vLLM (the same in every supported release, versions.py);
# tests/engines/test_vllm_real.py checks each against the installed code.
BUFFER_ATTR = "deepstack_input_embeds"  # the model's list of per-level [max_tokens, hidden] buffers
COUNTER_ATTR = "deepstack_input_embeds_num_tokens"  # rows set and not yet cleared
BREAKABLE_ATTR = "use_breakable_cg"  # CudaGraphManager: PIECEWISE means breakable graphs
REPLAY_MODES = ("FULL", "PIECEWISE", "BREAKABLE")
OWNERS_ATTR = "_parity_deepstack_owners"  # on the model: the RowOwners of its DeepStack buffers (tagged setter calls)
WRAPPED_FLAG = "__parity_tap__"


def _capturing() -> bool:
    # Capture runs at start-up with no request armed; never touch the control file inside one.
    import torch

    return bool(torch.cuda.is_available() and torch.cuda.is_current_stream_capturing())


@dataclass
class _Step:
    """What one tagged step has seen so far."""

    control: Control
    mode: str | None  # the dispatch decision; None: not seen for this step
    written: int = 0  # rows the setter wrote in this step
    record: DeepStackRecord | None = None


@dataclass
class StepTap:
    """The per-process tap: the dispatch decision of the current step, and the step in progress."""

    channel: TapChannel
    capturing: Callable[[], bool] = _capturing
    freshness: VllmFreshness | None = None  # the freshness witness (freshness.py): on with the tap
    _dispatched: str | None = None
    _step: _Step | None = None

    def __post_init__(self) -> None:
        if self.freshness is None:
            self.freshness = VllmFreshness(self.channel, self.capturing)

    # --- the wrapped points --------------------------------------------------------------

    def dispatch(self, original: Callable, manager: Any, *args: Any, **kwargs: Any) -> Any:
        """Keep the engine's decision for the step about to be prepared (cheap: no file, no tensor)."""
        descriptor = original(manager, *args, **kwargs)
        mode = getattr(getattr(descriptor, "cg_mode", None), "name", None)
        if mode == "PIECEWISE" and getattr(manager, BREAKABLE_ATTR, False):
            mode = "BREAKABLE"
        self._dispatched = mode
        self.freshness.dispatched(descriptor)
        return descriptor

    def capture(self, original: Callable, manager: Any, create_forward_fn: Any, *args: Any, **kwargs: Any) -> Any:
        """Record the token counts the manager has graphs for once it captured (at start-up, before
        any request: the warm-up scenario's proof, design §10); each graph captures under the
        freshness witness."""
        result = original(manager, self.freshness.forward_factory(manager, create_forward_fn), *args, **kwargs)
        self.channel.record_capture(manager.captured_token_counts())
        return result

    def model_capture(self, original: Callable, manager: Any, model: Any, model_state: Any, input_buffers: Any,
                      intermediate_tensors: Any, block_tables: Any, *args: Any, **kwargs: Any) -> Any:
        """`ModelCudaGraphManager.capture`: the freshness witness learns the buffers its graphs read."""
        self.freshness.manager_capture(manager, model, model_state, input_buffers, block_tables,
                                       getattr(model, BUFFER_ATTR, None) or ())
        return original(manager, model, model_state, input_buffers, intermediate_tensors, block_tables,
                        *args, **kwargs)

    def execute(self, original: Callable, runner: Any, *args: Any, **kwargs: Any) -> Any:
        """`execute_model`: one step's write window for the freshness witness, under parity's tag."""
        self.freshness.open(None if self.capturing() else self.channel.read_control())
        try:
            return original(runner, *args, **kwargs)
        finally:
            self.freshness.close()

    def replay(self, original: Callable, manager: Any, *args: Any, **kwargs: Any) -> Any:
        """`run_fullgraph` / `run_pw_graph`: the step's inputs held by the witness, then the replay."""
        self.freshness.replay()
        return original(manager, *args, **kwargs)

    def step(self, original: Callable, state: Any, *args: Any, **kwargs: Any) -> Any:
        """Run `prepare_inputs_embeds` as one step; record it when parity armed a request."""
        mode, self._dispatched = self._dispatched, None  # one decision serves one step
        control = self.channel.read_control()
        if control is None or self.capturing():
            return original(state, *args, **kwargs)
        batch = args[1] if len(args) > 1 else kwargs["input_batch"]
        self.freshness.step(batch)
        model = getattr(state, "model", None)
        uncleared = int(getattr(model, COUNTER_ATTR, 0) or 0)
        step = self._step = _Step(control, mode)
        try:
            result = original(state, *args, **kwargs)
        finally:
            self._step = None
        self._write(step, batch, model, uncleared)
        return result

    def set_deepstack(self, original: Callable, model: Any, embeds: Any) -> Any:
        """The setter: fingerprint `embeds` ([levels, tokens, hidden]) and zero it for the zero arm."""
        step = self._step
        if step is None or self.capturing():
            return original(model, embeds)
        from parity.runner.tap import apply_tap

        levels, tokens, hidden = embeds.shape
        rows = embeds.permute(1, 0, 2).reshape(tokens, levels * hidden)  # [tokens, hidden * levels]
        handed, record = apply_tap(step.control.mode, rows)
        if handed is not rows:
            import torch

            embeds = torch.zeros_like(embeds)
        self.freshness.set_deepstack(embeds)
        step.written, step.record = int(tokens), record
        owners = getattr(model, OWNERS_ATTR, None)
        if owners is None:
            owners = RowOwners()
            object.__setattr__(model, OWNERS_ATTR, owners)
        owners.begin(step.control.tag)
        owners.wrote(int(tokens))
        return original(model, embeds)

    # --- the record ------------------------------------------------------------------------------

    def _write(self, step: _Step, batch: Any, model: Any, uncleared: int) -> None:
        real = int(batch.num_tokens)
        padded = int(getattr(batch, "num_tokens_after_padding", real))
        requests = tuple(str(r) for r in getattr(batch, "req_ids", ()))
        # The setter writes every real row of a step that carries image rows; a step without it
        # (text, decode, a text-only chunk) reads its real rows from whatever the buffer holds.
        stale, source = stale_rows(model, step.written, real)
        replay = None if step.mode is None else step.mode in REPLAY_MODES
        entry = TapEntry(
            tag=step.control.tag, pid=os.getpid(), role=process_role(),
            extend=real > max(len(requests), 1), tokens=padded, raw_tokens=real, replay=replay,
            record=None if step.record is None else replace(step.record, replay=replay),
            mode=step.mode, requests=requests, stale_rows=stale, stale_source=source, uncleared=uncleared,
        )
        self.channel.append(entry)


def stale_rows(model: Any, start: int, stop: int) -> tuple[int, str | None]:
    """(rows in [start, stop) of the model's DeepStack buffers that hold features, the request that
    left them by `RowOwners.named`: each row's writer is the latest call whose rows reached it, so a
    longer request's tail past a shorter one's rows is the longer's). Syncs with the device: tapped
    steps only."""
    buffers = getattr(model, BUFFER_ATTR, None)
    if not buffers or stop <= start:
        return 0, None
    stop = min(stop, int(buffers[0].shape[0]))
    held = None
    for level in buffers:
        rows = level[start:stop].ne(0).any(dim=1)  # [stop - start]
        held = rows if held is None else held | rows
    count = int(held.sum().item()) if held is not None else 0
    if count == 0:
        return 0, None
    owners = getattr(model, OWNERS_ATTR, None) or RowOwners()
    return count, owners.named(start + row for row in held.nonzero().flatten().tolist())


# --- wrappers ---------------------------------------------------------------------------------------

def wrap_dispatch(original: Callable, tap: StepTap) -> Callable:
    return around(original, tap.dispatch, WRAPPED_FLAG)


def wrap_capture(original: Callable, tap: StepTap) -> Callable:
    return around(original, tap.capture, WRAPPED_FLAG)


def wrap_step(original: Callable, tap: StepTap) -> Callable:
    return around(original, tap.step, WRAPPED_FLAG)


def wrap_setter(original: Callable, tap: StepTap) -> Callable:
    return around(original, tap.set_deepstack, WRAPPED_FLAG)


def wrap_model_capture(original: Callable, tap: StepTap) -> Callable:
    return around(original, tap.model_capture, WRAPPED_FLAG)


def wrap_execute(original: Callable, tap: StepTap) -> Callable:
    return around(original, tap.execute, WRAPPED_FLAG)


def wrap_replay(original: Callable, tap: StepTap) -> Callable:
    return around(original, tap.replay, WRAPPED_FLAG)
