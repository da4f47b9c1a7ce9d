"""One arm of one request, as the experiment runs it: the answer, its teacher-forced scoring (which
a sequence defers until the sequence is over), and its repeats. A runtime failure at any step is the
arm's failure, and every step that finished is in the latest result, so a stop mid-arm keeps them.
"""

from __future__ import annotations

import time
from dataclasses import replace
from types import MappingProxyType
from typing import Sequence

from parity.arms import arm
from parity.backends.protocol import Answer, Session, SharesForwards
from parity.errors import ArmFailure
from parity.run.planning import PlannedRequest
from parity.results import ArmResult, Repeat, stored


class ArmRun:
    """`answer` (one request to the runtime), then `scored` (the arm, with its teacher-forced scores
    on `refs`), then `repeated` once per further run; `result` is always the latest."""

    def __init__(self, name: str, request: PlannedRequest) -> None:
        self.name, self.request = name, request
        known = arm(name)
        self.mode, self.deepstack = known.mode, known.deepstack
        self.pending: Answer | ArmFailure | None = None
        self.result: ArmResult | None = None
        self.seconds = 0.0

    def answer(self, session: Session) -> None:
        self.pending = self._timed(lambda: session.answer(self.request.request, self.deepstack))

    def scored(self, session: Session, refs: list[ArmResult]) -> ArmResult:
        if self.pending is None:
            self.answer(session)
        pending, self.pending = self.pending, None
        if isinstance(pending, ArmFailure):
            return self._failed(pending)
        start = time.perf_counter()
        try:
            first = session.score(pending, [r.token_ids for r in refs])
        except ArmFailure as failure:
            return self._failed(failure)
        scoring = time.perf_counter() - start
        # An arm a backend could not score on a reference keeps that reference with null scores: a
        # missing key is an edit, a null is what the backend said (design §4b).
        forced = {r.name: lps for r, lps in zip(refs, first.forced)} | {self.name: first.self_forced}
        self.result = ArmResult(
            name=self.name, mode=self.mode, deepstack=self.deepstack, token_ids=first.token_ids, text=first.text,
            token_logprobs=_stored(first.token_logprobs),
            top_logprobs=None if first.top_logprobs is None else tuple(
                tuple((token, stored(lp)) for token, lp in step) for step in first.top_logprobs),
            deepstack_record=first.deepstack_record, evidence=first.evidence,
            forced=MappingProxyType({name: None if lps is None else _stored(lps) for name, lps in forced.items()}),
            seconds=round(self.seconds, 4), forced_seconds=round(scoring, 4),
        )
        return self.result

    def repeated(self, session: Session, again: Answer | ArmFailure | None = None) -> ArmResult:
        """The arm with one more repeat (`again`: its answer, already served with a batch); each
        repeat keeps its own evidence (design §3 v3)."""
        if self.result is None or self.result.failed:
            return self.result
        if again is None:
            again = self._timed(lambda: session.answer(self.request.request, self.deepstack))
        if isinstance(again, ArmFailure):
            self.result = self._failed(again)
        else:
            generation = again.generation
            self.result = replace(self.result, seconds=round(self.seconds, 4), repeats=(
                *self.result.repeats,
                Repeat(generation.token_ids, _stored(generation.token_logprobs), generation.evidence)))
        return self.result

    def _timed(self, call):
        start = time.perf_counter()
        try:
            return call()
        except ArmFailure as failure:
            return failure
        finally:
            self.seconds += time.perf_counter() - start

    def _failed(self, failure: ArmFailure) -> ArmResult:
        self.result = failed_arm(self.name, failure, self.seconds)
        return self.result


def answer_together(runs: Sequence[ArmRun], session: Session, repeat: bool = False) -> None:
    """The runs' requests submitted at once where the session can (`SharesForwards`: a batch, whose
    time each run is charged an equal share of), else one after the other; `repeat`: as one more
    repeat of each (`ArmRun.repeated`), else as its answer."""
    if len(runs) < 2 or not isinstance(session, SharesForwards):
        for run in runs:
            run.repeated(session) if repeat else run.answer(session)
        return
    start = time.perf_counter()
    try:
        answers: Sequence[Answer | ArmFailure] = session.answer_together(
            [(run.request.request, run.deepstack) for run in runs])
    except ArmFailure as failure:
        answers = [failure] * len(runs)
    share = (time.perf_counter() - start) / len(runs)
    for run, answer in zip(runs, answers):
        run.seconds += share
        if repeat:
            run.repeated(session, answer)
        else:
            run.pending = answer


def _stored(logprobs: Sequence[float]) -> tuple[float, ...]:
    return tuple(stored(lp) for lp in logprobs)


def failed_arm(name: str, failure: ArmFailure, seconds: float = 0.0) -> ArmResult:
    known = arm(name)
    message = str(failure) + (f"\n--- log tail ---\n{failure.log_tail}" if failure.log_tail else "")
    return ArmResult(name=name, mode=known.mode, deepstack=known.deepstack, error=message, seconds=round(seconds, 4))
