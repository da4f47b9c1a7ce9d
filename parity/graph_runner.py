"""The prefill graph runner and its slot contract (design §6): the fix parity validates.

A captured graph reads only its static slots. Every live input must be copied into a slot before
replay, or the graph silently computes with whatever the slot held: that is how SGLang's BCG
dropped Qwen3-VL's DeepStack. The `fixed` variant refreshes the DeepStack slot before every
replay, clears it on absence and fails closed on malformed input; `legacy` and `no-clear`
reproduce the two ways of getting it wrong, so parity can prove it tells them apart.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from parity import emulated_graph, slot_contract
from parity.lm_body import ConsumesDeepStack

Outputs = tuple[torch.Tensor, ...]  # token-major: every output's first axis is the bucket's rows


class RunnerVariant(str, enum.Enum):
    FIXED = "fixed"  # the slot contract of design §6
    LEGACY = "legacy"  # no DeepStack slot: the upstream drop
    NO_CLEAR = "no-clear"  # slot copied, never cleared: stale rows leak into the next request


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
    """A CUDA graph on any device (`parity.emulated_graph`): capture records the body's ops on the
    slots' tensors and freezes its Python decisions, as a real capture does; replay re-runs those
    ops and writes the captured outputs in place. Like a real graph, it cannot see a live tensor
    that was not copied into a slot; it reproduces replay semantics, not replay speed."""

    def __init__(self, fn: Callable[[], Outputs]) -> None:
        self._graph, self.outputs = emulated_graph.capture(fn)

    def replay(self) -> None:
        self._graph.replay()


class _CudaGraph:
    def __init__(self, fn: Callable[[], Outputs], pool) -> None:
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


class PrefillGraphRunner:
    """Captures `body(input_embeds, positions, deepstack)` once per token bucket and replays it.

    Public verbs: `can_replay`, `replay`, `close`. Slots (allocated once, at the largest bucket):
    `input_embeds` [max_tokens, H] and `positions` [3, max_tokens], padding ZERO; `deepstack`
    [max_tokens, H*n], padding ZERO (KEEP in the no-clear variant), only when the body consumes
    DeepStack with n > 0 and something is captured. The body's outputs (hidden states, the
    prefill's keys and values) are the graph's static outputs; `replay` returns copies of their
    real rows. `replay(..., probe=True)` replays a probe graph of the same body on the same slots,
    whose extra output is the hidden state after every layer (design §7), captured on first use.
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
    ) -> None:
        self.variant = variant
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
        self._graphs: dict[int, _EmulatedGraph | _CudaGraph] = {}
        self._probe_graphs: dict[int, _EmulatedGraph | _CudaGraph] = {}
        pool = torch.cuda.graph_pool_handle() if graph_backend is GraphBackend.CUDA else None
        # Largest first: later, smaller graphs reuse the pool memory the largest one reserved.
        for size in sorted(self.buckets, reverse=True):
            self._graphs[size] = self._capture(size, pool, probe=False)

    # -- capture ------------------------------------------------------------------------------

    def _capture(self, size: int, pool, probe: bool) -> _EmulatedGraph | _CudaGraph:
        fn = self._bound_body(size, probe)
        with torch.inference_mode():
            if self.graph_backend is GraphBackend.CUDA:
                return _CudaGraph(fn, pool)
            return _EmulatedGraph(fn)

    def _bound_body(self, size: int, probe: bool) -> Callable[[], Outputs]:
        embeds, positions = self._embeds.bucket(size), self._positions.bucket(size)
        # Binding the slot (not the live tensor) is what puts the DeepStack add into the graph.
        deepstack = self._deepstack.bucket(size) if self._deepstack is not None else None
        if probe:
            return lambda: self._body(embeds, positions, deepstack, probe=True)
        return lambda: self._body(embeds, positions, deepstack)

    # -- replay -------------------------------------------------------------------------------

    @property
    def deepstack_slot(self) -> torch.Tensor | None:
        """The DeepStack slot's buffer, for inspection and tests (None when there is no slot)."""
        return None if self._deepstack is None else self._deepstack.buffer

    @property
    def deepstack_slot_bytes(self) -> int:
        buf = self.deepstack_slot
        return 0 if buf is None else buf.numel() * buf.element_size()

    def bucket_for(self, num_tokens: int) -> int | None:
        return next((b for b in self.buckets if b >= num_tokens), None)

    def can_replay(self, num_tokens: int) -> bool:
        return num_tokens > 0 and self.bucket_for(num_tokens) is not None

    def replay(
        self, input_embeds: torch.Tensor, positions: torch.Tensor, deepstack: torch.Tensor | None,
        probe: bool = False,
    ) -> Outputs:
        """Refresh every slot from the live inputs, replay the bucket's graph, return copies of the
        outputs' real rows: (hidden [T, H], keys, values[, probe points])."""
        num_tokens = input_embeds.shape[0]
        bucket = self.bucket_for(num_tokens)
        if bucket is None or num_tokens == 0:
            raise ValueError(f"no captured bucket fits {num_tokens} tokens (buckets: {self.buckets})")
        self.refresh_deepstack(deepstack, num_tokens, bucket)  # validates first: may raise
        self.refresh_inputs(input_embeds, positions, num_tokens, bucket)
        graph = self._graph(bucket, probe)
        with torch.inference_mode():  # as at capture: the graph's outputs are inference tensors
            graph.replay()
        # Graph outputs are borrowed: the next replay overwrites them.
        return tuple(output[:num_tokens].clone() for output in graph.outputs)

    def _graph(self, bucket: int, probe: bool) -> _EmulatedGraph | _CudaGraph:
        if not probe:
            return self._graphs[bucket]
        if bucket not in self._probe_graphs:  # its own pool: captured after the others, kept apart
            self._probe_graphs[bucket] = self._capture(
                bucket, torch.cuda.graph_pool_handle() if self.graph_backend is GraphBackend.CUDA else None, True)
        return self._probe_graphs[bucket]

    def refresh_inputs(self, input_embeds: torch.Tensor, positions: torch.Tensor, num_tokens: int, bucket: int) -> None:
        self._fill(self._embeds, input_embeds, num_tokens, bucket)
        self._fill(self._positions, positions, num_tokens, bucket)

    def refresh_deepstack(self, deepstack: torch.Tensor | None, num_tokens: int, bucket: int) -> None:
        """The DeepStack slot contract (`slot_contract.refresh`): validated before any write."""
        if self._deepstack is not None:
            slot_contract.refresh(self._deepstack.buffer, deepstack, bucket, rows=num_tokens,
                                  clear=self._deepstack.padding is Padding.ZERO)

    @staticmethod
    def _fill(slot: Slot, live: torch.Tensor, num_tokens: int, bucket: int) -> None:
        slot.bucket(num_tokens).copy_(live)
        if slot.padding is Padding.ZERO and bucket > num_tokens:
            slot.buffer.narrow(slot.token_axis, num_tokens, bucket - num_tokens).zero_()

    @property
    def max_bucket(self) -> int | None:
        return self.buckets[-1] if self.buckets else None

    def close(self) -> None:
        self._graphs.clear()
        self._probe_graphs.clear()
        self._deepstack = None
