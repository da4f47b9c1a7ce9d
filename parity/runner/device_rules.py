"""What a GPU enforces on CUDA graphs, enforced by the emulated graph on any device (design §6).

A CPU run of the emulation once passed code that crashed on the first H200: captures into a
memory pool whose graphs were all gone. CPU CI sees that class of bug only if the emulation refuses
what CUDA refuses, and poisons what CUDA silently corrupts. Four rules, each a typed error:

- **Pool lifetimes** (`PoolReuseError`). Graphs captured with the same pool id share one private
  memory pool whose use count is the number of live graphs in it. When the last one is destroyed
  the pool is dead: CUDA's caching allocator asserts (`it->second->use_count > 0`,
  `create_or_incref_pool`) on a capture into it while any of its memory is still reserved. The
  emulation refuses every capture into a dead pool: a new pool id is the only safe choice.
- **Host syncs during capture** (`CaptureSyncError`). A stream being captured cannot synchronise
  with the host: `.item()`, `.tolist()`, `.cpu()`, `.numpy()`, a tensor read as a Python bool, int
  or float, and ops whose output shape depends on the data (`nonzero`, `masked_select`, `unique`).
- **No capture on the default stream** (`DefaultStreamCaptureError`): CUDA refuses it;
  `torch.cuda.graph` (and `emulated_graph.graph`) capture on a side stream.
- **Borrowed outputs** (`PoisonedOutputError`). A graph's outputs live in its pool and are valid
  only from its own replay until another graph of the same pool replays: graphs that share a pool
  may place one graph's outputs in another's scratch memory, and a capture computes nothing, so
  outputs read before the first replay are garbage too. On a GPU the read returns garbage,
  silently; here it raises. Callers copy outputs out (`clone()`) before another replay.

What stays GPU-only: the real allocator's placement, stream and event races, kernels' numerics.
Real engines on a CPU run with the pool rule only (`EngineEmulatedGraph`): their host and device
tensors are all the CPU's and all their streams the CPU's one stream, so a host read or the stream
a capture ran on cannot be told from the tensors alone.
"""

from __future__ import annotations

import itertools
import threading
import weakref
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

PoolId = tuple[int, int]


class GraphRuleError(RuntimeError):
    """A graph operation a real GPU refuses, or whose result it would silently corrupt."""


class PoolReuseError(GraphRuleError):
    """A capture into a memory pool whose graphs have all been destroyed."""


class CaptureSyncError(GraphRuleError):
    """A host synchronisation while a graph is being captured."""


class DefaultStreamCaptureError(GraphRuleError):
    """A capture begun on the default stream."""


class PoisonedOutputError(GraphRuleError):
    """A graph's output read when the pool no longer holds what that graph computed."""


# --- pools -----------------------------------------------------------------------------------------------

_POOL_IDS = itertools.count(1)
_GRAPH_IDS = itertools.count(1)


def graph_pool_handle() -> PoolId:
    """A fresh pool id, as `torch.cuda.graph_pool_handle()` gives: no pool exists until a capture uses it."""
    return (0, next(_POOL_IDS))


def new_graph_id() -> int:
    return next(_GRAPH_IDS)


@dataclass
class _Pool:
    graphs: set[int] = field(default_factory=set)  # the live graphs captured into it: its use count
    valid_outputs: int | None = None  # the graph whose outputs the pool holds now (the last to replay)


class _Pools:
    """Every pool a capture has used in this process, live or dead."""

    def __init__(self) -> None:
        self._lock = threading.Lock()  # a server's capture and a finalizer may run in other threads
        self._live: dict[PoolId, _Pool] = {}
        self._dead: set[PoolId] = set()

    def join(self, pool: PoolId, graph: int) -> None:
        with self._lock:
            if pool in self._dead:
                raise PoolReuseError(
                    f"capture into graph pool {pool}, whose graphs have all been destroyed: CUDA's caching "
                    "allocator asserts `use_count > 0` (create_or_incref_pool) on it while any of its memory is "
                    "reserved; graphs captured after the others are gone need a new pool id (graph_pool_handle())")
            self._live.setdefault(pool, _Pool()).graphs.add(graph)

    def leave(self, pool: PoolId, graph: int) -> None:
        with self._lock:
            state = self._live.get(pool)
            if state is None:
                return
            state.graphs.discard(graph)
            if state.valid_outputs == graph:
                state.valid_outputs = None
            if not state.graphs:
                del self._live[pool]
                self._dead.add(pool)

    def replayed(self, pool: PoolId, graph: int) -> None:
        with self._lock:
            self._live[pool].valid_outputs = graph

    def holds_outputs_of(self, pool: PoolId, graph: int) -> bool:
        with self._lock:
            state = self._live.get(pool)
            return state is not None and state.valid_outputs == graph

    def use_count(self, pool: PoolId) -> int:
        with self._lock:
            state = self._live.get(pool)
            return 0 if state is None else len(state.graphs)


POOLS = _Pools()


def join_pool(owner: object, pool: PoolId, graph: int) -> weakref.finalize:
    """`graph` joins `pool` while `owner` (the graph object) lives: the returned finalizer leaves it,
    when called (a reset) or when the owner is destroyed, as a CUDA graph's destructor releases its pool."""
    POOLS.join(pool, graph)
    return weakref.finalize(owner, POOLS.leave, pool, graph)


# --- streams ---------------------------------------------------------------------------------------------

