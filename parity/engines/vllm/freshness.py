"""The freshness witness inside vLLM's Model Runner V2 (design §6, "Every input a graph reads, fresh
for every request"): parity's one witness (`parity.runner.freshness`), on vLLM's buffers.

Driven by the tap (`tap.py`), in the process that runs the model:

- `ModelCudaGraphManager.capture` hands the witness what the graphs can read: the runner's input
  buffers (`input_ids`, `positions`, `query_start_loc`, `seq_lens`, `is_padding`), the block tables
  the forward reads (`block_table[g]`) and the slot mappings (`slot_mapping`), the mRoPE positions
  (`mrope_positions`), the embeddings buffer (`input_embeds`) and the model's DeepStack buffers
  (`deepstack[level]`). Each graph the manager captures (FULL, breakable, vLLM's compiled pieces) runs
  under the witness's capture mode: every tensor its captured ops read that they did not produce and
  that is neither the model's (weights, module tensors, the KV cache) is one of its per-call inputs,
  named by the buffer that holds it, else by its holder's attribute, else `unnamed`.
- `execute_model` opens the step's write window under parity's request tag (`unsent` when parity
  armed none); the replay (`run_fullgraph`, `run_pw_graph`) closes it and holds each input's live
  rows to what the step supplies.

vLLM prepares most inputs with Triton kernels, whose writes no op-level watch sees (on a GPU as on
this CPU's interpreter). So a row is judged by what it holds (`Supplied.by_content`), against what
the step supplies, derived from vLLM's own per-request state, not from the buffer: the scheduled
tokens' mRoPE positions from the request's prefill positions, sequence lengths and query starts from
the batch's host arrays, the block table rows from the per-request table, slot mappings from those,
the embeddings and DeepStack from what the step's embedding and setter computed. A row holding other
values offends; its last writer seen (an op's write, or a change of contents within a window) names
who left it. Rows past a step's real tokens and requests may hold anything: a padded token's outputs
are discarded, and causal attention over per-request query ranges never lets a real row read a
padded one (design §6).
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from typing import Any, Callable

from parity.engines.channel import FRESHNESS_OFF_ENV, TapChannel, process_role

DEEPSTACK = "deepstack"
UNSENT = "unsent"  # a step parity armed no request for (start-up, warm-up)
GRAPH_MODES = {"FULL": "full", "PIECEWISE": "piecewise"}  # PIECEWISE replays breakable graphs when the manager does
_STATE = "_parity_freshness"
# The CPU stand-in attention's scheduler metadata: made at capture, read by the graph's attention as an
# argument and ignored by the stand-in (cpu_ops.get_scheduler_metadata): listed, holds nothing per call.
STANDIN_METADATA = "attn.scheduler_metadata (CPU stand-in, unread)"
_LEVEL = DEEPSTACK + "[{}]"


def graph_label(desc: Any, prefill: bool, breakable: bool) -> str:
    """"prefill 48 (full)", "decode 1 (full)", "prefill 48 (breakable)": the step's kind, the graph's
    token count and vLLM's graph mode."""
    mode = GRAPH_MODES.get(desc.cg_mode.name, desc.cg_mode.name.lower())
    if mode == "piecewise" and breakable:
        mode = "breakable"
    return f"{'prefill' if prefill else 'decode'} {int(desc.num_tokens)} ({mode})"


@dataclass
class _Manager:
    """What the witness holds for one graph manager (one per model runner)."""

    witness: Any  # parity.runner.freshness.FreshnessWitness
    model_state: Any
    block_tables: Any
    watched: dict[str, tuple[Any, int]]  # name -> (buffer, token axis)
    breakable: bool


@dataclass
class _Window:
    """One step between its arrival and its replay."""

    tag: str
    manager: _Manager
    writes: Any  # the witness's write window (a context manager), open
    snapshot: dict[int, Any]
    desc: Any = None
    batch: Any = None
    embeds: Any = None  # what the step's embedding computed, before the buffer copy
    deepstack: Any = None  # [levels, tokens, hidden]: what the step's setter was handed (after the tap)


