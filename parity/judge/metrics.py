"""Comparing two arms (design §2): `(divergence char, token match, logprob delta)`, `tie`, `tf_delta`.

In `compare(a, b)` the second arm is the reference. A near-tie flip (both arms' tokens within
`tie_margin` of each other, in both arms) is numeric noise, not a semantic change: it matches when
both tokens score the same in both arms at the flip step itself (their own generations' top-k) and
the teacher-forced delta over the whole reference sequence stays within the tolerance.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Sequence

from parity.results import ArmResult, Comparison

DEFAULT_TIE_MARGIN = 0.1
# The smallest tolerance a run may ask for, and what an arm's repeats must reproduce to: above the
# fp32 noise of a correct replay on any x86 CPU (1.19e-6 measured on an AVX2-only EPYC, 3.1e-6 the
# largest over the noise sweep), so a correct run is never a false FAIL or NONDETERMINISTIC.
NOISE_FLOOR = 1e-5


@dataclass(frozen=True)
class Tolerances:
    """When two arms' logprobs agree (design §2 v3).

    `logprob_tol` bounds the largest |Δ| over the compared steps; `mean_tol`, where set, bounds
    their mean too. Reduced precision gets a loose max and a tight mean: one step's rounding noise
    never fails a comparison whose tokens all match, while a bug that moves every step does.
    """

    logprob_tol: float
    tie_margin: float | None = DEFAULT_TIE_MARGIN  # None: the v1 rule, nothing is a tie
    mean_tol: float | None = None  # None: only the max is bounded (fp32, or a user's --logprob-tol)

    def within(self, deltas: Sequence[float]) -> bool:
        if not deltas:
            return True
        if max(deltas) > self.logprob_tol:
            return False
        return self.mean_tol is None or sum(deltas) / len(deltas) <= self.mean_tol


# Chosen from scripts/measure_noise.py's sweep of a correct runner and the planted bugs' effects
# (docs/verdicts.md, "Tolerances"): each bound sits at least 3x above the largest noise of a
# correct runner and below the smallest effect of every planted bug that keeps the tokens.
# (max |Δ|, mean |Δ|, near-tie margin). A near-tie's margin is the most one execution path can move
# one token's logprob: in reduced precision that is the per-step bound itself, since two correct
# paths flip a pair of candidates whose gap is up to that far apart (a flip's two margins add up to
# at most its two flip deltas, each bounded by the max). fp32 keeps 0.1, far above its noise.
AUTO_TOLERANCES = {
    "float32": (3e-5, None, DEFAULT_TIE_MARGIN),
    "bfloat16": (0.75, 0.05, 0.75),
    "float16": (0.1875, 0.0125, 0.1875),  # bf16's bounds scaled by the mantissa (3 more bits); not measured
}


def auto_tolerances(dtype: str) -> Tolerances:
    max_tol, mean_tol, margin = AUTO_TOLERANCES.get(dtype, AUTO_TOLERANCES["bfloat16"])
    return Tolerances(max_tol, margin, mean_tol)


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


def forced_deltas(a: ArmResult, reference: ArmResult) -> tuple[float, ...] | None:
    """|lp_a(ref_tok_i) - lp_ref(ref_tok_i)| at every reference position; None if not scored.

    `lp_ref` is the reference's own tokens scored the way `a` scored them where the backend
    recorded that (`forced[reference]` in the reference itself), else its generation logprobs.
    """
    forced = a.forced.get(reference.name)
    own = reference.forced.get(reference.name, reference.token_logprobs)  # null: could not score
    if forced is None or own is None or len(forced) != len(own):
        return None
    return tuple(abs(x - y) for x, y in zip(forced, own))


def tf_delta(a: ArmResult, reference: ArmResult) -> float | None:
    deltas = forced_deltas(a, reference)
    return None if deltas is None else max(deltas, default=0.0)


def _logprob_of(arm: ArmResult, step: int, token: int) -> float | None:
    if arm.top_logprobs is None or step >= len(arm.top_logprobs):
        return None
    return dict(arm.top_logprobs[step]).get(token)


def flip_margins(a: ArmResult, b: ArmResult, divergence: int) -> tuple[float, float] | None:
    """At a flip step, how far each arm scored the other arm's token below its own:
    (lp_a(x_a) - lp_a(x_b), lp_b(x_b) - lp_b(x_a)); None when a token is outside the other's top-k."""
    x_a, x_b = a.token_ids[divergence], b.token_ids[divergence]
    a_other, b_other = _logprob_of(a, divergence, x_b), _logprob_of(b, divergence, x_a)
    if a_other is None or b_other is None:
        return None
    return abs(a.token_logprobs[divergence] - a_other), abs(b.token_logprobs[divergence] - b_other)


def is_tie(a: ArmResult, b: ArmResult, divergence: int | None, margin: float | None) -> bool:
    """At the first divergent step, each arm's token is in the other's top-k and within `margin`
    of the other arm's token, in both arms."""
    if margin is None or divergence is None or divergence >= min(len(a.token_ids), len(b.token_ids)):
        return False
    margins = flip_margins(a, b, divergence)
    return margins is not None and max(margins) <= margin