class Stream:
    """An emulated stream: only which stream a capture runs on matters here."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return f"Stream({self.name})"


DEFAULT_STREAM = Stream("default")
_CURRENT = threading.local()


def current_stream() -> Any:
    return getattr(_CURRENT, "stream", DEFAULT_STREAM)


@contextmanager
def on_stream(stream: Any) -> Iterator[None]:
    """Make `stream` current in this thread, as `torch.cuda.stream(stream)` does."""
    before = current_stream()
    _CURRENT.stream = stream
    try:
        yield
    finally:
        _CURRENT.stream = before


def check_capture_stream() -> None:
    if current_stream() is DEFAULT_STREAM:
        raise DefaultStreamCaptureError(
            "CUDA graphs must be captured on a non-default stream: capture inside `torch.cuda.graph(...)` "
            "(or `emulated_graph.graph(...)`), which captures on a side stream, or inside `with "
            "torch.cuda.stream(side):`")


# --- host syncs ------------------------------------------------------------------------------------------

# Ops that answer the host (a scalar, a bool) or whose output shape depends on the data.
_SYNCING_OPS = frozenset({"aten::_local_scalar_dense", "aten::nonzero", "aten::is_nonzero", "aten::equal",
                          "aten::masked_select", "aten::_unique2", "aten::unique_dim", "aten::unique_consecutive"})
# Tensor methods that copy to the host without an op the dispatcher sees. (`.to(device)` is not one:
# here the model's device is the host, so a device-preserving `.to(x.device)` cannot be told apart.)
_HOST_COPIES = frozenset({"cpu", "numpy", "tolist"})


def refuse_syncing_op(func: Any, args: tuple) -> None:
    """Called for every op a capture records."""
    name = func._schema.name
    masked = name == "aten::index" and any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8)
                                           for i in (args[1] if len(args) > 1 else ()) if i is not None)
    if name in _SYNCING_OPS or masked:
        raise CaptureSyncError(
            f"{func._schema.name} during graph capture: it synchronises with the host (a value read back, or "
            "an output shaped by the data), which a stream being captured cannot do")


class HostReadGuard(TorchFunctionMode):
    """Refuses, while a graph captures, the host copies that no op of the dispatcher shows."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name in _HOST_COPIES:
            raise CaptureSyncError(
                f"Tensor.{name}() during graph capture: a copy to the host synchronises, which a stream being "
                "captured cannot do")
        return func(*args, **kwargs)


# --- borrowed outputs ------------------------------------------------------------------------------------

# Reading these reads no memory of the tensor: allowed on a poisoned output (views are too).
_METADATA = frozenset({"shape", "size", "dim", "ndim", "dtype", "device", "stride", "numel", "nelement",
                       "is_contiguous", "data_ptr", "untyped_storage", "storage_offset", "element_size",
                       "__len__", "layout", "requires_grad", "is_inference", "is_cuda", "is_floating_point",
                       "is_complex", "__hash__", "_is_view", "_base", "grad_fn", "is_leaf", "names"})


class PoolOutput(torch.Tensor):
    """A graph's static output as its caller sees it: every read checks that the pool still holds
    what this graph computed (`PoisonedOutputError` otherwise); a view of it is one too, a computed
    result (a `clone()`) is a plain tensor the caller owns."""

    _pool: PoolId
    _graph: int
    _graph_name: str

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        outputs = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, PoolOutput)]
        with torch._C.DisableTorchFunctionSubclass():  # inspected as plain tensors: no recursion
            result = func(*args, **kwargs)
            sources = {o.untyped_storage().data_ptr(): o for o in outputs}
            tensors = [t for t in tree_flatten(result)[0] if isinstance(t, torch.Tensor)]
            views = [(t, sources[t.untyped_storage().data_ptr()]) for t in tensors
                     if t.untyped_storage().data_ptr() in sources]
        if not (views and len(views) == len(tensors)) and _name(func) not in _METADATA:
            for output in outputs:
                output.check_valid(_name(func))
        for view, source in views:  # a view reads nothing, and stays borrowed
            result = _rewrapped(result, view, source)
        return result

    def check_valid(self, what: str) -> None:
        if not POOLS.holds_outputs_of(self._pool, self._graph):
            raise PoisonedOutputError(
                f"{what} read an output of {self._graph_name} after another graph sharing its pool {self._pool} "
                "replayed (or before it replayed at all): on a GPU that memory may hold the other graph's "
                "scratch, and the read returns garbage; copy outputs out (clone()) right after the replay")


def borrowed(tensor: torch.Tensor, pool: PoolId, graph: int, graph_name: str) -> PoolOutput:
    """`tensor` (a graph's static output) as its caller may see it."""
    with torch._C.DisableTorchFunctionSubclass():
        output = tensor.as_subclass(PoolOutput)
    output._pool, output._graph, output._graph_name = pool, graph, graph_name
    return output


def _rewrapped(result: Any, view: torch.Tensor, source: PoolOutput) -> Any:
    wrapped = borrowed(view, source._pool, source._graph, source._graph_name)
    if result is view:
        return wrapped
    if isinstance(result, tuple):
        return type(result)(wrapped if r is view else r for r in result)
    if isinstance(result, list):
        return [wrapped if r is view else r for r in result]
    return result


def _name(func: Any) -> str:
    name = getattr(func, "__name__", "")
    if name == "__get__":  # a property (`.shape`, `.dtype`): its descriptor's name
        return getattr(getattr(func, "__self__", None), "__name__", name)
    return name