@dataclass
class VllmFreshness:
    """The witness's side of the tap, writing to parity's channel."""

    channel: TapChannel
    capturing: Callable[[], bool] = lambda: False
    _managers: list[_Manager] = field(default_factory=list)
    _window: _Window | None = None

    # --- capture -----------------------------------------------------------------------------------

    def manager_capture(self, manager: Any, model: Any, model_state: Any, input_buffers: Any,
                        block_tables: Any, deepstack: Any = ()) -> None:
        """Before `ModelCudaGraphManager.capture`: what this manager's graphs can read, watched
        (`deepstack`: the model's per-level DeepStack buffers, where the tap finds them)."""
        if getattr(manager, _STATE, None) is not None or os.environ.get(FRESHNESS_OFF_ENV) == "off":
            return
        from parity.runner.freshness import FreshnessWitness, tensors_held

        watched = _watched(deepstack, model_state, input_buffers, block_tables)
        storages = {t.untyped_storage().data_ptr() for t, _ in watched.values()}
        engine = [t for t in (*model.parameters(), *model.buffers(),
                              *(t for m in model.modules() for t in tensors_held(m).values()))
                  if t.untyped_storage().data_ptr() not in storages]
        known = {**tensors_held(input_buffers, "input_buffers"), **tensors_held(block_tables, "block_tables"),
                 **tensors_held(model_state, "model_state"),
                 **tensors_held(getattr(model_state, "encoder_runner", None), "encoder_runner"),
                 **tensors_held(getattr(model_state, "rope_state", None), "rope_state")}
        state = _Manager(FreshnessWitness(engine, known), model_state, block_tables, watched,
                         bool(getattr(manager, "use_breakable_cg", False)))
        for name, (buffer, axis) in watched.items():
            state.witness.watch(name, buffer, axis)
        _record_embeddings(model_state, self)
        setattr(manager, _STATE, state)
        self._managers.append(state)

    def forward_factory(self, manager: Any, create_forward_fn: Callable) -> Callable:
        """`CudaGraphManager.capture`'s factory, whose forward functions capture each graph under the
        witness's capture mode (reads recorded only while a graph captures: not the warm-up, not the
        eager breaks of a breakable graph)."""
        state = getattr(manager, _STATE, None)
        if state is None:
            return create_forward_fn
        from parity.runner import emulated_graph

        def recording() -> bool:
            return emulated_graph.capturing() or self.capturing()

        def create(desc: Any, warmup: bool) -> Callable:
            forward_fn = create_forward_fn(desc, warmup)  # builds the attention metadata the graph will read
            standin = sys.modules.get("parity.engines.vllm.cpu_ops")
            for made in standin.scheduler_metadata_made() if standin is not None else ():
                state.witness.known(STANDIN_METADATA, made)

            def forward(cg_mode: Any) -> Any:
                return state.witness.captured(desc, lambda: forward_fn(cg_mode), recording)()
            # A warm-up function captures only vLLM's compiled pieces (its PIECEWISE call); the others
            # capture the FULL graph (called inside the graph) or a breakable one.
            captures = not warmup or (desc.cg_mode.name == "PIECEWISE" and not state.breakable)
            return forward if captures else forward_fn

        return create

    # --- a step --------------------------------------------------------------------------------------

    def open(self, control: Any) -> None:
        """`execute_model` begins: every write into a watched buffer until the replay is this step's."""
        self.close()
        if not self._managers:
            return
        manager = self._managers[-1]
        tag = UNSENT if control is None else control.tag
        snapshot = manager.witness.snapshot() if control is not None else {}
        writes = manager.witness.writes(tag)
        writes.__enter__()
        self._window = _Window(tag, manager, writes, snapshot)

    def close(self) -> _Window | None:
        window, self._window = self._window, None
        if window is not None:
            window.writes.__exit__(None, None, None)
        return window

    def dispatched(self, desc: Any) -> None:
        if self._window is not None:
            self._window.desc = desc

    def step(self, batch: Any) -> None:
        if self._window is not None:
            self._window.batch = batch

    def embedded(self, embeds: Any) -> None:
        if self._window is not None and self._window.batch is not None:
            self._window.embeds = embeds.detach().clone()

    def set_deepstack(self, embeds: Any) -> None:
        if self._window is not None:
            self._window.deepstack = embeds.detach().clone()

    def replay(self) -> None:
        """Right before a graph replays the step: its write window ends, and each input it reads is
        held to what the step supplies."""
        window = self.close()
        if window is None or window.tag == UNSENT or window.desc is None or window.batch is None:
            return
        state, batch = window.manager, window.batch
        state.witness.changed_since(window.snapshot)
        label = graph_label(window.desc, bool(batch.has_prefill), state.breakable)
        # What the graph read, and what it must read whenever the step supplies it (design §6).
        must = {name for name in state.watched if name.startswith(DEEPSTACK)} | {"mrope_positions", "input_embeds"}
        read = {i.name for i in state.witness.inputs(window.desc)}
        records = state.witness.check(window.desc, label, _supplied(state, window, read | must))
        self.channel.append_freshness(window.tag, os.getpid(), process_role(), _one_deepstack(records))


