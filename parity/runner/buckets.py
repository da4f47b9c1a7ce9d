"""Prefill token buckets: SGLang's ladder, and which buckets a run captures.

A prompt of n tokens replays in the smallest captured bucket >= n, its rows padded up to the
bucket. Both backends use SGLang 0.5.23's ladder (`generate_prefill_cuda_graph_batch_sizes`,
docs/engines/sglang-0.5.23.md §1.1), so a transformers run pads exactly as the server it models would.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Sequence

AUTO = "auto"
# SGLang's default prefill.max_bs on an H100/H200 (chunked_prefill_size, docs/engines/sglang-0.5.23.md §1.1).
SGLANG_MAX_PREFILL_BUCKET = 8192


def prefill_bucket_ladder(max_tokens: int) -> tuple[int, ...]:
    """SGLang 0.5.23's prefill capture sizes up to `max_tokens`."""
    sizes = [*range(4, 33, 4), *range(48, 257, 16), *range(288, 513, 32), *range(576, 1025, 64),
             *range(1280, 4097, 256), *range(4608, max_tokens + 1, 512)]
    return tuple(s for s in sizes if s <= max_tokens)


def smallest_fitting(buckets: Iterable[int], num_tokens: int) -> int | None:
    """The bucket the policy assigns to a prompt of `num_tokens`: the smallest that fits."""
    return min((b for b in buckets if b >= num_tokens), default=None)


@dataclass(frozen=True)
class BucketPolicy:
    """Which buckets a run may replay in: SGLang's ladder (`auto`) or the user's explicit list.

    `auto` covers every prompt up to `max_tokens` (the model's context), so a default run always
    replays; an explicit list may be too small for a prompt, which the verdict then reports
    (INCONCLUSIVE_NOT_REPLAYED) instead of silently running eager.
    """

    explicit: tuple[int, ...] | None  # None: auto
    max_tokens: int

    @classmethod
    def parse(cls, value: str | Sequence[int], max_tokens: int) -> "BucketPolicy":
        if value == AUTO:
            return cls(None, max_tokens)
        return cls(tuple(sorted(set(value))), max_tokens)

    @property
    def candidates(self) -> tuple[int, ...]:
        return prefill_bucket_ladder(self.max_tokens) if self.explicit is None else self.explicit

    def bucket_of(self, num_tokens: int) -> int | None:
        return smallest_fitting(self.candidates, num_tokens) if num_tokens > 0 else None

    def captured(self, lengths: Iterable[int]) -> tuple[int, ...]:
        """The buckets a run captures, as a server has them: its whole ladder up to the largest bucket
        these prompt lengths need (the smaller ones included), or every bucket of an explicit list.

        Capturing only the buckets a run's prompts replay in would hide every bug in choosing among
        buckets (a wrong bucket, a copy bounded by another bucket's size) from single-fixture runs.
        """
        if self.explicit is not None:
            return self.explicit
        needed = [b for b in map(self.bucket_of, lengths) if b is not None]
        return tuple(b for b in self.candidates if needed and b <= max(needed))

    def describe(self) -> str | list[int]:
        return AUTO if self.explicit is None else list(self.explicit)
