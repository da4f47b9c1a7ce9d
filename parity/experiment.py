"""Running the experiment: cases x scenarios x arms on one backend, into a judged `RunResult`.

Sessions are opened once per execution mode (eager first, then bcg) and shared by every case and
scenario of that mode, so the model is loaded (or a server started) once per mode, and normal and
zero arms differ only in the tap. Within a mode, requests are served back to back in plan order:
a sequence scenario is exactly the order a server would see.
"""

from __future__ import annotations

import importlib.metadata
import platform
import signal
import time
from dataclasses import dataclass, field, replace
from datetime import datetime, timezone
from types import MappingProxyType
from typing import Callable, Sequence

from parity import __version__
from parity.arms import (
    ARM_ORDER, MODES, RUN_ORDER, ArmSpec, arm_mode_and_deepstack, arm_named,
)
from parity.backends.base import Answer, Backend, Request, Session
from parity.errors import ArmFailure, UsageError
from parity.fixtures import Fixture, Prompt
from parity.identity import SOURCE_KEY, source_identity
from parity.interrupts import deferred_stops, signal_of
from parity.localization import CanLocalize, auto_threshold, localize_run
from parity.metrics import DEFAULT_TIE_MARGIN, Tolerances, auto_tolerances
from parity.plan import PLAN_KEY, PlanEntry, plan_json, scenario_case_id, text_sha256
from parity.sharding import Shard, assignment, shard_config
from parity.results import (
    CASE_IMAGE, FOUR_ARM, SEQUENCE_REQUESTS, STREAM, TWIN_IMAGE, ArmResult, CaseResult, FixtureInfo, Repeat,
    RequestResult, RequestSpec, RunResult, stored,
)
from parity.results_consistency import ArmPlace, Contradiction
from parity.results_requirements import check_all
from parity.verdict import FOUR_ARM_CHECKS, POWER_CHECK, SEQUENCE_POWER_ARM, judge_run

# Appended to a text-only request until it lands in its image request's bucket.
_FILLER = " Answer in plain words."
_FILLER_WORD = " one"  # one token in Qwen's tokenizer and in the presets'


@dataclass(frozen=True)
class CaseSpec:
    fixture: Fixture
    prompt: Prompt

    @property
    def id(self) -> str:
        return f"{self.fixture.name}/{self.prompt.id}"


@dataclass(frozen=True)
class RunSpec:
    """What the run is: model, arms, cases, scenarios, and how answers are compared."""

    model: str
    arms: tuple[ArmSpec, ...]
    cases: tuple[CaseSpec, ...]
    scenarios: tuple[str, ...] = (FOUR_ARM,)
    max_new_tokens: int = 20
    logprob_tol: float | None = None  # None: auto, from the dtype's measured noise
    tie_margin: float = DEFAULT_TIE_MARGIN
    repeat: int = 1
    localize_threshold: float | None = None  # None: auto, from the dtype's measured noise
    shard: Shard | None = None  # run only this shard's cases (design §8); None: all of them

    @property
    def modes(self) -> tuple[str, ...]:
        return tuple(m for m in MODES if any(a.mode == m for a in self.arms))


@dataclass(frozen=True)
class Progress:
    """One event for a progress display: a request of a case is about to run (index of total)."""

    index: int
    total: int
    case_id: str
    arm: str


ProgressFn = Callable[[Progress], None]


class RunInterrupted(Exception):
    """Ctrl-C or SIGTERM (`signum`) during a run: `result` holds every arm that finished, the run
    marked interrupted (or, stopped while localizing, the whole judged run without localizations)."""

    def __init__(self, result: RunResult, signum: int = signal.SIGINT) -> None:
        super().__init__("interrupted")
        self.result = result
        self.signum = signum

    @property
    def finished_arms(self) -> int:
        return sum(len(case.all_arms()) for case in self.result.cases)


# --- the plan ------------------------------------------------------------------------------------

@dataclass(frozen=True)
class PlannedRequest:
    label: str
    request: Request
    deepstack: str
    power: bool = False  # also run eagerly with DeepStack zeroed: the sequence's power (design §3 v3)


