"""A run held to the loader's rules before it is judged (design §4b): `parity run` and `parity
verdict` of its file must always agree. An arm whose own results break a rule (teacher-forced scores
that disagree with its own generation, a replay in the wrong bucket) failed, with the rule's words as
its error; a rule no one arm broke fails every arm.
"""

from __future__ import annotations

from dataclasses import replace
from types import MappingProxyType

from parity.results import ArmResult, RunResult
from parity.trust.consistency import ArmPlace, Contradiction
from parity.trust.requirements import check_all


def self_checked(run: RunResult) -> RunResult:
    """The run with every arm that breaks a rule failed; each pass fails one arm (or, for a rule no
    arm broke, all of them), so the loop ends."""
    for _ in range(sum(len(c.all_arms()) for c in run.cases) + 1):
        try:
            check_all(run)
            return run
        except Contradiction as broken:
            message = f"parity's check of its own results: {broken}"
            places = [broken.place] if broken.place is not None else _places(run)
            if not places:
                return run
            for place in places:
                run = _fail_arm(run, place, message)
    return run


def _places(run: RunResult) -> list[ArmPlace]:
    return [ArmPlace(ci, None if not case.is_sequence else ri, arm.name)
            for ci, case in enumerate(run.cases)
            for ri, arms in (enumerate(r.arms for r in case.requests) if case.is_sequence else [(None, case.arms)])
            for arm in arms if not arm.failed]


def _fail_arm(run: RunResult, place: ArmPlace, message: str) -> RunResult:
    """The run with that arm failed (its answer kept) and no other arm scored against it."""
    def failed(arms: tuple[ArmResult, ...]) -> tuple[ArmResult, ...]:
        return tuple(replace(a, error=message, forced=MappingProxyType({})) if a.name == place.arm else
                     replace(a, forced=MappingProxyType({k: v for k, v in a.forced.items() if k != place.arm}))
                     for a in arms)

    case = run.cases[place.case]
    if place.request is None:
        case = replace(case, arms=failed(case.arms))
    else:
        requests = list(case.requests)
        requests[place.request] = replace(requests[place.request], arms=failed(requests[place.request].arms))
        case = replace(case, requests=tuple(requests))
    return replace(run, cases=tuple(case if i == place.case else c for i, c in enumerate(run.cases)))
