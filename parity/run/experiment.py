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
from typing import Callable, Sequence

from parity import __version__
from parity.run.arm_run import ArmRun, answer_together, failed_arm
from parity.arms import ARM_ORDER, MODES, Mode, arm, arm_for
from parity.backends.protocol import Backend, CanLocalize, Session
from parity import registry
from parity.errors import ArmFailure
from parity.media.fixtures import Fixture
from parity.judge.identity import SOURCE_KEY, source_identity
from parity.run.interrupts import deferred_stops, signal_of
from parity.run.localization import auto_threshold, localize_run
from parity.judge.metrics import Tolerances, auto_tolerances
from parity.plan.entries import PLAN_KEY, plan_json
from parity.run.planning import (
    PlannedCase, RunSpec, arms_for, check_lengths, generations, in_shard, plan_cases, plan_entry, replayed_lengths,
    serving_order, shard_assignment,
)
from parity.design import forwards
from parity.results import FOUR_ARM, ArmResult, CaseResult, FixtureInfo, RequestResult, RunResult, Timings
from parity.run.self_check import self_checked
from parity.plan.sharding import shard_config
from parity.judge.verdict import FOUR_ARM_CHECKS, POWER_CHECK, SEQUENCE_POWER_ARM, judge_run


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


# --- running ---------------------------------------------------------------------------------------

@dataclass
class _Collected:
    """Arm results as they finish: (case id, request index, arm name) -> ArmResult."""

    arms: dict[tuple[str, int, str], ArmResult] = field(default_factory=dict)

    def get(self, case_id: str, request: int, name: str) -> ArmResult | None:
        return self.arms.get((case_id, request, name))


@dataclass
class _Clock:
    """The wall time of a run's phases, as they end (`Timings`)."""

    load_s: float | None = None
    started: float = field(default_factory=time.perf_counter)
    modes: dict[str, float] = field(default_factory=dict)

    def timings(self, backend: Backend, localize_s: float | None = None) -> Timings:
        return Timings(load_s=self.load_s, eager_s=self.modes.get("eager"), bcg_s=self.modes.get("bcg"),
                       localize_s=localize_s, total_s=(self.load_s or 0.0) + time.perf_counter() - self.started,
                       **backend.timings())


def run_experiment(spec: RunSpec, backend: Backend, progress: ProgressFn | None = None,
                   warn: Callable[[str], object] | None = None, load_seconds: float | None = None) -> RunResult:
    """Run, judge, and localize every case whose bcg arm disagrees with eager (design §7), on the
    still-loaded backend; `warn` hears about cases that could not be localized. Ctrl-C or SIGTERM
    after the plan is made raises `RunInterrupted` with every arm that finished. The backend is
    closed in every case, a second signal notwithstanding. `load_seconds`: how long the backend took
    to build (the model's load), recorded with the run's other timings."""
    try:
        run = _run_and_judge(spec, backend, progress, warn, _Clock(load_seconds))
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
                   warn: Callable[[str], object] | None, clock: _Clock) -> RunResult:
    planned, plan, collected, stop = _run_plan(spec, backend, progress, clock)
    config = dict(backend.config())
    if plan is not None:
        config[PLAN_KEY] = plan_json(plan)
    if spec.shard is not None and plan is not None:
        config["shard"] = shard_config(spec.shard, shard_assignment(spec, plan))
        planned = in_shard(spec, planned, plan)
    localizes = registry.info(backend.name).localizes and isinstance(backend, CanLocalize)
    if localizes:
        config["localize_threshold"] = spec.localize_threshold or auto_threshold(str(config.get("dtype")))
    run = _run_result(spec, backend, planned, collected, config, stop is not None, clock.timings(backend))
    if stop is not None:
        raise RunInterrupted(run, signal_of(stop))
    if not localizes:
        return run  # nothing to probe: the report says so on every case that would need it
    started = time.perf_counter()
    try:
        localized = localize_run(run, backend, {c.id: tuple(r.request for r in c.requests) for c in planned},
                                 config["localize_threshold"], warn=warn)
    except KeyboardInterrupt as stop:  # the judged run stands; only its localizations are missing
        raise RunInterrupted(run, signal_of(stop)) from None
    return replace(localized, timings=clock.timings(backend, time.perf_counter() - started))


def _run_plan(spec: RunSpec, backend: Backend, progress: ProgressFn | None, clock: _Clock):
    """(every planned case, the plan's entries (None when stopped before the prompts were measured),
    the arms that finished, the stop (Ctrl-C or SIGTERM) that ended it early or None); with a shard,
    only the shard's cases are run."""
    planned = plan_cases(spec, backend)
    collected = _Collected()
    plan = None
    try:
        # Every shard captures for, and checks, the whole plan: its runner is the unsharded run's.
        lengths = check_lengths(spec, backend, planned)
        plan = tuple(plan_entry(case, lengths[case.id]) for case in planned)
        selected = in_shard(spec, planned, plan)
        total = sum(generations(spec, case) for case in selected)
        counter = iter(range(1, total + 1))

        def announce(case_id: str, label: str) -> None:
            if progress:
                progress(Progress(next(counter), total, case_id, label))

        # A request planned past every bucket (growth) must not have one captured for it.
        backend.prepare(spec.modes, replayed_lengths(planned, lengths),
                        sorted({req.request.serving for case in planned for req in case.requests}, key=repr))
        for mode in spec.modes:
            started = time.perf_counter()
            _run_mode(spec, backend, selected, mode, collected, announce)
            clock.modes[mode] = time.perf_counter() - started
    except KeyboardInterrupt as stop:
        return planned, plan, collected, stop
    return planned, plan, collected, None