@dataclass(frozen=True)
class PlannedCase:
    id: str
    scenario: str
    spec: CaseSpec
    requests: tuple[PlannedRequest, ...]
    arms: tuple[ArmSpec, ...] = ()  # four-arm only: the selected arms, in run order


def plan_cases(spec: RunSpec, backend: Backend) -> tuple[PlannedCase, ...]:
    planned = []
    for scenario in spec.scenarios:
        for case in spec.cases:
            image = Request(case.fixture, case.prompt.text)
            if scenario == FOUR_ARM:
                arms = tuple(sorted(spec.arms, key=lambda a: RUN_ORDER.index(a.name)))
                requests = (PlannedRequest("image", image, "normal"),)
            else:
                arms = ()
                requests = tuple(PlannedRequest(r.label, _sequence_request(r, scenario, backend, image), r.deepstack,
                                                 power=r.power)
                                 for r in SEQUENCE_REQUESTS[scenario])
            planned.append(PlannedCase(scenario_case_id(scenario, case.id), scenario, case, requests, arms))
    ids = [p.id for p in planned]
    if len(set(ids)) != len(ids):
        raise UsageError(f"two cases share an id ({', '.join(sorted({i for i in ids if ids.count(i) > 1}))})")
    return tuple(planned)


def _sequence_request(spec: RequestSpec, scenario: str, backend: Backend, image: Request) -> Request:
    if spec.image == CASE_IMAGE:
        return image
    if spec.image == TWIN_IMAGE:
        return Request(image.fixture.twin(), image.prompt)
    # reuse: a shorter text request in the image's bucket; stream: exactly as long where reachable
    return text_request_in_bucket(backend, image, same_length=scenario == STREAM)


def planned_arm_runs(spec: RunSpec) -> int:
    """How many generations the plan makes (repeats included), known before a model loads."""
    # A sequence: every request in each mode, and its first request's eager power arm.
    per_case = sum(len(spec.arms) if scenario == FOUR_ARM
                   else len(SEQUENCE_REQUESTS[scenario]) * len(spec.modes) + ("eager" in spec.modes)
                   for scenario in spec.scenarios)
    return per_case * len(spec.cases) * spec.repeat


def text_request_in_bucket(backend: Backend, image: Request, same_length: bool) -> Request:
    """The image request's prompt without the image, lengthened with filler until it lands in the
    image request's bucket: shorter than it (reuse), or exactly as long where reachable (stream),
    so a stale DeepStack slot has rows to leak into."""
    limit = backend.prompt_length(image)
    target = backend.bucket_of(limit)
    text = image.prompt
    if target is None:
        return Request(None, text)
    longest = limit if same_length else limit - 1
    for filler in (_FILLER, _FILLER_WORD):  # coarse steps first, then one word at a time
        length = backend.prompt_length(Request(None, text))
        while not (backend.bucket_of(length) == target and (not same_length or length == limit)):
            longer = backend.prompt_length(Request(None, text + filler))
            if longer > longest or longer <= length:
                break
            text, length = text + filler, longer
    return Request(None, text)


# --- running ---------------------------------------------------------------------------------------

@dataclass
class _Collected:
    """Arm results as they finish: (case id, request index, arm name) -> ArmResult."""

    arms: dict[tuple[str, int, str], ArmResult] = field(default_factory=dict)

    def get(self, case_id: str, request: int, name: str) -> ArmResult | None:
        return self.arms.get((case_id, request, name))


def run_experiment(spec: RunSpec, backend: Backend, progress: ProgressFn | None = None,
                   warn: Callable[[str], object] | None = None) -> RunResult:
    """Run, judge, and localize every case whose bcg arm disagrees with eager (design §7), on the
    still-loaded backend; `warn` hears about cases that could not be localized. Ctrl-C or SIGTERM
    after the plan is made raises `RunInterrupted` with every arm that finished. The backend is
    closed in every case, a second signal notwithstanding."""
    try:
        run = _run_and_judge(spec, backend, progress, warn)
    except BaseException:
        with deferred_stops(reraise=False):  # already stopping: a second Ctrl-C must not leave a server up
            backend.close()
        raise
    with deferred_stops(reraise=False) as noted:
        backend.close()
    if noted:  # a stop while closing: the judged run is whole, and is kept
        raise RunInterrupted(run, noted[0])
    return run


