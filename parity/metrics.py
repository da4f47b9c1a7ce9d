"""Comparing two arms (design §2): `(divergence char, token match, logprob delta)`."""

from __future__ import annotations

import os
from typing import Sequence

from parity.results import ArmResult, Comparison

DEFAULT_LOGPROB_TOL = 0.25


def common_prefix_chars(a: str, b: str) -> int:
    return len(os.path.commonprefix([a, b]))


def first_divergence(a: Sequence[int], b: Sequence[int]) -> int | None:
    """First index where the id lists differ; the shorter length for a strict prefix; None if equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def position_deltas(lp_a: Sequence[float], lp_b: Sequence[float], divergence: int | None) -> tuple[float, ...]:
    """|lp_a[i] - lp_b[i]| for i = 0..k, the steps the logprob delta covers (none when n == 0)."""
    n = min(len(lp_a), len(lp_b))
    if n == 0:
        return ()
    # Up to and including the first divergent step: its logprobs tell how close the call was.
    k = n - 1 if divergence is None else min(divergence, n - 1)
    return tuple(abs(lp_a[i] - lp_b[i]) for i in range(k + 1))


def logprob_delta(lp_a: Sequence[float], lp_b: Sequence[float], divergence: int | None) -> float:
    return max(position_deltas(lp_a, lp_b, divergence), default=0.0)


def compare(a: ArmResult, b: ArmResult, logprob_tol: float) -> Comparison:
    divergence = first_divergence(a.token_ids, b.token_ids)
    delta = logprob_delta(a.token_logprobs, b.token_logprobs, divergence)
    token_match = divergence is None
    return Comparison(
        a=a.name,
        b=b.name,
        divergence_char=common_prefix_chars(a.text, b.text),
        token_match=token_match,
        first_token_divergence=divergence,
        logprob_delta=delta,
        match=token_match and delta <= logprob_tol,
    )
