"""Localizing a divergence (design §7): where a replayed prefill first leaves its eager reference.

A FAIL says that graph replay answers differently from eager; this says where. The prefill of the
failing request is probed twice: by replay, through the probe graph of the runner under test (same
body, same slots, same variant), after the case's bcg requests that ran before it, so the state a
request leaves in the slots is there again; and eagerly, with the reference arm's tap. At every
probe point (after each decoder layer, and after each DeepStack add) the relative error
`||h_bcg - h_eager|| / ||h_eager||` over the request's real rows is taken, and the first point above
a threshold is named.

Only a backend whose graph parity owns can probe (`CanLocalize`): a hook inside SGLang's captured
region does not fire at replay, so the SGLang backend does not offer it.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Mapping, Sequence

from parity.arms import BCG_NORMAL, BCG_ZERO, EAGER_NORMAL, EAGER_ZERO, RUN_ORDER, Mode, arm_for
from parity.arms import arm as arm_of
from parity.errors import LocalizationError
from parity.design import SEQUENCE_REQUESTS, forwards
from parity.results import CaseResult, LayerError, Localization, RunResult
from parity.judge.verdict import (
    FAIL_CONTROL_DIVERGES, FAIL_DEEPSTACK_DROPPED, FAIL_GRAPH_DIVERGES, FAIL_INPUT_NOT_FRESH, FAIL_STALE_STATE,
)

if TYPE_CHECKING:  # reports import this module: no torch, no fixtures at import time
    import torch

    from parity.backends.protocol import CanLocalize, Request

# Per-point relative error of a correct (fixed) runner against eager, measured on every preset,
# built-in fixture and prompt on the CPU (scripts/localization_noise.py, docs/localization.md): at
# most 4.2e-7 in fp32, 1.2e-3 in fp16, 5.3e-3 in bf16; the buggy variants show 0.3 to 1 at their
# first divergent point. Each default sits between the two, with room for GPU kernels and deeper
# models, which were not measured.
AUTO_THRESHOLD = {"float32": 1e-4, "bfloat16": 0.1, "float16": 0.02}

# Which bcg arm a four-arm verdict blames, against which eager reference.
FOUR_ARM_TARGETS = {
    FAIL_DEEPSTACK_DROPPED: (BCG_NORMAL, EAGER_NORMAL),
    FAIL_GRAPH_DIVERGES: (BCG_NORMAL, EAGER_NORMAL),
    FAIL_CONTROL_DIVERGES: (BCG_ZERO, EAGER_ZERO),
}


@dataclass(frozen=True)
class Step:
    """One bcg request of a case: which request (0 in a four-arm case) and the tap at its LM entry."""

    request: int
    deepstack: str  # "normal" | "zero"


@dataclass(frozen=True)
class Target:
    """What to localize in a case: a bcg arm against its eager reference, on one request."""

    arm: str
    reference: str
    request: int | None  # the sequence request localized; None in a four-arm case
    step: Step
    prefix: tuple[Step, ...]  # the case's bcg requests that ran before it, in order
    together: tuple[Step, ...] = ()  # the requests submitted with it, itself among them (batch); () alone


def auto_threshold(dtype: str) -> float:
    return AUTO_THRESHOLD.get(dtype, AUTO_THRESHOLD["bfloat16"])


SEQUENCE_FAILURES = (FAIL_STALE_STATE, FAIL_DEEPSTACK_DROPPED, FAIL_GRAPH_DIVERGES, FAIL_INPUT_NOT_FRESH)


def target_of(case: CaseResult) -> Target | None:
    """The comparison a case's verdict blames, or None when its bcg arms agree with eager."""
    code = case.verdict.code if case.verdict else None
    if case.is_sequence:
        # Stale state after earlier requests, or (v3) a first request that dropped DeepStack or diverged.
        return _sequence_target(case) if code in SEQUENCE_FAILURES else None
    witnessed = _witnessed_arm(case) if code is not None and code.startswith("FAIL_") else None
    if witnessed is not None:  # the freshness witness named the arm whose replay read the wrong rows
        arm, reference = witnessed, arm_for(Mode.EAGER, arm_of(witnessed).deepstack).name
    elif code in FOUR_ARM_TARGETS:
        arm, reference = FOUR_ARM_TARGETS[code]
    else:
        return None
    ran = {a.name for a in case.arms}
    # The bcg arms that ran before it in the case, in the experiment's order.
    before = [n for n in RUN_ORDER[:RUN_ORDER.index(arm)] if n in ran and arm_of(n).mode is Mode.BCG]
    prefix = tuple(Step(0, arm_of(name).deepstack) for name in before)
    return Target(arm, reference, None, Step(0, arm_of(arm).deepstack), prefix)


