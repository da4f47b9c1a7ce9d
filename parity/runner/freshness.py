"""The freshness witness (design §6, "Every input a graph reads, fresh for every request").

The bug class parity was founded on is wider than DeepStack: a captured graph reads a per-call
input that the runner did not refresh for this call. The witness needs no answer to move. It
watches two things, and never a replay itself (on a GPU there is nothing to intercept in one):

- **Capture.** While a graph is captured, every tensor its ops read that no op of the capture
  produced, and that is not a parameter or buffer of the model, is one of its per-call inputs.
  Each is named by the buffer the runner holds it in (`watch`); one it does not hold is listed as
  unnamed.
- **The writes between replays.** While the runner refreshes its buffers for a request (`writes`),
  each op that writes into a watched buffer records, per token row, that this request's write
  left the row (`parity.row_owners`).

After each replay, `check` reads, per input of the graph, the rows a correct runner writes for the
request, and compares them with what the request supplies at the LM entry: a row this request's
refresh did not write, or wrote with other values, offends. The result is one `InputFreshness`
per input.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator, Mapping

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from parity.evidence import FIRST_OFFENDING_ROWS, InputFreshness
from parity.runner.emulated_graph import returned_views
from parity.row_owners import RowOwners


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def _tensors(tree: Any) -> list[torch.Tensor]:
    return [t for t in tree_flatten(tree)[0] if isinstance(t, torch.Tensor) and t.numel() > 0]


@dataclass(frozen=True)
class Supplied:
    """What a correct runner leaves in an input's buffer for this replay: `content` fills the
    buffer's leading corner of the same shape (rows along `token_axis`), and every one of those rows
    must be this request's write. Rows past it may hold anything (the design argues which).

    `by_content`: only rows holding other values than `content` offend. For a runner whose refresh
    writes through kernels no op-level watch sees (vLLM's Triton preparation, on a GPU as on a CPU),
    an unseen write and no write look alike; a row is then judged by what it holds, and its last
    seen writer only names who left it."""

    content: torch.Tensor
    token_axis: int = 0
    by_content: bool = False

    @property
    def rows(self) -> int:
        return self.content.shape[self.token_axis]


class _Watched:
    def __init__(self, name: str, buffer: torch.Tensor, token_axis: int, owners: RowOwners) -> None:
        self.name, self.buffer, self.token_axis, self.owners = name, buffer, token_axis, owners

    def rows_of(self, view: torch.Tensor) -> range:
        """The token rows a write into `view` (a view of this buffer) covers. A slice in every axis
        has its lowest element in its first row and its highest in its last; any other view is taken
        to cover every row, so a write can only be over-counted, never a row missed as stale."""
        rows = self.buffer.shape[self.token_axis]
        stride = self.buffer.stride(self.token_axis)
        low = view.storage_offset() - self.buffer.storage_offset()
        high = low + sum((s - 1) * st for s, st in zip(view.shape, view.stride()))
        first, last = (low // stride) % rows, (high // stride) % rows
        return range(first, last + 1) if first <= last else range(rows)


# Ops whose first operand is only written: their destination is not read.
_WRITE_ONLY = frozenset({"aten::copy_", "aten::fill_", "aten::zero_"})


class _Reads(TorchDispatchMode):
    """During a capture: the storages the graph's ops read that no op of the capture produced.
    `recording()` says whether an op is the graph's: always for a graph captured whole; for one
    captured in segments with eager breaks between (SGLang's breakable graph), only while a segment
    captures, the breaks' outputs being produced in the capture all the same."""

    def __init__(self, excluded: set[int], recording: Callable[[], bool]) -> None:
        super().__init__()
        self.excluded = excluded
        self.recording = recording
        self.produced: set[int] = set()
        self.read: dict[int, torch.Tensor] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if returned_views(func, args, kwargs, tuple(_tensors(out))):  # a view reads no data: the ops on it do
            return out
        if self.recording():
            operands = args[1:] if func._schema.name in _WRITE_ONLY else args
            for t in _tensors((operands, kwargs)):
                key = _storage(t)
                if key not in self.produced and key not in self.excluded:
                    self.read.setdefault(key, t)
        self.produced.update(_storage(t) for t in _tensors(out))
        return out


class _Writes(TorchDispatchMode):
    """Between replays: each op that writes into a watched buffer marks the rows it covered."""

    def __init__(self, watched: Mapping[int, _Watched]) -> None:
        super().__init__()
        self.watched = watched

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        for i, argument in enumerate(func._schema.arguments):
            if argument.alias_info is None or not argument.alias_info.is_write:
                continue
            value = kwargs.get(argument.name, args[i] if i < len(args) else None)
            for t in _tensors(value):
                watched = self.watched.get(_storage(t))
                if watched is not None:
                    rows = watched.rows_of(t)
                    watched.owners.wrote(rows.stop, rows.start)
        return out


@dataclass(frozen=True)
class GraphInput:
    """A per-call input of a captured graph: the name of the buffer it lives in (`unnamed …` when
    the runner holds no such buffer) and that buffer's storage."""

    name: str
    storage: int


class FreshnessWitness:
    """The per-call inputs of each captured graph and who last wrote each of their rows."""

    def __init__(self, model_state: Iterable[torch.Tensor], known: Mapping[str, torch.Tensor] | None = None) -> None:
        """`model_state`: what no graph input is (weights, caches the graph writes); `known`: tensors
        an input may be, named where the runner holds them, listed but not judged."""
        self._excluded = {_storage(t) for t in model_state if t.numel() > 0}
        self._known = {_storage(t): name for name, t in (known or {}).items() if t.numel() > 0}
        self._watched: dict[int, _Watched] = {}
        self._inputs: dict[Any, tuple[GraphInput, ...]] = {}

    def known(self, name: str, tensor: torch.Tensor) -> None:
        """Name `tensor` where a graph reads it (listed, not judged): one made after the witness was."""
        self._known[_storage(tensor)] = name

    def watch(self, name: str, buffer: torch.Tensor, token_axis: int = 0,
              grown_from: torch.Tensor | None = None) -> None:
        """Hold `buffer` as the input `name`. `grown_from`: the buffer it replaces, whose contents
        (and so whose rows' writers) it took over."""
        owners = RowOwners(buffer.shape[token_axis])
        old = None if grown_from is None else self._watched.get(_storage(grown_from))
        if old is not None:
            owners.took_over(old.owners)
        self._watched[_storage(buffer)] = _Watched(name, buffer, token_axis, owners)

    def captured(self, key: Any, fn: Callable[[], Any],
                 recording: Callable[[], bool] = lambda: True) -> Callable[[], Any]:
        """`fn`, which a graph captures, with its per-call inputs recorded as graph `key`'s (the
        reads of its ops while `recording()`; see `_Reads`)."""

        def discovering():
            reads = _Reads(self._excluded, recording)
            with reads:
                out = fn()
            found = {self._name(storage, t): storage for storage, t in reads.read.items()}
            self._inputs[key] = tuple(GraphInput(name, storage) for name, storage in found.items())
            return out
        return discovering

    def _name(self, storage: int, t: torch.Tensor) -> str:
        watched = self._watched.get(storage)
        if watched is not None:
            return watched.name
        if storage in self._known:
            return self._known[storage]
        return f"unnamed {tuple(t.shape)} {str(t.dtype).removeprefix('torch.')}"

    def inputs(self, key: Any) -> tuple[GraphInput, ...]:
        return self._inputs.get(key, ())

    def forget(self, keys: Iterable[Any]) -> None:
        for key in keys:
            self._inputs.pop(key, None)

    @contextmanager
    def writes(self, tag: str | None) -> Iterator[None]:
        """Everything written into a watched buffer inside is this request's write (`tag`)."""
        for watched in self._watched.values():
            watched.owners.begin(tag)
        with _Writes(self._watched):
            yield

    def snapshot(self) -> dict[int, torch.Tensor]:
        """Every watched buffer's contents, for `changed_since` at the end of a write window."""
        return {storage: w.buffer.clone() for storage, w in self._watched.items()}

    def changed_since(self, snapshot: Mapping[int, torch.Tensor]) -> None:
        """Rows of watched buffers that hold other values than in `snapshot` were written by the
        write in hand, whoever wrote them: a kernel launch no op-level watch sees (Triton's)."""
        for storage, before in snapshot.items():
            watched = self._watched[storage]
            rows = _any_per_row(watched.buffer != before, watched.token_axis).nonzero().flatten().tolist()
            for row in rows:
                watched.owners.wrote(row + 1, row)

    def check(self, key: Any, graph: str, supplied: Mapping[str, Supplied | None]) -> tuple[InputFreshness, ...]:
        """After a replay of graph `key`: per input it read, and per input the request supplied that
        it never read, the rows that offend. `supplied[name]` None: the request supplies nothing
        there (a buffer the graph reads is then unwritten wherever it holds anything)."""
        records, read = [], set()
        for graph_input in self.inputs(key):
            read.add(graph_input.name)
            watched = self._watched.get(graph_input.storage)
            expected = supplied.get(graph_input.name)
            if watched is None or expected is None:
                records.append(InputFreshness(graph, graph_input.name, 1, 0))  # listed; nothing to hold it to
                continue
            records.append(self._judged(graph, watched, expected))
        for name, expected in supplied.items():
            if name not in read and expected is not None:
                records.append(_never_read(graph, name, expected))
        return tuple(records)

    def _judged(self, graph: str, watched: _Watched, expected: Supplied) -> InputFreshness:
        rows = expected.rows
        corner = tuple(slice(0, s) for s in expected.content.shape)
        held = watched.buffer[corner]
        differs = _any_per_row(held != expected.content.to(held.dtype), expected.token_axis).tolist()
        current = watched.owners.current
        stale, unwritten, miswritten, offending = [], 0, 0, []
        for row in range(rows):
            if expected.by_content and not differs[row]:
                continue
            writer = watched.owners.owner(row)
            if writer is not None and writer != current:
                stale.append(row)
            elif writer is None:
                unwritten += 1
            elif differs[row]:
                miswritten += 1
            else:
                continue
            offending.append(row)
        return InputFreshness(graph, watched.name, 1, rows, len(stale), unwritten, miswritten,
                              tuple(offending[:FIRST_OFFENDING_ROWS]), watched.owners.named(stale) if stale else None)


def tensors_held(holder: Any, prefix: str = "") -> dict[str, torch.Tensor]:
    """The tensors an engine object holds as attributes, or in a list or tuple attribute, by
    `prefix.attr` (`prefix.attr[i]`): what an input the runner does not watch may be named by. An
    engine's staged or host-backed tensor (vLLM's) keeps its device copy in `.gpu`."""
    found = {}
    for attr, value in (vars(holder).items() if hasattr(holder, "__dict__") else ()):
        items = value if isinstance(value, (list, tuple)) else [value]
        for i, item in enumerate(items):
            item = getattr(item, "gpu", item)
            if isinstance(item, torch.Tensor):
                found[f"{prefix}.{attr}" + (f"[{i}]" if len(items) > 1 else "")] = item
    return found


def padded(live: torch.Tensor | None, buffer: torch.Tensor, rows: int, token_axis: int = 0) -> torch.Tensor:
    """What a correct refresh leaves in the first `rows` token rows of `buffer`: the live rows, then
    zeros (None: a request that supplies nothing there)."""
    shape = list(buffer.shape)
    shape[token_axis] = rows
    content = torch.zeros(shape, dtype=buffer.dtype, device=buffer.device)
    if live is not None:
        content.narrow(token_axis, 0, live.shape[token_axis]).copy_(live)
    return content


def _any_per_row(mask: torch.Tensor, token_axis: int) -> torch.Tensor:
    """Per token row, whether any element of `mask` in it is set."""
    other = [d for d in range(mask.dim()) if d != token_axis]
    return mask.any(dim=other) if other else mask


def _never_read(graph: str, name: str, expected: Supplied) -> InputFreshness:
    """The request supplied `name`, and the graph reads no buffer of it: each row it supplied with
    something in it was dropped (a request that supplied only zeros lost nothing)."""
    rows = _any_per_row(expected.content != 0, expected.token_axis).nonzero().flatten().tolist()
    return InputFreshness(graph, name, 1, expected.rows, unwritten=len(rows), first=tuple(rows[:FIRST_OFFENDING_ROWS]))