def _run_mode(spec: RunSpec, backend: Backend, planned: Sequence[PlannedCase], mode: str, collected: _Collected,
              announce: Callable[[str, str], object]) -> None:
    try:
        with backend.session(mode) as session:
            for case in serving_order(planned):
                runner = _run_four_arm if case.scenario == FOUR_ARM else _run_sequence
                runner(spec, session, case, mode, collected, announce)
    except ArmFailure as failure:  # the mode never came up, or died mid-run
        for case in planned:
            for i, req in enumerate(case.requests):
                for name in arms_for(case, mode, req):
                    collected.arms.setdefault((case.id, i, name), failed_arm(name, failure))


def _run_four_arm(spec: RunSpec, session: Session, case: PlannedCase, mode: str, collected: _Collected,
                  announce: Callable[[str, str], object]) -> None:
    req = case.requests[0]
    for name in arms_for(case, mode, req):
        announce(case.id, name)
        run = ArmRun(name, req)
        collected.arms[(case.id, 0, name)] = run.scored(session, _references(case, 0, name, collected))
        for _ in range(spec.repeat - 1):
            collected.arms[(case.id, 0, name)] = run.repeated(session)


def _run_sequence(spec: RunSpec, session: Session, case: PlannedCase, mode: str, collected: _Collected,
                  announce: Callable[[str, str], object]) -> None:
    """The sequence's requests back to back, as a server would see them; then (eager session) its
    power arm; then the scoring of every answer. Each repeat is the whole sequence again."""
    runs = [ArmRun(arm_for(mode, req.deepstack).name, req) for req in case.requests]
    groups = [[runs[i] for i in group] for group in forwards(case.requests)]
    for group in groups:
        for run in group:
            announce(case.id, f"{run.name} · {run.request.label}")
        answer_together(group, session)
    power = [(i, ArmRun(SEQUENCE_POWER_ARM, req)) for i, req in enumerate(case.requests)
             if req.power and mode == "eager"]
    for i, run in power:
        announce(case.id, f"{run.name} · {run.request.label}")
        run.answer(session)
    # Scored in run order: each power arm's reference is its request's own eager answer, scored first.
    for i, run in [*enumerate(runs), *power]:
        collected.arms[(case.id, i, run.name)] = run.scored(session, _references(case, i, run.name, collected))
    for _ in range(spec.repeat - 1):
        for group in groups:
            answer_together(group, session, repeat=True)
        for i, run in power:
            run.repeated(session)
        for i, run in [*enumerate(runs), *power]:
            collected.arms[(case.id, i, run.name)] = run.result


def _references(case: PlannedCase, request: int, name: str, collected: _Collected) -> list[ArmResult]:
    """The finished, successful references this arm is compared against (teacher forcing)."""
    if case.scenario == FOUR_ARM:
        names = [c.b for c in FOUR_ARM_CHECKS if c.a == name]
    elif case.requests[request].power and name == SEQUENCE_POWER_ARM:
        names = [POWER_CHECK.b]
    else:
        known = arm(name)
        names = [arm_for(Mode.EAGER, known.deepstack).name] if known.mode is Mode.BCG else []
    refs = [collected.get(case.id, request, n) for n in names]
    return [r for r in refs if r is not None and not r.failed]


# --- into results ----------------------------------------------------------------------------------

def _fixture_info(fixture: Fixture | None) -> FixtureInfo | None:
    return None if fixture is None else FixtureInfo(fixture.name, fixture.sha256, fixture.size, len(fixture.frames))


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
                      arms_of(i, [arm_for(m, req.deepstack).name for m in MODES] + [SEQUENCE_POWER_ARM] * req.power),
                      req.deepstack)
        for i, req in enumerate(case.requests)
    )
    return CaseResult(case.id, info, case.spec.prompt.text, requests=requests, scenario=case.scenario)


def _run_result(spec, backend, planned, collected, config, interrupted, timings: Timings) -> RunResult:
    dtype = str(config.get("dtype", "float32"))
    # A user's --logprob-tol is one flat bound on every step; auto follows the dtype's measured noise.
    auto = auto_tolerances(dtype)
    tol = Tolerances(spec.logprob_tol) if spec.logprob_tol is not None else auto
    tie_margin = auto.tie_margin if spec.tie_margin is None else spec.tie_margin
    run = RunResult(
        created=datetime.now(timezone.utc).isoformat(timespec="seconds"),
        environment=_environment(backend),
        config={
            "model": spec.model, "backend": backend.name, "max_new_tokens": spec.max_new_tokens,
            "logprob_tol": tol.logprob_tol, "logprob_mean_tol": tol.mean_tol,
            "logprob_tol_source": "user" if spec.logprob_tol is not None else "auto",
            "tie_margin": tie_margin, "tie_margin_source": "auto" if spec.tie_margin is None else "user",
            "scenarios": list(spec.scenarios), "repeat": spec.repeat,
            "arms": [a.name for a in spec.arms], **config,
        },
        cases=tuple(_case_result(case, collected) for case in planned),
        interrupted=interrupted,
        timings=timings,
    )
    return judge_run(self_checked(run))


def _environment(backend: Backend) -> dict:
    def version(name: str) -> str | None:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            return None

    return {
        "parity": __version__, SOURCE_KEY: source_identity(), "python": platform.python_version(),
        "torch": version("torch"),
        "transformers": version("transformers"),
        **{b.package: version(b.package) for b in registry.BACKENDS.values() if b.version_in_every_run},
        **backend.environment(),
    }
