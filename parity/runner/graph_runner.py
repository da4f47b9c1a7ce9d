"""The prefill graph runner and its slot contract (design §6): the fix parity validates.

A captured graph reads only its static slots. Every live input must be copied into a slot before
replay, or the graph silently computes with whatever the slot held: that is how SGLang's BCG
dropped Qwen3-VL's DeepStack. The `fixed` variant refreshes the DeepStack slot before every
replay, clears it on absence and fails closed on malformed input; `legacy` and `no-clear`
reproduce the two ways of getting it wrong, so parity can prove it tells them apart.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, replace
from typing import Callable, Iterator

import torch
from torch import nn

from parity.evidence import InputFreshness
from parity.runner import emulated_graph, slot_contract
from parity.runner.freshness import FreshnessWitness, Supplied, padded
from parity.runner.lm_body import ConsumesDeepStack, Past, fill_packed_mask
from parity.runner.packing import Packed

Outputs = tuple[torch.Tensor, ...]  # token-major: every output's first axis is the bucket's rows


PAST_INPUTS = ("past_keys", "past_values", "past_mask")  # a context graph's slots, as the witness names them

# --poison (design §6): what the rows a request must write hold just before its refresh. Finite, so
# that a masked attention weight (exactly 0) times it is exactly 0, and exact in every float dtype.
POISON = -6144.0
POISON_POSITION = 1 << 20  # a position far past any prompt (a finite rotation)


class RunnerVariant(str, enum.Enum):
    FIXED = "fixed"  # the slot contract of design §6
    LEGACY = "legacy"  # no DeepStack slot: the upstream drop
    NO_CLEAR = "no-clear"  # slot copied, never cleared: stale rows leak into the next request
    # The bug family (design §10), each caught by its own scenario (docs/scenarios.md):
    CHUNK_MISALIGNED = "chunk-misaligned"  # every chunk gets the prompt's first rows (mlx-vlm #1332)
    PREFIX_OFFSET = "prefix-offset"  # rows not offset by the cached prefix (vLLM #41485)
    GROWTH_REBIND = "growth-rebind"  # the buffer regrown, the graphs left on the old one (FastDeploy #5962)
    WARMUP_SPECIALIZED = "warmup-specialized"  # a bucket's graph shaped by its first request (vLLM #43617)
    LAYOUT_KEYED = "layout-keyed"  # vision-encoder graphs keyed by token count (SGLang #37043)
    CLEARS_OWN_ROWS = "clears-own-rows"  # clears what it last wrote, never an earlier, longer tail (shrink)
    # Inputs beyond DeepStack, each caught by the freshness witness whatever the answer does:
    MROPE_ONE_ROW = "mrope-one-row"  # the first mRoPE row copied into all three (vllm-omni #803)
    MROPE_STALE = "mrope-stale"  # positions not refreshed when the bucket repeats (TensorRT-LLM #18207)
    EMBEDS_TAIL_KEPT = "embeds-tail-kept"  # input_embeds' padding never zeroed (SGLang #29018)
    EMBEDS_STALE = "embeds-stale"  # input_embeds not refreshed when the shape repeats (DeepSpeed #8488)
    # Requests that share a forward (the batch scenario): DeepStack rows packed wrongly.
    BATCH_OFFSET_ZERO = "batch-offset-zero"  # every request's rows written at offset 0
    BATCH_FIRST_ONLY = "batch-first-only"  # the refresh covers the first request's rows only
    BATCH_SLOT_ONE = "batch-slot-one"  # the slot taken as one request's bucket: a batch must be refused


@dataclass(frozen=True)
class Window:
    """The prompt rows `[start, end)` one prefill computes (a chunk, or what a prefix-cache hit
    left), of which the first `cached` rows of the prompt came from the cache."""

    start: int
    end: int
    cached: int = 0

    def of(self, deepstack: torch.Tensor | None) -> torch.Tensor | None:
        """This prefill's own DeepStack rows: what a correct engine hands its LM."""
        return None if deepstack is None else deepstack[self.start:self.end]