def _run_and_judge(spec: RunSpec, backend: Backend, progress: ProgressFn | None,
                   warn: Callable[[str], object] | None) -> RunResult:
    planned, plan, collected, stop = _run_plan(spec, backend, progress)
    config = dict(backend.config())
    if plan is not None:
        config[PLAN_KEY] = plan_json(plan)
    if spec.shard is not None and plan is not None:
        config["shard"] = shard_config(spec.shard, _assignment(spec, plan))
        planned = _in_shard(spec, planned, plan)
    localizes = isinstance(backend, CanLocalize)
    if localizes:
        config["localize_threshold"] = spec.localize_threshold or auto_threshold(str(config.get("dtype")))
    run = _run_result(spec, backend, planned, collected, config, stop is not None)
    if stop is not None:
        raise RunInterrupted(run, signal_of(stop))
    if not localizes:
        return run  # nothing to probe: the report says so on every case that would need it
    try:
        return localize_run(run, backend, {c.id: tuple(r.request for r in c.requests) for c in planned},
                            config["localize_threshold"], warn=warn)
    except KeyboardInterrupt as stop:  # the judged run stands; only its localizations are missing
        raise RunInterrupted(run, signal_of(stop)) from None


def _run_plan(spec: RunSpec, backend: Backend, progress: ProgressFn | None):
    """(every planned case, the plan's entries (None when stopped before the prompts were measured),
    the arms that finished, the stop (Ctrl-C or SIGTERM) that ended it early or None); with a shard,
    only the shard's cases are run."""
    planned = plan_cases(spec, backend)
    collected = _Collected()
    plan = None
    try:
        # Every shard captures for, and checks, the whole plan: its runner is the unsharded run's.
        lengths = _check_lengths(spec, backend, planned)
        plan = tuple(_plan_entry(case, lengths[case.id]) for case in planned)
        selected = _in_shard(spec, planned, plan)
        total = sum(_generations(spec, case) for case in selected)
        counter = iter(range(1, total + 1))

        def announce(case_id: str, label: str) -> None:
            if progress:
                progress(Progress(next(counter), total, case_id, label))

        backend.prepare(spec.modes, [n for case in planned for n in lengths[case.id]])
        for mode in spec.modes:
            _run_mode(spec, backend, selected, mode, collected, announce)
    except KeyboardInterrupt as stop:
        return planned, plan, collected, stop
    return planned, plan, collected, None


def _check_lengths(spec: RunSpec, backend: Backend, planned: Sequence[PlannedCase]) -> dict[str, list[int]]:
    """Case id -> the prompt length of each of its requests; a request past the context is refused."""
    lengths: dict[str, list[int]] = {}
    for case in planned:
        for req in case.requests:
            length = backend.prompt_length(req.request)
            limit = backend.max_positions
            if limit is not None and length + spec.max_new_tokens > limit:
                raise UsageError(
                    f"case {case.id}: a prompt of {length} tokens plus --max-new-tokens {spec.max_new_tokens} "
                    f"exceeds the model's context of {limit} positions; use a shorter prompt or fewer new tokens")
            lengths.setdefault(case.id, []).append(length)
    return lengths


def _plan_entry(case: PlannedCase, lengths: Sequence[int]) -> PlanEntry:
    fixture = case.spec.fixture
    return PlanEntry(case.id, case.scenario, None if fixture is None else fixture.sha256,
                     text_sha256(case.spec.prompt.text), max(lengths))


def _generations(spec: RunSpec, case: PlannedCase) -> int:
    """What a case costs: its generations over every request and mode (the progress total)."""
    return sum(len(_arms_for(case, mode, req)) for mode in spec.modes for req in case.requests)


