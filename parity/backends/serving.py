"""How the embedded engine schedules one prompt's prefill, as a server does (design §10): which
rows come from the prefix cache, and in which chunks the rest is computed.

A server fills its prefix cache with every prompt it prefilled and matches new prompts against it
by whole pages; the rows after the hit are prefilled in chunks of at most the chunk size, each
attending to the cached rows and the chunks before it. Both modes schedule alike, so an eager
session is the reference for a graph session's every chunk.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from parity.graph_runner import Window

# The prefix cache matches whole pages of this many tokens: small enough that, on every built-in
# fixture, a hit on the whole first prompt ends past the image and one up to the image ends inside it.
PAGE_TOKENS = 8
# A chunk of this many tokens splits every built-in fixture's image rows over two chunks or more.
DEFAULT_CHUNK_TOKENS = 8

TokenKey = tuple  # one prompt token as the cache matches it: (token id, image sha256 or None)


@dataclass
class PrefixCache:
    """Prompts already prefilled, with their keys and values `[T, layers, kv_heads, head_dim]`,
    apart per DeepStack action: a zeroed-DeepStack prefill leaves other keys and values."""

    page: int = PAGE_TOKENS
    _entries: dict[str, list[tuple[tuple[TokenKey, ...], torch.Tensor, torch.Tensor]]] = field(default_factory=dict)

    def lookup(self, action: str, key: tuple[TokenKey, ...]
               ) -> tuple[int, torch.Tensor | None, torch.Tensor | None]:
        """(cached rows, their keys, their values) for the longest whole-page match, leaving at
        least one row to compute (its logits are the answer's first token)."""
        best, found = 0, None
        for entry in self._entries.get(action, ()):
            common = next((i for i, (a, b) in enumerate(zip(entry[0], key)) if a != b), min(len(entry[0]), len(key)))
            if common > best:
                best, found = common, entry
        cached = min(best, len(key) - 1) // self.page * self.page
        if not cached:
            return 0, None, None
        return cached, found[1][:cached], found[2][:cached]

    def insert(self, action: str, key: tuple[TokenKey, ...], keys: torch.Tensor, values: torch.Tensor) -> None:
        self._entries.setdefault(action, []).append((key, keys, values))


def token_keys(input_ids: torch.Tensor, image_token_id: int, image_sha256: str | None) -> tuple[TokenKey, ...]:
    """The prompt as the cache matches it: image tokens by their image, since the same placeholder
    id stands for every image."""
    return tuple((int(t), image_sha256 if int(t) == image_token_id else None) for t in input_ids.tolist())


def schedule(total: int, cached: int, chunk: int | None) -> tuple[Window, ...]:
    """The prefills of a `total`-row prompt after `cached` rows: one, or chunks of `chunk` rows."""
    step = chunk or total
    return tuple(Window(start, min(start + step, total), cached) for start in range(cached, total, step))


def image_span(input_ids: torch.Tensor, image_token_id: int) -> tuple[int, int] | None:
    rows = (input_ids == image_token_id).nonzero().flatten().tolist()
    return (rows[0], rows[-1] + 1) if rows else None