class GraphBackend(str, enum.Enum):
    CUDA = "cuda"
    EMULATED = "emulated"

    @classmethod
    def resolve(cls, name: str, device: torch.device) -> "GraphBackend":
        if name == "auto":
            return cls.CUDA if device.type == "cuda" else cls.EMULATED
        backend = cls(name)
        if backend is cls.CUDA and device.type != "cuda":
            raise ValueError("graph backend 'cuda' needs the model on a CUDA device")
        return backend


class Padding(str, enum.Enum):
    """What the rows of a bucket beyond the live request hold at replay."""

    ZERO = "zero"  # zeroed before every replay: padded rows are provably inert
    KEEP = "keep"  # left as they were: only the no-clear variant, to show the leak


@dataclass(frozen=True)
class Slot:
    name: str
    buffer: torch.Tensor  # [max_tokens, ...] for token-major slots, [3, max_tokens] for positions
    padding: Padding
    token_axis: int = 0

    def bucket(self, size: int) -> torch.Tensor:
        return self.buffer.narrow(self.token_axis, 0, size)


class _EmulatedGraph:
    """A CUDA graph on any device (`parity.runner.emulated_graph`): capture records the body's ops on the
    slots' tensors and freezes its Python decisions, as a real capture does; replay re-runs those
    ops and writes the captured outputs in place. Like a real graph, it cannot see a live tensor
    that was not copied into a slot, and it enforces what a GPU enforces (pools, host syncs, borrowed
    outputs: `parity.runner.device_rules`); it reproduces replay semantics, not replay speed."""

    def __init__(self, fn: Callable[[], Outputs], pool, name: str) -> None:
        self._graph, self.outputs = emulated_graph.capture(fn, pool=pool, name=name)

    def replay(self) -> None:
        self._graph.replay()


class _CudaGraph:
    def __init__(self, fn: Callable[[], Outputs], pool, name: str) -> None:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # warm-up: lazy inits and autotuning stay out of the graph
            for _ in range(2):
                fn()
        torch.cuda.current_stream().wait_stream(stream)
        self._graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self._graph, pool=pool):
            self.outputs = fn()

    def replay(self) -> None:
        self._graph.replay()


def deepstack_slot_width(body: nn.Module, captured: bool, variant: RunnerVariant) -> int | None:
    """Width of the DeepStack slot, or None when there must be no slot at all (zero cost)."""
    if not captured or variant is RunnerVariant.LEGACY or not isinstance(body, ConsumesDeepStack):
        return None
    return body.hidden_size * body.deepstack_count if body.deepstack_count > 0 else None


def graph_label(bucket: int, context: bool) -> str:
    """A bucket's graph as the results file names it: "prefill 48", or "context 48" after past rows."""
    return f"{'context' if context else 'prefill'} {bucket}"