def _assignment(spec: RunSpec, plan: Sequence[PlanEntry]) -> dict[str, int]:
    """Case id -> shard, in plan order: a pure function of the plan (plan.assignment)."""
    return assignment(plan, [a.name for a in spec.arms], spec.shard.count)


def _in_shard(spec: RunSpec, planned: Sequence[PlannedCase], plan: Sequence[PlanEntry]) -> tuple[PlannedCase, ...]:
    if spec.shard is None:
        return tuple(planned)
    assigned = _assignment(spec, plan)
    return tuple(case for case in planned if assigned[case.id] == spec.shard.index)


def _arms_for(case: PlannedCase, mode: str, req: PlannedRequest) -> list[str]:
    if case.scenario == FOUR_ARM:
        return [a.name for a in case.arms if a.mode == mode]
    arm = arm_named(mode, req.deepstack)
    return [arm, SEQUENCE_POWER_ARM] if req.power and mode == "eager" else [arm]


def _run_mode(spec: RunSpec, backend: Backend, planned: Sequence[PlannedCase], mode: str, collected: _Collected,
              announce: Callable[[str, str], object]) -> None:
    try:
        with backend.session(mode) as session:
            for case in planned:
                runner = _run_four_arm if case.scenario == FOUR_ARM else _run_sequence
                runner(spec, session, case, mode, collected, announce)
    except ArmFailure as failure:  # the mode never came up, or died mid-run
        for case in planned:
            for i, req in enumerate(case.requests):
                for name in _arms_for(case, mode, req):
                    collected.arms.setdefault((case.id, i, name), _failed(name, failure))


def _run_four_arm(spec: RunSpec, session: Session, case: PlannedCase, mode: str, collected: _Collected,
                  announce: Callable[[str, str], object]) -> None:
    req = case.requests[0]
    for name in _arms_for(case, mode, req):
        announce(case.id, name)
        run = _ArmRun(name, req)
        collected.arms[(case.id, 0, name)] = run.scored(session, _references(case, 0, name, collected))
        for _ in range(spec.repeat - 1):
            collected.arms[(case.id, 0, name)] = run.repeated(session)


def _run_sequence(spec: RunSpec, session: Session, case: PlannedCase, mode: str, collected: _Collected,
                  announce: Callable[[str, str], object]) -> None:
    """The sequence's requests back to back, as a server would see them; then (eager session) its
    power arm; then the scoring of every answer. Each repeat is the whole sequence again."""
    runs = [_ArmRun(arm_named(mode, req.deepstack), req) for req in case.requests]
    for run in runs:
        announce(case.id, f"{run.name} · {run.request.label}")
        run.answer(session)
    power = [(i, _ArmRun(SEQUENCE_POWER_ARM, req)) for i, req in enumerate(case.requests)
             if req.power and mode == "eager"]
    for i, run in power:
        announce(case.id, f"{run.name} · {run.request.label}")
        run.answer(session)
    # Scored in run order: each power arm's reference is its request's own eager answer, scored first.
    for i, run in [*enumerate(runs), *power]:
        collected.arms[(case.id, i, run.name)] = run.scored(session, _references(case, i, run.name, collected))
    for _ in range(spec.repeat - 1):
        for i, run in [*enumerate(runs), *power]:
            collected.arms[(case.id, i, run.name)] = run.repeated(session)


def _references(case: PlannedCase, request: int, name: str, collected: _Collected) -> list[ArmResult]:
    """The finished, successful references this arm is compared against (teacher forcing)."""
    if case.scenario == FOUR_ARM:
        names = [c.b for c in FOUR_ARM_CHECKS if c.a == name]
    elif case.requests[request].power and name == SEQUENCE_POWER_ARM:
        names = [POWER_CHECK.b]
    else:
        mode, deepstack = arm_mode_and_deepstack(name)
        names = [arm_named("eager", deepstack)] if mode == "bcg" else []
    refs = [collected.get(case.id, request, n) for n in names]
    return [r for r in refs if r is not None and not r.failed]


