"""`torch.cuda.CUDAGraph` emulated on the CPU: capture records ops on their tensors, replay re-runs them.

A real CUDA graph records kernels with the addresses they read and wrote; replay launches the same
kernels on the same addresses. So a graph sees a live tensor only if it was copied into a captured
one first, and Python control flow and scalars are frozen at capture. This emulation keeps exactly
that property, on the tensor objects instead of addresses:

- `capture_begin` pushes a `TorchDispatchMode` that runs every aten or custom op and records it
  with the very tensors it read and wrote; `capture_end` pops it.
- `replay` re-runs the recorded ops on those tensors. An op that returned a new tensor has its
  fresh result copied into the tensor it produced at capture (the "address" later ops read); an
  op that wrote into an operand (in place, `out=`) writes into it again; a view needs nothing (it
  is the captured memory already; an op that may alias but returned a copy, such as `to` or
  `reshape` under inference mode, is not a view); an allocation has no kernel; an op that answered Python with a
  number (`.item()`, a size) is not asked again: its answer was frozen at capture.
- A fresh result whose shape or dtype differs from the captured one is an error: a real graph
  cannot change shape, and this one never silently falls back to eager.

SGLang's breakable prefill graph (BreakableCUDAGraphCapture) builds one such graph per segment
between its eager breaks and looks `torch.cuda.CUDAGraph` up when it starts a segment, so
setting the attribute in the server process is enough (parity/engines/sglang/cpu_patches.py).

It also enforces what a GPU enforces on graphs (`parity.runner.device_rules`): pool lifetimes, no
host sync and no default stream during capture, and outputs that are borrowed from the pool. What
it cannot show (GPU only): the allocator's real placement, stream and event races, the real
kernels' numerics, capture-time faults of CUDA itself.
Nothing here imports SGLang; torch is imported by whoever builds a graph.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

from parity.runner import device_rules
from parity.runner.device_rules import Stream, graph_pool_handle  # noqa: F401 - the engines' patches install it

# Ops that only allocate: a graph launches no kernel for them, and their contents are undefined.
_ALLOCATIONS = frozenset({"aten::empty", "aten::empty_strided", "aten::new_empty", "aten::new_empty_strided",
                          "aten::empty_like"})


class GraphReplayError(device_rules.GraphRuleError):
    """A replay that a real graph could not do (a shape changed since capture, not captured yet)."""


@dataclass(frozen=True)
class RecordedOp:
    """One op as captured: what to call on which objects, and the tensors it produced."""

    func: Any  # an OpOverload
    args: tuple
    kwargs: dict
    produced: tuple[torch.Tensor, ...]  # new tensors to refresh at replay; empty: nothing to copy
    rerun: bool  # False: a view, an allocation, or a value frozen at capture

    def replay(self) -> None:
        if not self.rerun:
            return
        fresh = self.func(*self.args, **self.kwargs)
        if not self.produced:
            return  # it wrote into its operands
        outputs = [t for t in tree_flatten(fresh)[0] if isinstance(t, torch.Tensor)]
        if len(outputs) != len(self.produced):
            raise GraphReplayError(f"{self.func}: {len(outputs)} outputs at replay, {len(self.produced)} at capture")
        for captured, new in zip(self.produced, outputs):
            if captured.shape != new.shape or captured.dtype != new.dtype:
                raise GraphReplayError(
                    f"{self.func}: output {tuple(new.shape)} {new.dtype} at replay but {tuple(captured.shape)} "
                    f"{captured.dtype} at capture; a graph cannot change shape (a data-dependent op, or a "
                    "captured tensor resized after capture)")
            captured.copy_(new)


def _record(func, args: tuple, kwargs: dict, out: Any) -> RecordedOp:
    schema = func._schema
    writes = any(a.alias_info is not None and a.alias_info.is_write for a in schema.arguments)
    tensors = tuple(t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor))
    if writes:
        # In place or out=: its result aliases the operand it wrote, so running it again is the replay.
        return RecordedOp(func, args, kwargs, (), True)
    if returned_views(func, args, kwargs, tensors) or schema.name in _ALLOCATIONS or not tensors:
        return RecordedOp(func, args, kwargs, (), False)
    return RecordedOp(func, args, kwargs, tensors, True)


def returned_views(func, args: tuple, kwargs: dict, outputs: tuple[torch.Tensor, ...]) -> bool:
    """Whether an op returned views of its operands: its schema says every return aliases one (and
    none is written in place), and every output really shares memory with an operand. Ops such as
    `to`, `reshape` and `contiguous` may alias by their schema yet return a copy (a dtype change, a
    non-contiguous input): those are kernels that read their operand, not views of its memory."""
    returns = func._schema.returns
    if not returns or any(r.alias_info is None or r.alias_info.is_write for r in returns):
        return False
    operands = {t.untyped_storage().data_ptr() for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)}
    return all(t.untyped_storage().data_ptr() in operands for t in outputs)


class _Recorder(TorchDispatchMode):
    def __init__(self, ops: list[RecordedOp], refuse_syncs: bool) -> None:
        super().__init__()
        self.ops = ops
        self.refuse_syncs = refuse_syncs

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.refuse_syncs:
            device_rules.refuse_syncing_op(func, args)
        out = func(*args, **kwargs)
        self.ops.append(_record(func, args, kwargs, out))
        return out


_CAPTURING: list["EmulatedGraph"] = []  # the graphs capturing now, innermost last


def capturing() -> bool:
    """Whether an emulated graph is capturing (the CPU's `torch.cuda.is_current_stream_capturing`)."""
    return bool(_CAPTURING)


class EmulatedGraph:
    """The surface of `torch.cuda.CUDAGraph` that graph runners use, on any device, with the rules a
    GPU enforces (`device_rules`): it joins its pool at capture and leaves it when reset or destroyed."""

    # Host syncs and the capture stream are checked: parity's own runner holds only device tensors
    # and captures through `graph`, as on a GPU. `EngineEmulatedGraph` is the engines' graph.
    enforces_host_rules = True

    def __init__(self, keep_graph: bool = False) -> None:
        self._ops: list[RecordedOp] = []
        self._modes: list[Any] = []
        self._captured = False
        self._pool: device_rules.PoolId | None = None
        self._id = device_rules.new_graph_id()
        self._leave_pool: Callable[[], Any] | None = None

    def capture_begin(self, pool: Any = None, capture_error_mode: str = "global") -> None:
        if self._modes or self._captured:
            raise GraphReplayError("capture_begin on a graph that is capturing or already captured; reset() first")
        if self.enforces_host_rules:
            device_rules.check_capture_stream()
        self._pool = tuple(pool) if pool is not None else graph_pool_handle()
        self._leave_pool = device_rules.join_pool(self, self._pool, self._id)
        self._modes = [_Recorder(self._ops, self.enforces_host_rules)]
        if self.enforces_host_rules:
            self._modes.append(device_rules.HostReadGuard())
        for mode in self._modes:
            mode.__enter__()
        _CAPTURING.append(self)

    def capture_end(self) -> None:
        if not self._modes:
            raise GraphReplayError("capture_end without capture_begin")
        _CAPTURING.remove(self)
        modes, self._modes = self._modes, []
        for mode in reversed(modes):
            mode.__exit__(None, None, None)
        self._captured = True

    def replay(self) -> None:
        if not self._captured:
            raise GraphReplayError("replay of a graph that was never captured")
        for op in self._ops:
            op.replay()
        device_rules.POOLS.replayed(self._pool, self._id)

    def reset(self) -> None:
        if self._modes:
            self.capture_end()
        self._ops.clear()
        self._captured = False
        if self._leave_pool is not None:
            self._leave_pool()  # as a destroyed graph: its pool's use count drops
            self._leave_pool = None

    def pool(self) -> tuple[int, int]:
        if self._pool is None:
            raise GraphReplayError("pool() of a graph that was never captured")
        return self._pool

    def instantiate(self) -> None:
        """Nothing to build: the recorded ops are the graph."""

    def enable_debug_mode(self) -> None:
        """Nothing to keep: the recorded ops are always there."""

    @property
    def op_count(self) -> int:
        return len(self._ops)

    def __repr__(self) -> str:
        state = "captured" if self._captured else "capturing" if self._modes else "empty"
        return f"{type(self).__name__}({state}, {len(self._ops)} ops)"


class EngineEmulatedGraph(EmulatedGraph):
    """An engine's graph, emulated: the pool and output rules only. Inside a real engine's CPU
    server every tensor, the engine's host-side ones included, is the CPU's, and every stream the
    CPU's one stream, so a host read or the stream a capture ran on cannot be told apart (that
    stays GPU-only there). The embedded engine's vision-encoder graphs are one too: an engine
    computes their layout metadata on the host before capture, where Hugging Face's tower reads
    its grid inside the captured call (parity/runner/encoder_graphs.py)."""

    enforces_host_rules = False


def capture(fn: Callable[[], Any], pool: Any = None, name: str = "a graph",
            graph_class: type[EmulatedGraph] = EmulatedGraph) -> tuple[EmulatedGraph, Any]:
    """Capture `fn()` into a new graph in `pool` (a new pool if None), on a side stream as
    `torch.cuda.graph` does; returns the graph and what `fn` returned, its tensors borrowed
    (`device_rules.PoolOutput`: valid only from this graph's replay until another of its pool replays)."""
    cuda_graph = graph_class()
    with graph(cuda_graph, pool=pool):
        out = fn()
    return cuda_graph, tree_map(
        lambda t: device_rules.borrowed(t, cuda_graph.pool(), cuda_graph._id, name) if isinstance(t, torch.Tensor)
        else t, out)


class graph:  # noqa: N801 - named as `torch.cuda.graph`, which it stands for
    """`torch.cuda.graph(cuda_graph, pool, stream)`: capture whatever runs inside the `with` into an
    `EmulatedGraph`, on `stream` or, as torch does, on a side stream of its own."""

    def __init__(self, cuda_graph: EmulatedGraph, pool: Any = None, stream: Any = None,
                 capture_error_mode: str = "global") -> None:
        self.cuda_graph, self.pool = cuda_graph, pool
        self.stream = stream if stream is not None else Stream("capture")
        self._on_stream = None

    def __enter__(self) -> None:
        self._on_stream = device_rules.on_stream(self.stream)
        self._on_stream.__enter__()
        try:
            self.cuda_graph.capture_begin(pool=self.pool)
        except BaseException:
            self._on_stream.__exit__(None, None, None)
            raise

    def __exit__(self, *exc: Any) -> None:
        try:
            self.cuda_graph.capture_end()
        finally:
            self._on_stream.__exit__(None, None, None)