class PrefillGraphRunner:
    """Captures `body(input_embeds, positions, deepstack)` once per token bucket and replays it.

    Public verbs: `can_replay`, `replay`, `eager`, `close`. Slots (allocated once, at the largest
    bucket): `input_embeds` [max_tokens, H] and `positions` [3, max_tokens], padding ZERO;
    `deepstack` [max_tokens, H*n], padding ZERO (KEEP in the no-clear variant), only when the body
    consumes DeepStack with n > 0 and something is captured. The DeepStack slot is the engine's
    one buffer: an eager prefill in graph mode goes through it too, and grows it when it is too
    small (the graphs are then captured again on the new buffer). With `context_rows`, each bucket
    also has a context graph, for a prefill after rows already in the KV cache (a chunk, a prefix
    hit): its slots hold up to that many past keys and values and the attention mask.

    The body's outputs (hidden states, the prefill's keys and values) are the graph's static
    outputs; `replay` returns copies of their real rows. `replay(..., probe=True)` replays a probe
    graph of the same body on the same slots, whose extra output is the hidden state after every
    layer (design §7), captured on first use.

    Memory (design §6): the bucket graphs share one pool, which lives exactly as long as they do. A
    recapture of every graph (the buffer grew) drops them all and takes a new pool: the old one is
    dead, and a capture into it is what CUDA's allocator asserts on. A probe graph has a pool of its
    own. Outputs are copied out of the pool right after their replay, before any other graph of the
    pool can overwrite them.
    """

    def __init__(
        self,
        body: nn.Module,
        *,
        hidden_size: int,
        dtype: torch.dtype,
        device: torch.device,
        buckets: tuple[int, ...],
        variant: RunnerVariant = RunnerVariant.FIXED,
        graph_backend: GraphBackend = GraphBackend.EMULATED,
        context_rows: int = 0,
        poison: bool = False,
    ) -> None:
        self.variant = variant
        self.poison = poison
        self.graph_backend = graph_backend
        self.buckets = tuple(sorted(set(buckets)))
        self._body = body
        max_tokens = self.buckets[-1] if self.buckets else 0
        self._embeds = Slot("input_embeds", torch.zeros(max_tokens, hidden_size, dtype=dtype, device=device), Padding.ZERO)
        self._positions = Slot("positions", torch.zeros(3, max_tokens, dtype=torch.long, device=device), Padding.ZERO, 1)
        width = deepstack_slot_width(body, bool(self.buckets), variant)
        padding = Padding.KEEP if variant is RunnerVariant.NO_CLEAR else Padding.ZERO
        self._deepstack = (
            None if width is None
            else Slot("deepstack", torch.zeros(max_tokens, width, dtype=dtype, device=device), padding)
        )
        buffer = None if self._deepstack is None else self._deepstack.buffer
        self._slot_bytes = 0 if buffer is None else buffer.numel() * buffer.element_size()
        self._own_rows = 0  # clears-own-rows: the rows its last write covered
        self._last_shape: tuple[int, int] | None = None  # (tokens, bucket) of the last refresh
        self.context_rows = context_rows if self.buckets else 0
        self._past: Past | None = None
        if self.context_rows:
            kv = (self.context_rows, *body.kv_shape)
            self._past = Past(torch.zeros(kv, dtype=dtype, device=device), torch.zeros(kv, dtype=dtype, device=device),
                              torch.zeros(max_tokens, self.context_rows + max_tokens, dtype=torch.bool, device=device))
        # Every per-call input each graph reads, and who last wrote each of its rows (design §6).
        self._witness = FreshnessWitness([*body.parameters(), *body.buffers()])
        for name, (buffer, axis) in self._buffers().items():
            self._witness.watch(name, buffer, axis)
        self.growths: list[tuple[int, int]] = []  # (rows before, rows after) of each time the buffer grew
        # The graphs a request with DeepStack captured (only the warm-up specialised variant captures
        # on a request): the others were captured at start-up, or by a request without DeepStack.
        self._captured_on_deepstack: set[tuple[int, bool]] = set()
        self._graphs: dict[tuple[int, bool], _EmulatedGraph | _CudaGraph] = {}
        self._bound: dict[tuple[int, bool], torch.Tensor | None] = {}  # the DeepStack rows each graph reads
        self._probe_graphs: dict[tuple[int, bool], _EmulatedGraph | _CudaGraph] = {}
        self._pool = self._new_pool()  # the bucket graphs' pool: it lives as long as they do
        self._closed = False
        self.capture_seconds = 0.0  # every capture's wall time, warm-up included, recaptures too
        if variant is not RunnerVariant.WARMUP_SPECIALIZED:  # that one captures on first use (its bug)
            self._capture_all()

    # -- capture ------------------------------------------------------------------------------

    def _capture_all(self) -> None:
        # Largest first: later, smaller graphs reuse the pool memory the largest one reserved.
        for size in sorted(self.buckets, reverse=True):
            for context in (False, True) if self.context_rows else (False,):
                self._graphs[(size, context)] = self._capture(size, self._pool, probe=False, context=context)

    def _new_pool(self):
        if self.graph_backend is GraphBackend.CUDA:
            return torch.cuda.graph_pool_handle()
        return emulated_graph.graph_pool_handle()

    def _capture(self, size: int, pool, probe: bool, context: bool, deepstack: bool = True):
        key = (size, context)
        if probe and key in self._bound:
            bound = self._bound[key]  # a probe graph reads what its bucket's graph reads, stale or not
        else:
            # Binding the slot (not the live tensor) is what puts the DeepStack add into the graph.
            bound = self._deepstack.bucket(size) if self._deepstack is not None and deepstack else None
        if not probe:
            self._bound[key] = bound
        fn = self._bound_body(size, probe, context, bound)
        if not probe:
            fn = self._witness.captured(key, fn)
        name = f"the {'probe' if probe else 'context' if context else 'prefill'} graph of bucket {size}"
        started = time.perf_counter()
        with torch.inference_mode():
            graph_class = _CudaGraph if self.graph_backend is GraphBackend.CUDA else _EmulatedGraph
            graph = graph_class(fn, pool, name)
        self.capture_seconds += time.perf_counter() - started
        return graph

    def _bound_body(self, size: int, probe: bool, context: bool, deepstack: torch.Tensor | None
                    ) -> Callable[[], Outputs]:
        embeds, positions = self._embeds.bucket(size), self._positions.bucket(size)
        extra = {"probe": True} if probe else {}  # a body need not know the options it is not given
        if context:
            extra["past"] = Past(self._past.keys, self._past.values, self._past.mask[:size, :self.context_rows + size])
        return lambda: self._body(embeds, positions, deepstack, **extra)

    def warmed_without_deepstack(self, num_tokens: int, context: bool = False) -> bool:
        """Whether the graph a prefill of `num_tokens` would replay was captured before it arrived,
        at start-up or by a request without DeepStack: what a server's warm-up leaves."""
        key = (self.bucket_for(num_tokens), context)
        return key in self._graphs and key not in self._captured_on_deepstack

    # -- replay -------------------------------------------------------------------------------

    @property
    def deepstack_slot(self) -> torch.Tensor | None:
        """The DeepStack slot's buffer, for inspection and tests (None when there is no slot)."""
        return None if self._deepstack is None else self._deepstack.buffer

    @property
    def deepstack_slot_bytes(self) -> int:
        """What the slot costs at capture (its growth, if any, is in each request's evidence)."""
        return self._slot_bytes

    def bucket_for(self, num_tokens: int) -> int | None:
        return next((b for b in self.buckets if b >= num_tokens), None)

    def can_replay(self, num_tokens: int, past_rows: int = 0) -> bool:
        return num_tokens > 0 and self.bucket_for(num_tokens) is not None and past_rows <= self.context_rows

    def replay(
        self, input_embeds: torch.Tensor, positions: torch.Tensor, deepstack: torch.Tensor | None,
        probe: bool = False, window: Window | None = None, past: Past | None = None, owner: str | None = None,
    ) -> Outputs:
        """Refresh every slot from the live inputs, replay the bucket's graph, return copies of the
        outputs' real rows: (hidden [T, H], keys, values[, probe points]). With a `window`,
        `deepstack` is the whole prompt's and the runner takes this prefill's rows from it; with
        `past`, the bucket's context graph runs after those rows. `owner` tags the rows it writes."""
        self._check_open()
        num_tokens = input_embeds.shape[0]
        bucket = self.bucket_for(num_tokens)
        if bucket is None or num_tokens == 0:
            raise ValueError(f"no captured bucket fits {num_tokens} tokens (buckets: {self.buckets})")
        if past is not None and past.keys.shape[0] > self.context_rows:
            raise ValueError(f"{past.keys.shape[0]} past rows exceed the context slot's {self.context_rows}")
        rows = self.window_rows(deepstack, window)
        if self.poison:
            self._poison(num_tokens, bucket, None if past is None else past.keys.shape[0])
        with self._witness.writes(owner):
            self.refresh_deepstack(rows, num_tokens, bucket)  # validates first: may raise
            self.refresh_inputs(input_embeds, positions, num_tokens, bucket)
            if past is not None:
                self.refresh_past(past, num_tokens, bucket)
        graph = self._graph(bucket, probe, past is not None, rows is not None)
        with torch.inference_mode():  # as at capture: the graph's outputs are inference tensors
            graph.replay()
        return self._copied_out(graph.outputs, num_tokens)

    def replay_packed(self, packed: Packed, probe: bool = False) -> Outputs:
        """Requests that share one forward (design §10, the batch scenario): their rows side by side
        in the slots, each request's DeepStack at its offset, replayed in the bucket's context graph,
        whose mask keeps each request to its own rows (and the one continued request to its earlier
        rows, in the past slot). Returns copies of the outputs' real rows, members in order (with
        `probe`, by the bucket's probe graph, whose extra output is every probe point's)."""
        self._check_open()
        if self._past is None:
            raise ValueError("a packed forward replays in a context graph, and this runner captured none")
        num_tokens, past = packed.rows, packed.past(self._past.keys.shape[1:])
        bucket = self.bucket_for(num_tokens)
        past_rows = past.keys.shape[0]
        if bucket is None or past_rows > self.context_rows:
            raise ValueError(f"no captured context graph fits a forward of {num_tokens} tokens after {past_rows} "
                             f"(buckets: {self.buckets}, context rows: {self.context_rows})")
        if self.poison:
            self._poison(num_tokens, bucket, past_rows)
        with self._witness.writes(packed.owner):
            self.refresh_packed_deepstack(packed, bucket)  # validates first: may raise
            self.refresh_inputs(packed.embeds, packed.positions, num_tokens, bucket)
            self.refresh_past(past, num_tokens, bucket, packed.spans)
        graph = self._graph(bucket, probe, True, packed.has_deepstack)
        with torch.inference_mode():
            graph.replay()
        return self._copied_out(graph.outputs, num_tokens)

    def refresh_packed_deepstack(self, packed: Packed, bucket: int) -> None:
        """Every member's DeepStack rows at its offset in the one slot, the rest of the bucket zeroed
        (`slot_contract.refresh`: validated before any write); the batch variants get it wrong."""
        if self._deepstack is None:
            return
        buffer, variant = self._deepstack.buffer, self.variant
        clear = self._deepstack.padding is Padding.ZERO and variant is not RunnerVariant.CLEARS_OWN_ROWS
        self._own_rows = packed.rows if packed.has_deepstack else 0
        if variant is RunnerVariant.BATCH_FIRST_ONLY:  # the first request's rows, nothing past them
            first = packed.members[0]
            slot_contract.refresh(buffer[:first.rows], first.deepstack, first.rows, rows=first.rows, clear=clear)
            return
        if variant is RunnerVariant.BATCH_SLOT_ONE:  # sized as if a forward held one request
            buffer = buffer[:self.bucket_for(max(m.rows for m in packed.members))]
        at = [0] * len(packed.members) if variant is RunnerVariant.BATCH_OFFSET_ZERO else None
        rows = packed.deepstack(at)
        slot_contract.refresh(buffer, rows, bucket, rows=None if rows is None else packed.rows, clear=clear)

    @staticmethod
    def _copied_out(outputs: Outputs, num_tokens: int) -> Outputs:
        """The real rows of a replay's outputs, copied out of the pool: graph outputs are borrowed,
        and the next replay of this graph, or of any graph sharing its pool, may overwrite them."""
        return tuple(output[:num_tokens].clone() for output in outputs)

    def padded_inputs(self, input_embeds: torch.Tensor, positions: torch.Tensor, deepstack: torch.Tensor | None,
                      past: Past | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, Past | None]:
        """The inputs a correct replay of this prefill sees, as eager tensors of its bucket's shape
        (design §6, the padded-eager reference): the live rows, `deepstack` being this prefill's
        own rows; the padding as the slots hold it now; a context graph's past slots. Call it right
        after the replay, while the slots hold what it read."""
        num_tokens = input_embeds.shape[0]
        bucket = self.bucket_for(num_tokens)
        embeds = self._embeds.bucket(bucket).clone()
        embeds[:num_tokens] = input_embeds
        padded_positions = self._positions.bucket(bucket).clone()
        padded_positions[:, :num_tokens] = positions
        rows = None
        if self._deepstack is not None:
            rows = self._deepstack.bucket(bucket).clone()
            rows[:num_tokens] = 0 if deepstack is None else deepstack
        elif deepstack is not None:  # no slot (legacy): what a correct graph would have added
            rows = torch.zeros(bucket, deepstack.shape[1], dtype=deepstack.dtype, device=deepstack.device)
            rows[:num_tokens] = deepstack
        context = None if past is None else Past(
            self._past.keys.clone(), self._past.values.clone(), self._past.mask[:bucket, :self.context_rows + bucket].clone())
        return embeds, padded_positions, rows, context

    def must_write(self, num_tokens: int, bucket: int, past_rows: int | None) -> dict[str, int]:
        """Per input, how many leading rows a correct runner writes for a prefill of `num_tokens` in
        `bucket` (design §6 argues each, from how the body consumes it): `input_embeds` and a
        zero-padded DeepStack slot, the bucket (the residual stream of every row the graph computes,
        and both slots promise zeros in the padding); `positions` and a slot that keeps its padding,
        the real rows (a position rotates only its own row, and no real row attends to a padded
        key); a context graph's past keys and values, the past rows (the rest is masked for every
        row); its mask, the bucket."""
        rows = {"input_embeds": bucket, "positions": num_tokens}
        if self._deepstack is not None:
            rows["deepstack"] = bucket if self._deepstack.padding is Padding.ZERO else num_tokens
        if past_rows is not None:
            rows |= {"past_keys": past_rows, "past_values": past_rows, "past_mask": bucket}
        return rows

    def _buffers(self) -> dict[str, tuple[torch.Tensor, int]]:
        """Every input's buffer as the witness names it, with its token axis."""
        slots = {s.name: (s.buffer, s.token_axis) for s in (self._embeds, self._positions, self._deepstack) if s}
        if self._past is not None:
            past = (self._past.keys, self._past.values, self._past.mask)
            slots |= {name: (t, 0) for name, t in zip(PAST_INPUTS, past)}
        return slots

    def _poisonable(self, num_tokens: int, bucket: int,
                    past_rows: int | None) -> Iterator[tuple[str, torch.Tensor, float]]:
        """(input, its rows this prefill must write, token-major, their sentinel) for --poison; a
        boolean mask has no value to spare for one: the witness alone holds it."""
        buffers = self._buffers()
        for name, rows in self.must_write(num_tokens, bucket, past_rows).items():
            buffer, axis = buffers[name]
            if buffer.dtype != torch.bool and rows:  # a packed forward with no past writes no past rows
                sentinel = POISON if buffer.is_floating_point() else POISON_POSITION
                yield name, buffer.narrow(axis, 0, rows).movedim(axis, 0), sentinel

    def _poison(self, num_tokens: int, bucket: int, past_rows: int | None) -> None:
        """--poison: every row this prefill must write gets the sentinel first, so a row its refresh
        misses still holds it after."""
        for _, rows, sentinel in self._poisonable(num_tokens, bucket, past_rows):
            rows.fill_(sentinel)

    def _poisoned(self, num_tokens: int, bucket: int, past_rows: int | None) -> dict[str, int]:
        """After a poisoned replay: per poisoned input, the rows it must write that still hold the
        sentinel in every element (read from the buffer: the second opinion, whoever wrote)."""
        return {name: int((rows == sentinel).reshape(rows.shape[0], -1).all(dim=1).sum())
                for name, rows, sentinel in self._poisonable(num_tokens, bucket, past_rows)}

    def freshness(self, input_embeds: torch.Tensor, positions: torch.Tensor, deepstack: torch.Tensor | None,
                  past: Past | None = None, spans: tuple[tuple[int, int, int], ...] | None = None
                  ) -> tuple[InputFreshness, ...]:
        """The freshness witness of the replay just run (design §6): per input its graph read, the
        rows a correct runner writes for this prefill (`must_write`) that it did not, given what the
        prefill supplies at the LM entry (`deepstack`: its own rows, as a correct engine hands
        them; `spans`: a packed forward's requests, whose mask keeps each to its rows); with
        --poison, also the rows that still hold the sentinel."""
        num_tokens = input_embeds.shape[0]
        bucket = self.bucket_for(num_tokens)
        past_rows = None if past is None else past.keys.shape[0]
        must = self.must_write(num_tokens, bucket, past_rows)

        supplied: dict[str, Supplied | None] = {
            "input_embeds": Supplied(padded(input_embeds, self._embeds.buffer, must["input_embeds"])),
            "positions": Supplied(positions, token_axis=1),
        }
        if self._deepstack is not None:
            supplied["deepstack"] = Supplied(padded(deepstack, self._deepstack.buffer, must["deepstack"]))
        elif deepstack is not None:  # no slot: what the request supplies, for the graph to drop
            supplied["deepstack"] = Supplied(deepstack)
        if past is not None:
            mask = torch.zeros(must["past_mask"], self.context_rows + bucket, dtype=torch.bool, device=past.keys.device)
            fill_packed_mask(mask, spans or ((0, num_tokens, past_rows),))
            supplied |= dict(zip(PAST_INPUTS, (Supplied(past.keys), Supplied(past.values), Supplied(mask))))
        graph = graph_label(bucket, past is not None)
        records = self._witness.check((bucket, past is not None), graph, supplied)
        if not self.poison:
            return records
        poisoned = self._poisoned(num_tokens, bucket, past_rows)
        return tuple(replace(r, poisoned=poisoned.get(r.input)) if r.rows else r for r in records)

    def window_rows(self, deepstack: torch.Tensor | None, window: Window | None) -> torch.Tensor | None:
        """The DeepStack rows this prefill's slot gets: the window's own, or, in the planted
        variants, rows from the wrong place of the prompt."""
        if deepstack is None or window is None:
            return deepstack
        start = {RunnerVariant.CHUNK_MISALIGNED: window.cached,  # as if each chunk began the prompt
                 RunnerVariant.PREFIX_OFFSET: window.start - window.cached,  # as if nothing were cached
                 }.get(self.variant, window.start)
        return deepstack[start:start + window.end - window.start]

    def eager(
        self, input_embeds: torch.Tensor, positions: torch.Tensor, deepstack: torch.Tensor | None,
        probe: bool = False, window: Window | None = None, past: Past | None = None, owner: str | None = None,
    ) -> Outputs:
        """A prefill in graph mode that no bucket fits: the body runs eagerly, its DeepStack read
        from the engine's buffer like a replay's, which grows when the rows do not fit."""
        self._check_open()
        rows = window.of(deepstack) if window is not None else deepstack
        if self._deepstack is not None and rows is not None:
            self._ensure_rows(rows.shape[0])
            with self._witness.writes(owner):
                slot_contract.refresh(self._deepstack.buffer, rows, rows.shape[0], rows=rows.shape[0],
                                      clear=self._deepstack.padding is Padding.ZERO)
            rows = self._deepstack.buffer[:rows.shape[0]]
        extra = ({"probe": True} if probe else {}) | ({"past": past} if past is not None else {})
        with torch.inference_mode():
            return self._body(input_embeds, positions, rows, **extra)

    def _ensure_rows(self, rows: int) -> None:
        old = self._deepstack
        if rows <= old.buffer.shape[0]:
            return
        grown = torch.zeros(rows, old.buffer.shape[1], dtype=old.buffer.dtype, device=old.buffer.device)
        grown[:old.buffer.shape[0]].copy_(old.buffer)
        self._witness.watch(old.name, grown, grown_from=old.buffer)
        self._deepstack = Slot(old.name, grown, old.padding)
        self.growths.append((old.buffer.shape[0], rows))
        if self.variant is RunnerVariant.GROWTH_REBIND:
            return  # the bug: every captured graph still reads the old buffer
        keys = sorted(self._graphs, reverse=True)
        self._drop_graphs()
        for size, context in keys:  # the fix: the graphs read the buffer that is written
            self._graphs[(size, context)] = self._capture(size, self._pool, probe=False, context=context)

    def _drop_graphs(self) -> None:
        """Destroy every graph; their pool dies with them, so later captures get a new one."""
        self._probe_graphs.clear()
        self._witness.forget(self._graphs)
        self._graphs.clear()
        self._bound.clear()
        self._pool = self._new_pool()

    def _graph(self, bucket: int, probe: bool, context: bool, has_deepstack: bool) -> _EmulatedGraph | _CudaGraph:
        graphs = self._probe_graphs if probe else self._graphs
        key = (bucket, context)
        if key not in graphs:
            # A probe graph has its own pool: captured after the others, kept apart. A warm-up
            # specialised graph adds DeepStack only if the request that first needs it has some.
            pool = torch.cuda.graph_pool_handle() if self.graph_backend is GraphBackend.CUDA else None
            graphs[key] = self._capture(bucket, pool if probe else self._pool, probe, context,
                                        has_deepstack or self.variant is not RunnerVariant.WARMUP_SPECIALIZED)
            if has_deepstack and not probe:
                self._captured_on_deepstack.add(key)
        return graphs[key]

    def refresh_inputs(self, input_embeds: torch.Tensor, positions: torch.Tensor, num_tokens: int, bucket: int) -> None:
        variant, last = self.variant, self._last_shape
        self._last_shape = (num_tokens, bucket)
        if not (variant is RunnerVariant.EMBEDS_STALE and last == (num_tokens, bucket)):
            self._fill(self._embeds, input_embeds, num_tokens, bucket, variant is not RunnerVariant.EMBEDS_TAIL_KEPT)
        if variant is RunnerVariant.MROPE_ONE_ROW:
            positions = positions[:1].expand_as(positions)
        if not (variant is RunnerVariant.MROPE_STALE and last is not None and last[1] == bucket):
            self._fill(self._positions, positions, num_tokens, bucket)

    def refresh_deepstack(self, deepstack: torch.Tensor | None, num_tokens: int, bucket: int) -> None:
        """The DeepStack slot contract (`slot_contract.refresh`): validated before any write."""
        if self._deepstack is None:
            return
        buffer, filled = self._deepstack.buffer, 0 if deepstack is None else deepstack.shape[0]
        if self.variant is RunnerVariant.CLEARS_OWN_ROWS and not filled:
            # The partial fix: absence clears the rows the last write covered, not what lies past them.
            slot_contract.refresh(buffer[:self._own_rows], None, self._own_rows)
            self._own_rows = 0
            return
        clear = self._deepstack.padding is Padding.ZERO and self.variant is not RunnerVariant.CLEARS_OWN_ROWS
        slot_contract.refresh(buffer, deepstack, bucket, rows=num_tokens, clear=clear)
        self._own_rows = filled

    def refresh_past(self, past: Past, num_tokens: int, bucket: int,
                     spans: tuple[tuple[int, int, int], ...] | None = None) -> None:
        """The rows before this prefill into the context slots, and its padded mask over them
        (`spans`: requests packed side by side, each kept to its own rows; default: one request)."""
        rows = past.keys.shape[0]
        if rows:
            self._past.keys[:rows].copy_(past.keys)
            self._past.values[:rows].copy_(past.values)
        fill_packed_mask(self._past.mask[:bucket, :self.context_rows + bucket], spans or ((0, num_tokens, rows),))

    @staticmethod
    def _fill(slot: Slot, live: torch.Tensor, num_tokens: int, bucket: int, zero_padding: bool = True) -> None:
        slot.bucket(num_tokens).copy_(live)
        if zero_padding and slot.padding is Padding.ZERO and bucket > num_tokens:
            slot.buffer.narrow(slot.token_axis, num_tokens, bucket - num_tokens).zero_()

    @property
    def max_bucket(self) -> int | None:
        return self.buckets[-1] if self.buckets else None

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("the prefill graph runner was closed: its graphs and slots are gone")

    def close(self) -> None:
        """Destroy every graph and slot: nothing of this runner's pools is left for the next one."""
        self._drop_graphs()
        self._pool = None
        self._deepstack = None
        self._past = None
        self._closed = True
