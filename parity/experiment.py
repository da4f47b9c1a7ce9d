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
from dataclasses import dataclass, field
from datetime import datetime, timezone
from types import MappingProxyType
from typing import Callable, Sequence

from parity import __version__
from parity.arms import (
    ARM_ORDER, MODES, RUN_ORDER, ArmSpec, arm_mode_and_deepstack, arm_named,
)
from parity.backends.base import Backend, Generation, Request, Session
from parity.errors import ArmFailure, UsageError
from parity.fixtures import Fixture, Prompt
from parity.interrupts import deferred_stops, signal_of
from parity.localization import CanLocalize, auto_threshold, localize_run
from parity.metrics import DEFAULT_TIE_MARGIN, Tolerances, auto_tolerances
from parity.sharding import Shard, partition, shard_config
from parity.results import (
    CASE_IMAGE, FOUR_ARM, SEQUENCE_REQUESTS, STREAM, TWIN_IMAGE, ArmResult, CaseResult, FixtureInfo, Repeat,
    RequestResult, RequestSpec, RunResult,
)
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


def scenario_case_id(scenario: str, case: CaseSpec) -> str:
    return case.id if scenario == FOUR_ARM else f"{scenario}/{case.id}"


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
            planned.append(PlannedCase(scenario_case_id(scenario, case), scenario, case, requests, arms))
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
    with deferred_stops():
        backend.close()
    return run


def _run_and_judge(spec: RunSpec, backend: Backend, progress: ProgressFn | None,
                   warn: Callable[[str], object] | None) -> RunResult:
    planned, collected, stop = _run_plan(spec, backend, progress)
    config = dict(backend.config())
    if spec.shard is not None:
        config["shard"] = shard_config(spec.shard, _assignment(spec, planned))
        planned = _in_shard(spec, planned)
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
    """(every planned case, the arms that finished, the stop (Ctrl-C or SIGTERM) that ended it early or
    None); with a shard, only the shard's cases are run."""
    planned = plan_cases(spec, backend)
    collected = _Collected()
    try:
        # Every shard captures for, and checks, the whole plan: its runner is the unsharded run's.
        lengths = _check_lengths(spec, backend, planned)
        selected = _in_shard(spec, planned)
        total = sum(_generations(spec, case) for case in selected)
        counter = iter(range(1, total + 1))

        def announce(case_id: str, label: str) -> None:
            if progress:
                progress(Progress(next(counter), total, case_id, label))

        backend.prepare(spec.modes, lengths)
        for mode in spec.modes:
            _run_mode(spec, backend, selected, mode, collected, announce)
    except KeyboardInterrupt as stop:
        return planned, collected, stop
    return planned, collected, None


def _check_lengths(spec: RunSpec, backend: Backend, planned: Sequence[PlannedCase]) -> list[int]:
    lengths = []
    for case in planned:
        for req in case.requests:
            length = backend.prompt_length(req.request)
            limit = backend.max_positions
            if limit is not None and length + spec.max_new_tokens > limit:
                raise UsageError(
                    f"case {case.id}: a prompt of {length} tokens plus --max-new-tokens {spec.max_new_tokens} "
                    f"exceeds the model's context of {limit} positions; use a shorter prompt or fewer new tokens")
            lengths.append(length)
    return lengths


def _generations(spec: RunSpec, case: PlannedCase) -> int:
    """What a case costs: its generations over every request and mode (sharding's expected cost)."""
    return sum(len(_arms_for(case, mode, req)) for mode in spec.modes for req in case.requests)