class _ArmRun:
    """One arm of one request: its answer, its scoring, its repeats; a runtime failure at any step
    is the arm's failure, and every step that finished is in the latest result."""

    def __init__(self, name: str, request: PlannedRequest) -> None:
        self.name, self.request = name, request
        self.mode, self.deepstack = arm_mode_and_deepstack(name)
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

    def repeated(self, session: Session) -> ArmResult:
        """The arm with one more repeat; each repeat keeps its own evidence (design §3 v3)."""
        if self.result is None or self.result.failed:
            return self.result
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
        self.result = _failed(self.name, failure, self.seconds)
        return self.result


def _stored(logprobs: Sequence[float]) -> tuple[float, ...]:
    return tuple(stored(lp) for lp in logprobs)


def _failed(name: str, failure: ArmFailure, seconds: float = 0.0) -> ArmResult:
    mode, deepstack = arm_mode_and_deepstack(name)
    message = str(failure) + (f"\n--- log tail ---\n{failure.log_tail}" if failure.log_tail else "")
    return ArmResult(name=name, mode=mode, deepstack=deepstack, error=message, seconds=round(seconds, 4))


# --- into results ----------------------------------------------------------------------------------

def _fixture_info(fixture: Fixture | None) -> FixtureInfo | None:
    return None if fixture is None else FixtureInfo(fixture.name, fixture.sha256, fixture.size)


def _case_result(case: PlannedCase, collected: _Collected) -> CaseResult:
    def arms_of(i: int, names) -> tuple[ArmResult, ...]:
        found = (collected.get(case.id, i, n) for n in names)
        return tuple(a for a in found if a is not None)

    info = _fixture_info(case.spec.fixture)
    if case.scenario == FOUR_ARM:
        names = sorted((a.name for a in case.arms), key=ARM_ORDER.index)
        return CaseResult(case.id, info, case.spec.prompt.text, arms=arms_of(0, names), scenario=FOUR_ARM)
    requests = tuple(
        RequestResult(req.label, _fixture_info(req.request.fixture), req.request.prompt,
                      arms_of(i, [arm_named(m, req.deepstack) for m in MODES] + [SEQUENCE_POWER_ARM] * req.power),
                      req.deepstack)
        for i, req in enumerate(case.requests)
    )
    return CaseResult(case.id, info, case.spec.prompt.text, requests=requests, scenario=case.scenario)


def _run_result(spec, backend, planned, collected, config, interrupted) -> RunResult:
    dtype = str(config.get("dtype", "float32"))
    # A user's --logprob-tol is one flat bound on every step; auto follows the dtype's measured noise.
    tol = Tolerances(spec.logprob_tol) if spec.logprob_tol is not None else auto_tolerances(dtype)
    run = RunResult(
        created=datetime.now(timezone.utc).isoformat(timespec="seconds"),
        environment=_environment(backend),
        config={
            "model": spec.model, "backend": backend.name, "max_new_tokens": spec.max_new_tokens,
            "logprob_tol": tol.logprob_tol, "logprob_mean_tol": tol.mean_tol,
            "logprob_tol_source": "user" if spec.logprob_tol is not None else "auto",
            "tie_margin": spec.tie_margin, "scenarios": list(spec.scenarios), "repeat": spec.repeat,
            "arms": [a.name for a in spec.arms], **config,
        },
        cases=tuple(_case_result(case, collected) for case in planned),
        interrupted=interrupted,
    )
    return judge_run(_self_checked(run))


def _self_checked(run: RunResult) -> RunResult:
    """The run held to every rule the loader holds its file to (design §4b), so `parity run` and
    `parity verdict` of its file always agree: an arm whose results break a rule (teacher-forced
    scores that disagree with its own generation, a replay in the wrong bucket) failed, with the
    rule's words as its error; a rule no one arm broke fails every arm."""
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


def _environment(backend: Backend) -> dict:
    def version(name: str) -> str | None:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            return None

    return {
        "parity": __version__, SOURCE_KEY: source_identity(), "python": platform.python_version(),
        "torch": version("torch"),
        "transformers": version("transformers"), "sglang": version("sglang"), **backend.environment(),
    }