def _witnessed_arm(case: CaseResult) -> str | None:
    """The first graph arm, in the order the arms ran, whose replays read rows its request did not
    write (design §6): what a four-arm witness verdict is about."""
    arms = {a.name: a for a in case.arms}
    return next((name for name in RUN_ORDER if name in arms and arms[name].evidence is not None
                 and not all(r.fresh for r in arms[name].evidence.freshness)), None)


def _sequence_target(case: CaseResult) -> Target | None:
    """The first request whose bcg answer differs from the eager one, after every request before it."""
    steps = tuple(Step(i, r.arms[0].deepstack if r.arms else "normal") for i, r in enumerate(case.requests))
    for step in steps:
        arm, reference = arm_for(Mode.BCG, step.deepstack).name, arm_for(Mode.EAGER, step.deepstack).name
        comparison = case.comparison(arm, reference, step.request)
        if comparison is not None and not comparison.match:
            group = next((g for g in forwards(SEQUENCE_REQUESTS.get(case.scenario, ())) if step.request in g),
                         [step.request])
            together = tuple(steps[i] for i in group if i < len(steps)) if len(group) > 1 else ()
            return Target(arm, reference, step.request, step, steps[:group[0]], together)
    return None


def relative_errors(replay: "torch.Tensor", eager: "torch.Tensor") -> tuple[float, ...]:
    """`||replay - eager|| / ||eager||` per probe point over all rows; both [T, P, H]."""
    if replay.shape != eager.shape:
        raise LocalizationError(f"the replay's probe points {tuple(replay.shape)} do not match the eager "
                                f"body's {tuple(eager.shape)} ([tokens, points, hidden])")
    errors = []
    for point in range(eager.shape[1]):
        # In float64: the fp32 noise (~1e-7) must not drown in the norm's own rounding.
        reference = eager[:, point].double()
        diff = float((replay[:, point].double() - reference).norm())
        norm = float(reference.norm())
        if not (math.isfinite(diff) and math.isfinite(norm)):
            raise LocalizationError(f"non-finite hidden state at probe point {point}: nothing to compare")
        errors.append(diff / norm if norm > 0 else (0.0 if diff == 0 else math.inf))
    if not all(math.isfinite(e) for e in errors):
        raise LocalizationError("the eager hidden state is all zero where the replay's is not")
    return tuple(errors)


def first_above(errors: Sequence[float], threshold: float) -> int | None:
    return next((i for i, error in enumerate(errors) if error > threshold), None)


def localize(backend: CanLocalize, target: Target, requests: Sequence[Request], threshold: float) -> Localization:
    """Probe the target's prefill by replay (after its prefix) and eagerly, and compare per point."""
    prefix = [(requests[s.request], s.deepstack) for s in target.prefix]
    together = [(requests[s.request], s.deepstack) for s in target.together]
    request = requests[target.step.request]
    try:
        replay = backend.probe("bcg", request, target.step.deepstack, prefix, together)
        # The eager session serves the same prefix: its prefix cache decides which rows it computes.
        eager = backend.probe("eager", request, target.step.deepstack, prefix, together)
    except (RuntimeError, ValueError) as err:  # a forward, or a slot refresh that failed closed
        raise LocalizationError(f"the probe failed ({err.__class__.__name__}: {err})") from err
    errors = relative_errors(replay.hidden, eager.hidden)
    # Named after the eager body's points: the reference says where each add belongs.
    points = tuple(LayerError(layer, block, error) for (layer, block), error in zip(eager.points, errors))
    return Localization(target.arm, target.reference, target.request, threshold, points,
                        first_above(errors, threshold))


def not_available(backend: str) -> str:
    return (f"localization is not available on the {backend} backend: parity can only probe a graph it "
            "captures itself; rerun the failing case on the transformers backend with the same checkpoint")


def localize_run(run: RunResult, backend: object, requests: Mapping[str, Sequence[Request]],
                 threshold: float | None = None, only: str | None = None,
                 warn: Callable[[str], None] | None = None) -> RunResult:
    """`run` with a localization on every case that needs one (or only on case `only`).

    `requests[case id]` are the case's requests in order (one for a four-arm case); `threshold`
    None is the dtype's default. A case that cannot be localized is reported to `warn` and left
    as it was; without `warn` it raises `LocalizationError`.
    """
    if threshold is None:
        threshold = auto_threshold(str(run.config.get("dtype", "float32")))
    cases = []
    for case in run.cases:
        target = target_of(case) if only is None or case.id == only else None
        if target is not None:
            try:
                from parity.backends.protocol import CanLocalize

                if not isinstance(backend, CanLocalize):
                    raise LocalizationError(not_available(str(run.config.get("backend"))))
                case = dataclasses.replace(case, localization=localize(backend, target, requests[case.id], threshold))
            except LocalizationError as err:
                if warn is None:
                    raise LocalizationError(f"case {case.id}: {err}") from None
                warn(f"case {case.id} not localized: {err}")
        cases.append(case)
    return dataclasses.replace(run, cases=tuple(cases))