def _assignment(spec: RunSpec, planned: Sequence[PlannedCase]) -> dict[str, int]:
    """Case id -> shard, in plan order; cases are assigned in case-list order (sharding.py)."""
    per_scenario = len(spec.cases)  # plan_cases is scenario-major over spec.cases
    costs = [_generations(spec, case) for case in planned]
    order = sorted(range(len(planned)), key=lambda i: (i % per_scenario, -costs[i], i // per_scenario))
    shards = partition([(planned[i].id, costs[i]) for i in order], spec.shard.count)
    return {case.id: shards[case.id] for case in planned}


def _in_shard(spec: RunSpec, planned: Sequence[PlannedCase]) -> tuple[PlannedCase, ...]:
    if spec.shard is None:
        return tuple(planned)
    assigned = _assignment(spec, planned)
    return tuple(case for case in planned if assigned[case.id] == spec.shard.index)


def _arms_for(case: PlannedCase, mode: str, req: PlannedRequest) -> list[str]:
    if case.scenario == FOUR_ARM:
        return [a.name for a in case.arms if a.mode == mode]
    arm = arm_named(mode, req.deepstack)
    return [arm, SEQUENCE_POWER_ARM] if req.power and mode == "eager" else [arm]


def _run_mode(spec: RunSpec, backend: Backend, planned: Sequence[PlannedCase], mode: str, collected: _Collected,
              announce: Callable[[str, str], object]) -> None:
    work = [(case, i, req, name) for case in planned for i, req in enumerate(case.requests)
            for name in _arms_for(case, mode, req)]
    try:
        with backend.session(mode) as session:
            for case, i, req, name in work:
                announce(case.id, _progress_label(case, req, name))
                refs = _references(case, i, name, collected)
                collected.arms[(case.id, i, name)] = _run_arm(spec, session, req, name, refs)
    except ArmFailure as failure:  # the mode never came up, or died mid-run
        for case, i, _, name in work:
            collected.arms.setdefault((case.id, i, name), _failed(name, failure))


def _progress_label(case: PlannedCase, req: PlannedRequest, name: str) -> str:
    return name if case.scenario == FOUR_ARM else f"{name} · {req.label}"


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


def _run_arm(spec: RunSpec, session: Session, req: PlannedRequest, name: str, refs: list[ArmResult]) -> ArmResult:
    mode, deepstack = arm_mode_and_deepstack(name)
    first, seconds = _timed(session, req.request, deepstack, [r.token_ids for r in refs])
    if isinstance(first, ArmFailure):
        return _failed(name, first, seconds)
    repeats, scoring = [], first.forced_seconds
    for _ in range(spec.repeat - 1):
        again, more = _timed(session, req.request, deepstack, [])
        seconds += more
        if isinstance(again, ArmFailure):
            return _failed(name, again, seconds)
        scoring += again.forced_seconds
        # Each repeat keeps its own evidence: rule 4 is checked per run (design §3 v3).
        repeats.append(Repeat(again.token_ids, again.token_logprobs, again.evidence))
    return ArmResult(
        name=name, mode=mode, deepstack=deepstack, token_ids=first.token_ids, text=first.text,
        token_logprobs=first.token_logprobs, top_logprobs=first.top_logprobs,
        deepstack_record=first.deepstack_record, evidence=first.evidence,
        forced=MappingProxyType({r.name: lps for r, lps in zip(refs, first.forced) if lps is not None}
                                | ({} if first.self_forced is None else {name: first.self_forced})),
        seconds=round(seconds - scoring, 4), forced_seconds=round(scoring, 4),
        repeats=tuple(repeats),
    )


def _timed(session: Session, request: Request, deepstack: str, force) -> tuple[Generation | ArmFailure, float]:
    start = time.perf_counter()
    try:
        result: Generation | ArmFailure = session.generate(request, deepstack, force)
    except ArmFailure as failure:
        result = failure
    return result, time.perf_counter() - start


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
    return judge_run(run)


def _environment(backend: Backend) -> dict:
    def version(name: str) -> str | None:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            return None

    return {
        "parity": __version__, "python": platform.python_version(), "torch": version("torch"),
        "transformers": version("transformers"), "sglang": version("sglang"), **backend.environment(),
    }