def _watched(deepstack: Any, model_state: Any, input_buffers: Any, block_tables: Any) -> dict[str, tuple[Any, int]]:
    """The per-call buffers the witness judges, by name: (buffer, token or request axis)."""
    watched = {name: (getattr(input_buffers, name), 0)
               for name in ("input_ids", "positions", "query_start_loc", "seq_lens", "is_padding")
               if getattr(input_buffers, name, None) is not None}
    for g, table in enumerate(getattr(block_tables, "input_block_tables", ())):
        watched[f"block_table[{g}]"] = (table, 0)
    if getattr(block_tables, "slot_mappings", None) is not None:
        watched["slot_mapping"] = (block_tables.slot_mappings, 1)
    rope = getattr(model_state, "rope_state", None)
    if rope is not None:
        watched["mrope_positions"] = (rope.positions, 1)
    runner = getattr(model_state, "encoder_runner", None)
    embeds = getattr(runner, "inputs_embeds", None)
    if embeds is None:
        embeds = getattr(model_state, "inputs_embeds", None)
    if embeds is not None:
        watched["input_embeds"] = (embeds, 0)
    for level, buffer in enumerate(deepstack):
        watched[_LEVEL.format(level)] = (buffer, 0)
    return watched


def _record_embeddings(model_state: Any, witness: VllmFreshness) -> None:
    """What the step's embedding computes (`embed_input_ids`, before the encoder runner copies it into
    its buffer), handed to the witness: the embeddings the step supplies."""
    runner = getattr(model_state, "encoder_runner", None)
    model = getattr(runner, "model", None)
    embed = getattr(model, "embed_input_ids", None)
    if embed is None or getattr(embed, "__parity_witness__", False):
        return

    def recorded(*args: Any, **kwargs: Any) -> Any:
        out = embed(*args, **kwargs)
        witness.embedded(out)
        return out

    recorded.__parity_witness__ = True
    object.__setattr__(model, "embed_input_ids", recorded)