def flip_deltas(a: ArmResult, b: ArmResult, divergence: int) -> tuple[float, ...] | None:
    """At a near-tie's step, each of the two tokens scored by both arms, from the generations
    themselves: |lp_a(x) - lp_b(x)| for x in (x_b, x_a). This is the step's own execution (a
    first-token tie: the prompt's prefill, in its bucket), so a bug in that path cannot hide behind
    scores taken on another path (a teacher-forced prefill of prompt + answer in a larger bucket)."""
    x_a, x_b = a.token_ids[divergence], b.token_ids[divergence]
    scores = [(_logprob_of(a, divergence, x), _logprob_of(b, divergence, x)) for x in (x_b, x_a)]
    if any(s is None for pair in scores for s in pair):
        return None
    return tuple(abs(x - y) for x, y in scores)


def replay_departure(arm: ArmResult) -> str | None:
    """Where a graph arm's replay (any run of it) left eager on its own padded shape (design §6), or None."""
    runs = [("", arm.evidence)] + [(f" (repeat {i + 2})", r.evidence) for i, r in enumerate(arm.repeats)]
    for label, evidence in runs:
        check = None if evidence is None else evidence.replay_check
        if check is not None and check.departure is not None:
            return f"{check.departure.describe(check.replays)}{label}"
    return None


def compare(a: ArmResult, b: ArmResult, tolerances: Tolerances, request: int | None = None) -> Comparison:
    divergence = first_divergence(a.token_ids, b.token_ids)
    deltas = position_deltas(a.token_logprobs, b.token_logprobs, divergence)
    token_match = divergence is None
    tie = is_tie(a, b, divergence, tolerances.tie_margin)
    forced = forced_deltas(a, b)
    # A tie is excused only where the flip step itself agrees, on its own path, and the rest of the
    # reference sequence agrees teacher-forced (design §2 v4).
    flips = flip_deltas(a, b, divergence) if tie else None
    excused = (tie and forced is not None and flips is not None and max(flips) <= tolerances.logprob_tol
               and tolerances.within(deltas[:-1]) and tolerances.within(forced))
    # Against its eager reference (the same DeepStack action), a graph arm must also have computed what
    # eager computes on the very shape it replayed: noise can excuse the answers, not the computation.
    same_action = (a.mode, b.mode) == ("bcg", "eager") and a.deepstack == b.deepstack
    departure = replay_departure(a) if same_action else None
    return Comparison(
        a=a.name,
        b=b.name,
        divergence_char=common_prefix_chars(a.text, b.text),
        token_match=token_match,
        first_token_divergence=divergence,
        logprob_delta=max(deltas, default=0.0),
        tie=tie,
        tf_delta=None if forced is None else max(forced, default=0.0),
        match=((token_match and tolerances.within(deltas)) or excused) and departure is None,
        request=request,
        logprob_mean=sum(deltas) / len(deltas) if deltas else 0.0,
        tie_unscored=tie and forced is None,
        flip_delta=None if flips is None else max(flips),
        replay_departure=departure,
    )


def format_delta(value: float, tol: float) -> str:
    """A delta with enough digits to show which side of `tol` it is on (never `0.000` when > 0)."""
    text = f"{value:.3f}"
    digits = 3
    while value > 0 and (float(text) == 0 or (float(text) > tol) != (value > tol)) and digits < 12:
        text = f"{value:.{digits}g}"
        digits += 1
    return text


def delta_text(c: Comparison, tol: float) -> str:
    """The tuple's delta, measuring what it seems to. Where the tokens agree: the largest |Δ logprob|
    over the steps. Where they differ, the generated logprobs at the divergence belong to two different
    tokens, so the delta that measures the difference is the teacher-forced one (`tf`: both arms
    scoring the reference's tokens); without it, the tuple says its delta is across unlike tokens."""
    if c.token_match:
        return format_delta(c.logprob_delta, tol)
    if c.tf_delta is not None:
        return f"tf {format_delta(c.tf_delta, tol)}"
    return f"{format_delta(c.logprob_delta, tol)} across unlike tokens"


def tuple_text(c: Comparison, tol: float, extras: bool = True) -> str:
    """`(divergence char, token match, logprob delta)` (`delta_text`), with a tie's details."""
    text = f"({c.divergence_char}, {c.token_match}, {delta_text(c, tol)})"
    if not extras:
        return text
    notes = []
    if c.tie:
        notes.append("tie")
    if c.flip_delta is not None:
        notes.append(f"flip Δ {format_delta(c.flip_delta, tol)}")
    if c.tie_unscored:
        notes.append("tie not scored")
    if c.replay_departure is not None:
        notes.append("replay ≠ eager on its shape")
    return text + (f" [{', '.join(notes)}]" if notes else "")
