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

What it cannot show (GPU only): memory-pool aliasing (every captured tensor stays alive here),
stream and event races, the real kernels' numerics, capture-time faults of CUDA itself.
Nothing here imports SGLang; torch is imported by whoever builds a graph.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

# Ops that only allocate: a graph launches no kernel for them, and their contents are undefined.
_ALLOCATIONS = frozenset({"aten::empty", "aten::empty_strided", "aten::new_empty", "aten::new_empty_strided",
                          "aten::empty_like"})
_POOLS = itertools.count(1)


class GraphReplayError(RuntimeError):
    """A replay that a real graph could not do (a shape changed since capture, not captured yet)."""


def graph_pool_handle() -> tuple[int, int]:
    """What `torch.cuda.graph_pool_handle()` gives: an opaque id; the emulation has no pools."""
    return (0, next(_POOLS))


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
    views = bool(schema.returns) and all(r.alias_info is not None for r in schema.returns)
    tensors = tuple(t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor))
    if writes:
        # In place or out=: its result aliases the operand it wrote, so running it again is the replay.
        return RecordedOp(func, args, kwargs, (), True)
    if (views and _aliases_an_operand(tensors, args, kwargs)) or schema.name in _ALLOCATIONS or not tensors:
        return RecordedOp(func, args, kwargs, (), False)
    return RecordedOp(func, args, kwargs, tensors, True)


def _aliases_an_operand(outputs: tuple[torch.Tensor, ...], args: tuple, kwargs: dict) -> bool:
    """Whether every output really shares memory with an operand. Ops such as `to`, `reshape` and
    `contiguous` may alias by their schema yet return a copy (a dtype change, a non-contiguous
    input): those are kernels the graph re-runs, not views of captured memory."""
    operands = {t.untyped_storage().data_ptr() for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)}
    return all(t.untyped_storage().data_ptr() in operands for t in outputs)


class _Recorder(TorchDispatchMode):
    def __init__(self, ops: list[RecordedOp]) -> None:
        super().__init__()
        self.ops = ops

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self.ops.append(_record(func, args, kwargs, out))
        return out


class EmulatedGraph:
    """The surface of `torch.cuda.CUDAGraph` that graph runners use, on any device."""

    def __init__(self, keep_graph: bool = False) -> None:
        self._ops: list[RecordedOp] = []
        self._recorder: _Recorder | None = None
        self._captured = False
        self._pool: tuple[int, int] | None = None

    def capture_begin(self, pool: Any = None, capture_error_mode: str = "global") -> None:
        if self._recorder is not None or self._captured:
            raise GraphReplayError("capture_begin on a graph that is capturing or already captured; reset() first")
        self._pool = tuple(pool) if pool is not None else graph_pool_handle()
        self._recorder = _Recorder(self._ops)
        self._recorder.__enter__()

    def capture_end(self) -> None:
        if self._recorder is None:
            raise GraphReplayError("capture_end without capture_begin")
        recorder, self._recorder = self._recorder, None
        recorder.__exit__(None, None, None)
        self._captured = True

    def replay(self) -> None:
        if not self._captured:
            raise GraphReplayError("replay of a graph that was never captured")
        for op in self._ops:
            op.replay()

    def reset(self) -> None:
        if self._recorder is not None:
            self.capture_end()
        self._ops.clear()
        self._captured = False

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
        state = "captured" if self._captured else "capturing" if self._recorder else "empty"
        return f"EmulatedGraph({state}, {len(self._ops)} ops)"


def capture(fn: Callable[[], Any]) -> tuple[EmulatedGraph, Any]:
    """Capture `fn()` into a new graph; returns the graph and what `fn` returned (its outputs)."""
    graph = EmulatedGraph()
    graph.capture_begin()
    try:
        out = fn()
    finally:
        graph.capture_end()
    return graph, out


class graph:  # noqa: N801 - named as `torch.cuda.graph`, which it stands for
    """`torch.cuda.graph(cuda_graph, pool, stream)`: capture whatever runs inside the `with` into an
    `EmulatedGraph`. The stream is accepted and ignored (a CPU has one)."""

    def __init__(self, cuda_graph: EmulatedGraph, pool: Any = None, stream: Any = None,
                 capture_error_mode: str = "global") -> None:
        self.cuda_graph, self.pool = cuda_graph, pool

    def __enter__(self) -> None:
        self.cuda_graph.capture_begin(pool=self.pool)

    def __exit__(self, *exc: Any) -> None:
        self.cuda_graph.capture_end()