def _supplied(state: _Manager, window: _Window, wanted: set[str]) -> dict[str, Any]:
    """What the step supplies for each `wanted` input the witness watches, derived from vLLM's
    per-request state (not from the buffers the graph reads), for its real tokens and requests."""
    import numpy as np
    import torch

    from parity.runner.freshness import Supplied

    batch = window.batch
    reqs, tokens = int(batch.num_reqs), int(batch.num_tokens)
    idx = np.asarray(batch.idx_mapping_np[:reqs], dtype=np.int64)
    scheduled = np.asarray(batch.num_scheduled_tokens[:reqs], dtype=np.int64)
    computed = np.asarray(batch.num_computed_tokens_np[:reqs], dtype=np.int64)
    starts = np.asarray(batch.query_start_loc_np[:reqs + 1], dtype=np.int64)
    # Per real token: its request (row in the batch) and its position in that request.
    owner = np.repeat(np.arange(reqs), scheduled)
    position = computed[owner] + (np.arange(tokens) - starts[owner])
    supplied: dict[str, Any] = {}

    def held(name: str, content: Any, axis: int = 0) -> None:
        if name in wanted and name in state.watched:
            buffer = state.watched[name][0]
            supplied[name] = Supplied(torch.as_tensor(content).to(buffer.device, buffer.dtype), axis, by_content=True)

    held("query_start_loc", starts)
    held("seq_lens", computed + scheduled)
    held("positions", position)
    held("is_padding", np.zeros(tokens, dtype=bool))
    tables = getattr(state.block_tables, "block_tables", ())
    sizes = getattr(state.block_tables, "block_sizes", ())
    slots = []
    for g, source in enumerate(tables):
        source = getattr(source, "gpu", source)
        name = f"block_table[{g}]"
        if name not in state.watched or not {name, "slot_mapping"} & wanted:
            continue
        size = int(sizes[g])
        gathered = state.watched[name][0]
        rows = source[torch.as_tensor(idx, device=source.device)][:, :gathered.shape[1]].cpu()
        # Entries past a request's blocks may hold anything (the gather writes its blocks alone, and
        # attention reads no block past the sequence's): there, expect what they hold.
        expected = gathered[:reqs].cpu().clone()
        for r, blocks in enumerate(-(-(computed + scheduled) // size)):
            expected[r, :blocks] = rows[r, :blocks]
        held(name, expected)
        token_rows = rows[torch.as_tensor(owner)]
        slots.append(token_rows.gather(1, torch.as_tensor(position // size).unsqueeze(1)).squeeze(1) * size
                     + torch.as_tensor(position % size))
    if slots:
        held("slot_mapping", torch.stack(slots), 1)
    rope = getattr(state.model_state, "rope_state", None)
    if rope is not None and "mrope_positions" in wanted:
        held("mrope_positions", _mrope(rope, batch, idx, owner, position), 1)
    if window.embeds is not None:
        held("input_embeds", window.embeds[:tokens])
    _deepstack(state, window, tokens, supplied)
    return supplied


def _mrope(rope: Any, batch: Any, idx: Any, owner: Any, position: Any) -> Any:
    """The scheduled tokens' mRoPE positions, [dims, tokens]: a prefilling request's from its prefill
    positions, a decoding one's its position plus the request's delta (vLLM's rule, `mm/rope.py`)."""
    import numpy as np
    import torch

    dims = int(rope.num_dims)
    prefill = getattr(rope.prefill_positions, "gpu", rope.prefill_positions)
    delta = np.asarray(getattr(rope.prefill_delta, "np", rope.prefill_delta), dtype=np.int64)
    requests = idx[owner]  # per token: its request's row in vLLM's per-request state
    prefilling = (batch.num_computed_tokens_np[:len(idx)] < batch.prefill_len_np[:len(idx)])[owner]
    rows = torch.as_tensor(dims * requests)[None, :] + torch.arange(dims)[:, None]
    columns = torch.as_tensor(np.minimum(position, prefill.shape[1] - 1))[None, :].expand(dims, -1)
    from_prefill = prefill[rows.to(prefill.device), columns.to(prefill.device)].cpu().to(torch.int64)
    decoding = torch.as_tensor(position + delta[requests])[None, :].expand(dims, -1)
    return torch.where(torch.as_tensor(prefilling)[None, :], from_prefill, decoding)


def _deepstack(state: _Manager, window: _Window, tokens: int, supplied: dict[str, Any]) -> None:
    """Per DeepStack level: the rows the step's setter was handed, then zeros over the step's real
    tokens (a step that handed none supplies zeros: text, decode, a text-only chunk)."""
    import torch

    from parity.runner.freshness import Supplied

    for name, (buffer, _) in state.watched.items():
        if not name.startswith(DEEPSTACK):
            continue
        level = int(name[len(DEEPSTACK) + 1:-1])
        content = torch.zeros((tokens, *buffer.shape[1:]), dtype=buffer.dtype, device=buffer.device)
        if window.deepstack is not None:
            rows = min(tokens, window.deepstack.shape[1])
            content[:rows] = window.deepstack[level, :rows]
        supplied[name] = Supplied(content, 0, by_content=True)


def _one_deepstack(records: tuple) -> tuple:
    """vLLM holds DeepStack in one buffer per level: one record for the input, a row offending where
    it offends in any level (the levels are written and read together)."""
    from dataclasses import replace

    out, levels = [], []
    for record in records:
        (levels if record.input.startswith(DEEPSTACK + "[") else out).append(record)
    if not levels:
        return tuple(records)
    worst = max(levels, key=lambda r: (r.offending, r.stale))
    return (*out, replace(worst, input=DEEPSTACK))
