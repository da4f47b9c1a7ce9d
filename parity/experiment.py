"""Running the experiment: cases x arms on one backend, into a judged `RunResult`.

Sessions are opened once per execution mode and shared by every case and arm of that mode, so the
model (or server) is loaded once per run, and normal/zero arms differ only in the tap.
"""

from __future__ import annotations

import importlib.metadata
import platform
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Callable

import torch
import transformers

from parity import __version__
from parity.arms import BCG_NORMAL, EAGER_NORMAL, MODES, ArmSpec
from parity.backends.base import Backend, Generation, Request, Session
from parity.errors import ArmFailure
from parity.fixtures import Fixture, Prompt
from parity.results import ArmResult, CaseResult, FixtureInfo, Repeat, RunResult
from parity.verdict import judge_run

SCENARIOS = ("four-arm", "reuse")
# Appended to a reuse follow-up until it lands in the primer's bucket.
_FILLER = " Answer in plain words."


@dataclass(frozen=True)
class CaseSpec:
    fixture: Fixture
    prompt: Prompt

    @property
    def id(self) -> str:
        return f"{self.fixture.name}/{self.prompt.id}"


@dataclass(frozen=True)
class RunSpec:
    model: str
    arms: tuple[ArmSpec, ...]
    cases: tuple[CaseSpec, ...]
    max_new_tokens: int = 20
    logprob_tol: float = 0.25
    dtype: str = "float32"
    scenario: str = "four-arm"
    repeat: int = 1


@dataclass(frozen=True)
class Progress:
    """One event for a progress display: an arm of a case is about to run (index of total)."""

    index: int
    total: int
    case_id: str
    arm: str


ProgressFn = Callable[[Progress], None]


def run_experiment(spec: RunSpec, backend: Backend, progress: ProgressFn | None = None) -> RunResult:
    modes = [m for m in MODES if any(a.mode == m for a in _arms_in_scope(spec))]
    results: dict[tuple[str, str], ArmResult] = {}
    plan = [(case, arm) for mode in modes for case in spec.cases for arm in _arms_in_scope(spec) if arm.mode == mode]
    counter = iter(range(1, len(plan) + 1))
    try:
        checked = {case.id: _checked_request(spec, backend, case) for case in spec.cases}
        backend.prepare(modes)
        for mode in modes:
            mode_plan = [(c, a) for c, a in plan if a.mode == mode]
            try:
                with backend.session(mode) as session:
                    for case, arm in mode_plan:
                        if progress:
                            progress(Progress(next(counter), len(plan), _case_id(spec, case), arm.name))
                        results[(case.id, arm.name)] = _run_arm(spec, session, case, checked[case.id], arm)
            except ArmFailure as failure:  # the mode never came up, or died mid-run
                for case, arm in mode_plan:
                    results.setdefault((case.id, arm.name), _failed(arm, failure))
        config = dict(backend.config())
    finally:
        backend.close()
    cases = tuple(_case_result(spec, case, checked[case.id], results) for case in spec.cases)
    run = RunResult(
        created=datetime.now(timezone.utc).isoformat(timespec="seconds"),
        environment=_environment(backend),
        config={
            "model": spec.model, "backend": backend.name, "dtype": spec.dtype,
            "max_new_tokens": spec.max_new_tokens, "logprob_tol": spec.logprob_tol,
            "scenario": spec.scenario, "repeat": spec.repeat, "arms": [a.name for a in spec.arms], **config,
        },
        cases=cases,
    )
    return judge_run(run)


def _arms_in_scope(spec: RunSpec) -> tuple[ArmSpec, ...]:
    if spec.scenario == "reuse":  # the follow-up is checked with DeepStack as computed
        return tuple(a for a in spec.arms if a.name in (EAGER_NORMAL, BCG_NORMAL))
    return spec.arms


def _case_id(spec: RunSpec, case: CaseSpec) -> str:
    return f"reuse/{case.id}" if spec.scenario == "reuse" else case.id


def _checked_request(spec: RunSpec, backend: Backend, case: CaseSpec) -> Request:
    request = Request(case.fixture, case.prompt.text)
    return reuse_followup(backend, request) if spec.scenario == "reuse" else request


def _run_arm(spec: RunSpec, session: Session, case: CaseSpec, request: Request, arm: ArmSpec) -> ArmResult:
    if spec.scenario == "reuse":
        # The image request leaves its state in the session; the checked request is the follow-up.
        _timed(session, Request(case.fixture, case.prompt.text), arm)
    first, seconds = _timed(session, request, arm)
    if isinstance(first, ArmFailure):
        return _failed(arm, first, seconds)
    repeats = []
    for _ in range(spec.repeat - 1):
        again, _ = _timed(session, request, arm)
        if isinstance(again, ArmFailure):
            return _failed(arm, again, seconds)
        repeats.append(Repeat(again.token_ids, again.token_logprobs))
    return ArmResult(
        name=arm.name, mode=arm.mode, deepstack=arm.deepstack, token_ids=first.token_ids, text=first.text,
        token_logprobs=first.token_logprobs, top_logprobs=first.top_logprobs,
        deepstack_record=first.deepstack_record, seconds=round(seconds, 4), repeats=tuple(repeats),
    )


def _timed(session: Session, request: Request, arm: ArmSpec) -> tuple[Generation | ArmFailure, float]:
    start = time.perf_counter()
    try:
        result: Generation | ArmFailure = session.generate(request, arm.deepstack)
    except ArmFailure as failure:
        result = failure
    return result, time.perf_counter() - start


def _failed(arm: ArmSpec, failure: ArmFailure, seconds: float = 0.0) -> ArmResult:
    message = str(failure) + (f"\n--- log tail ---\n{failure.log_tail}" if failure.log_tail else "")
    return ArmResult(name=arm.name, mode=arm.mode, deepstack=arm.deepstack, error=message, seconds=round(seconds, 4))


def reuse_followup(backend: Backend, primer: Request) -> Request:
    """A text-only request, shorter than the primer, in the primer's bucket when buckets are known."""
    limit = backend.prompt_length(primer)
    target = backend.bucket_of(limit)
    text = primer.prompt
    while target is not None and backend.bucket_of(backend.prompt_length(Request(None, text))) != target:
        longer = text + _FILLER
        if backend.prompt_length(Request(None, longer)) >= limit:
            break
        text = longer
    return Request(None, text)


def _case_result(spec: RunSpec, case: CaseSpec, request: Request, results) -> CaseResult:
    arms = tuple(results[(case.id, a.name)] for a in _arms_in_scope(spec) if (case.id, a.name) in results)
    reuse = spec.scenario == "reuse"
    return CaseResult(
        id=_case_id(spec, case),
        fixture=FixtureInfo(case.fixture.name, case.fixture.sha256, case.fixture.size),
        prompt=request.prompt,
        arms=arms,
        scenario=spec.scenario,
        primer=f"image request {case.id}: {case.prompt.text}" if reuse else None,
    )


def _environment(backend: Backend) -> dict:
    try:
        sglang = importlib.metadata.version("sglang")
    except importlib.metadata.PackageNotFoundError:
        sglang = None
    return {
        "parity": __version__, "python": platform.python_version(), "torch": torch.__version__,
        "transformers": transformers.__version__, "sglang": sglang, **backend.environment(),
    }
