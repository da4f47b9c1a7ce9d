"""Requests that share one prefill forward (the batch scenario, design §10).

A server under load puts several requests in one prefill: their rows side by side in one token-major
tensor, each request at its offset, with one attention mask that keeps every request to its own
rows (and, for the continuation of a chunked request, to its own earlier chunks in the cache).
DeepStack is packed the same way: each image request's rows at its offset, zeros for text rows.
This is the layout a correct runner writes into its slots; the graph runner's batch variants get it
wrong on purpose (`graph_runner.RunnerVariant`).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Sequence

import torch

from parity.runner.lm_body import Past, fill_packed_mask


@dataclass(frozen=True)
class Member:
    """One request's part of a packed forward: its rows' embeddings `[n, H]`, positions `[3, n]`,
    DeepStack rows `[n, W]` (None: none), the rows before them in the cache (a chunked request's
    earlier chunks; None: none) and its tag (its image's sha256, None for text)."""

    embeds: torch.Tensor
    positions: torch.Tensor
    deepstack: torch.Tensor | None
    past: Past | None
    owner: str | None

    @property
    def rows(self) -> int:
        return self.embeds.shape[0]


@dataclass(frozen=True)
class Packed:
    """Members side by side, in order: member i holds rows `spans[i][0]:spans[i][1]`."""

    members: tuple[Member, ...]

    def __post_init__(self) -> None:
        if sum(m.past is not None for m in self.members) > 1:
            # One past slot: a forward may continue one request's earlier rows, not two.
            raise ValueError("a packed forward may continue at most one request's earlier rows")

    @property
    def rows(self) -> int:
        return sum(m.rows for m in self.members)

    # The packed tensors and layout are read by the runner's refresh and again by the replay check and
    # the witness: built once.
    @cached_property
    def ranges(self) -> tuple[tuple[int, int], ...]:
        out, start = [], 0
        for member in self.members:
            out.append((start, start + member.rows))
            start += member.rows
        return tuple(out)

    @property
    def spans(self) -> tuple[tuple[int, int, int], ...]:
        """(start, end, past rows it sees) per member: what `fill_packed_mask` takes."""
        return tuple((start, end, 0 if m.past is None else m.past.keys.shape[0])
                     for (start, end), m in zip(self.ranges, self.members))

    @property
    def owner(self) -> str | None:
        """The tag the forward's writes carry: its first image's (one write serves them all)."""
        return next((m.owner for m in self.members if m.owner is not None), None)

    @cached_property
    def embeds(self) -> torch.Tensor:
        return torch.cat([m.embeds for m in self.members])

    @cached_property
    def positions(self) -> torch.Tensor:
        return torch.cat([m.positions for m in self.members], dim=1)

    @property
    def has_deepstack(self) -> bool:
        return any(m.deepstack is not None for m in self.members)

    def deepstack(self, at: Sequence[int] | None = None) -> torch.Tensor | None:
        """Every member's DeepStack rows at its offset (or at `at[i]`: a wrong layout, for the planted
        variants), zeros elsewhere; None when no member has any."""
        carried = [m.deepstack for m in self.members if m.deepstack is not None]
        if not carried:
            return None
        out = carried[0].new_zeros(self.rows, carried[0].shape[1])
        offsets = [start for start, _ in self.ranges] if at is None else at
        for member, offset in zip(self.members, offsets):
            if member.deepstack is not None:
                out[offset:offset + member.rows] = member.deepstack
        return out

    def past(self, kv_shape: tuple[int, ...]) -> Past:
        """The forward's past: the continued member's earlier keys and values (none, of one token's
        `kv_shape`, when no member continues), with the packed mask `[rows, past + rows]` an eager
        forward takes."""
        past = next((m.past for m in self.members if m.past is not None), None)
        if past is None:
            empty = self.members[0].embeds.new_zeros(0, *kv_shape)
            return Past(empty, empty, self.mask(0))
        return Past(past.keys, past.values, self.mask(past.keys.shape[0]))

    def mask(self, capacity: int) -> torch.Tensor:
        mask = torch.zeros(self.rows, capacity + self.rows, dtype=torch.bool, device=self.members[0].embeds.device)
        fill_packed_mask(mask, self.spans)
        return mask

    def split(self, tensor: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """A token-major output of the forward, cut into each member's rows."""
        return tuple(tensor[start:end] for start, end in self.ranges)
