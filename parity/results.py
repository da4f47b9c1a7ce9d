"""The results file `parity.results/1` (design §4): frozen dataclasses and their JSON boundary.

Every report is rendered from a `RunResult`; loading validates the whole document and names the
file and what is wrong, so a bad file is a usage error, never a traceback.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any, Mapping

from parity.errors import ResultsFileError
from parity.tap import DeepStackRecord

SCHEMA = "parity.results/1"
SCENARIOS = ("four-arm", "reuse")

TopLogprobs = tuple[tuple[tuple[int, float], ...], ...]


@dataclass(frozen=True)
class Repeat:
    """One extra run of an arm under `--repeat`, kept to measure the arm's own noise."""

    token_ids: tuple[int, ...]
    token_logprobs: tuple[float, ...]


@dataclass(frozen=True)
class ArmResult:
    name: str
    mode: str
    deepstack: str
    token_ids: tuple[int, ...] = ()
    text: str = ""
    token_logprobs: tuple[float, ...] = ()
    top_logprobs: TopLogprobs | None = None
    deepstack_record: DeepStackRecord | None = None
    error: str | None = None
    seconds: float = 0.0
    repeats: tuple[Repeat, ...] = ()

    @property
    def failed(self) -> bool:
        return self.error is not None


@dataclass(frozen=True)
class Comparison:
    a: str
    b: str
    divergence_char: int
    token_match: bool
    first_token_divergence: int | None
    logprob_delta: float
    match: bool

    @property
    def tuple_text(self) -> str:
        return f"({self.divergence_char}, {self.token_match}, {self.logprob_delta:.3f})"


@dataclass(frozen=True)
class Verdict:
    code: str
    reason: str


@dataclass(frozen=True)
class FixtureInfo:
    name: str
    sha256: str
    size: tuple[int, int]


@dataclass(frozen=True)
class CaseResult:
    id: str
    fixture: FixtureInfo
    prompt: str
    arms: tuple[ArmResult, ...]
    comparisons: tuple[Comparison, ...] = ()
    verdict: Verdict | None = None
    scenario: str = "four-arm"
    # For a reuse case: what ran on the same model/server just before the checked request.
    primer: str | None = None
    plot: str | None = None

    def arm(self, name: str) -> ArmResult | None:
        return next((a for a in self.arms if a.name == name), None)

    def comparison(self, a: str, b: str) -> Comparison | None:
        return next((c for c in self.comparisons if (c.a, c.b) == (a, b)), None)


@dataclass(frozen=True)
class RunResult:
    created: str
    environment: Mapping[str, Any]
    config: Mapping[str, Any]
    cases: tuple[CaseResult, ...]
    verdict: Verdict | None = None
    schema: str = field(default=SCHEMA)

    @property
    def logprob_tol(self) -> float:
        return float(self.config["logprob_tol"])


# --- to JSON -------------------------------------------------------------------------------------

def arm_to_json(arm: ArmResult) -> dict:
    out = {
        "mode": arm.mode,
        "deepstack": arm.deepstack,
        "token_ids": list(arm.token_ids),
        "text": arm.text,
        "token_logprobs": list(arm.token_logprobs),
        "top_logprobs": None if arm.top_logprobs is None
        else [[[tid, lp] for tid, lp in step] for step in arm.top_logprobs],
        "deepstack_record": arm.deepstack_record.to_json() if arm.deepstack_record else None,
        "error": arm.error,
        "seconds": arm.seconds,
    }
    if arm.repeats:
        out["repeats"] = [{"token_ids": list(r.token_ids), "token_logprobs": list(r.token_logprobs)}
                          for r in arm.repeats]
    return out


def comparison_to_json(c: Comparison) -> dict:
    return {"a": c.a, "b": c.b, "divergence_char": c.divergence_char, "token_match": c.token_match,
            "first_token_divergence": c.first_token_divergence, "logprob_delta": c.logprob_delta,
            "match": c.match}


def _verdict_json(v: Verdict | None) -> dict | None:
    return None if v is None else {"code": v.code, "reason": v.reason}


def case_to_json(case: CaseResult) -> dict:
    out = {
        "id": case.id,
        "scenario": case.scenario,
        "fixture": {"name": case.fixture.name, "sha256": case.fixture.sha256, "size": list(case.fixture.size)},
        "prompt": case.prompt,
        "arms": {arm.name: arm_to_json(arm) for arm in case.arms},
        "comparisons": [comparison_to_json(c) for c in case.comparisons],
        "verdict": _verdict_json(case.verdict),
    }
    if case.primer is not None:
        out["primer"] = case.primer
    if case.plot is not None:
        out["plot"] = case.plot
    return out


def run_to_json(run: RunResult) -> dict:
    return {
        "schema": run.schema,
        "created": run.created,
        "environment": dict(run.environment),
        "config": dict(run.config),
        "cases": [case_to_json(c) for c in run.cases],
        "verdict": _verdict_json(run.verdict),
    }


def write_results(run: RunResult, path: Path) -> None:
    path.write_text(json.dumps(run_to_json(run), indent=2, ensure_ascii=False) + "\n")


# --- from JSON, validated --------------------------------------------------------------------------

class _Invalid(Exception):
    """A structural problem, reported with the JSON path where it was found."""


def _get(obj: Any, key: str, kind: type | tuple[type, ...], where: str, optional: bool = False) -> Any:
    if not isinstance(obj, dict):
        raise _Invalid(f"{where} must be an object")
    if key not in obj:
        if optional:
            return None
        raise _Invalid(f"{where} lacks {key!r}")
    value = obj[key]
    if optional and value is None:
        return None
    # bool is an int in Python; a JSON true where a number belongs is still an error.
    if not isinstance(value, kind) or (isinstance(value, bool) and bool not in _as_tuple(kind)):
        names = "/".join(k.__name__ for k in _as_tuple(kind))
        raise _Invalid(f"{where}.{key} must be {names}, got {type(value).__name__}")
    return value


def _as_tuple(kind: type | tuple[type, ...]) -> tuple[type, ...]:
    return kind if isinstance(kind, tuple) else (kind,)


def _ints(values: Any, where: str) -> tuple[int, ...]:
    if not isinstance(values, list) or not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
        raise _Invalid(f"{where} must be a list of integers")
    return tuple(values)


def _floats(values: Any, where: str) -> tuple[float, ...]:
    if not isinstance(values, list) or not all(
        isinstance(v, (int, float)) and not isinstance(v, bool) for v in values
    ):
        raise _Invalid(f"{where} must be a list of numbers")
    return tuple(float(v) for v in values)


def _top(raw: Any, where: str) -> TopLogprobs | None:
    if raw is None:
        return None
    try:
        return tuple(tuple((int(tid), float(lp)) for tid, lp in step) for step in raw)
    except (TypeError, ValueError):
        raise _Invalid(f"{where} must be a list of [[token_id, logprob], ...] per step") from None


def _arm(name: str, raw: Any, where: str) -> ArmResult:
    mode = _get(raw, "mode", str, where)
    deepstack = _get(raw, "deepstack", str, where)
    if mode not in ("eager", "bcg") or deepstack not in ("normal", "zero"):
        raise _Invalid(f"{where} has mode {mode!r} / deepstack {deepstack!r}; expected eager|bcg / normal|zero")
    error = _get(raw, "error", str, where, optional=True)
    token_ids = _ints(_get(raw, "token_ids", list, where), f"{where}.token_ids")
    logprobs = _floats(_get(raw, "token_logprobs", list, where), f"{where}.token_logprobs")
    if error is None and len(token_ids) != len(logprobs):
        raise _Invalid(f"{where} has {len(token_ids)} token_ids but {len(logprobs)} token_logprobs")
    record = _get(raw, "deepstack_record", dict, where, optional=True)
    try:
        record = DeepStackRecord.from_json(record) if record is not None else None
    except (KeyError, TypeError, ValueError):
        raise _Invalid(f"{where}.deepstack_record is malformed") from None
    repeats = []
    for i, rep in enumerate(_get(raw, "repeats", list, where, optional=True) or []):
        rwhere = f"{where}.repeats[{i}]"
        repeats.append(Repeat(_ints(_get(rep, "token_ids", list, rwhere), f"{rwhere}.token_ids"),
                              _floats(_get(rep, "token_logprobs", list, rwhere), f"{rwhere}.token_logprobs")))
    return ArmResult(
        name=name, mode=mode, deepstack=deepstack, token_ids=token_ids,
        text=_get(raw, "text", str, where), token_logprobs=logprobs,
        top_logprobs=_top(raw.get("top_logprobs"), f"{where}.top_logprobs"),
        deepstack_record=record, error=error,
        seconds=float(_get(raw, "seconds", (int, float), where, optional=True) or 0.0),
        repeats=tuple(repeats),
    )


def _case(raw: Any, where: str) -> CaseResult:
    fixture = _get(raw, "fixture", dict, where)
    size = _get(fixture, "size", list, f"{where}.fixture")
    if len(size) != 2:
        raise _Invalid(f"{where}.fixture.size must be [width, height]")
    scenario = _get(raw, "scenario", str, where, optional=True) or "four-arm"
    if scenario not in SCENARIOS:
        raise _Invalid(f"{where}.scenario {scenario!r} is not one of {', '.join(SCENARIOS)}")
    arms = _get(raw, "arms", dict, where)
    return CaseResult(
        id=_get(raw, "id", str, where),
        fixture=FixtureInfo(_get(fixture, "name", str, f"{where}.fixture"),
                            _get(fixture, "sha256", str, f"{where}.fixture"),
                            tuple(_ints(size, f"{where}.fixture.size"))),
        prompt=_get(raw, "prompt", str, where),
        arms=tuple(_arm(name, arm, f"{where}.arms.{name}") for name, arm in arms.items()),
        scenario=scenario,
        primer=_get(raw, "primer", str, where, optional=True),
        plot=_get(raw, "plot", str, where, optional=True),
    )


def run_from_json(doc: Any, source: str) -> RunResult:
    """Parse a results document; stored comparisons and verdicts are dropped (recompute them)."""
    try:
        schema = _get(doc, "schema", str, "document")
        if schema != SCHEMA:
            raise _Invalid(f"schema is {schema!r}, expected {SCHEMA!r}")
        config = _get(doc, "config", dict, "document")
        tol = _get(config, "logprob_tol", (int, float), "config")
        if tol < 0:
            raise _Invalid(f"config.logprob_tol must be >= 0, got {tol}")
        cases = _get(doc, "cases", list, "document")
        if not cases:
            raise _Invalid("cases is empty")
        return RunResult(
            created=_get(doc, "created", str, "document"),
            environment=MappingProxyType(_get(doc, "environment", dict, "document")),
            config=MappingProxyType(config),
            cases=tuple(_case(c, f"cases[{i}]") for i, c in enumerate(cases)),
        )
    except _Invalid as err:
        raise ResultsFileError(source, f"not valid {SCHEMA}: {err}") from None


def load_results(path: str | Path) -> RunResult:
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ResultsFileError(str(path), "no such file") from None
    except (IsADirectoryError, PermissionError, UnicodeDecodeError) as err:
        raise ResultsFileError(str(path), f"cannot be read ({err.__class__.__name__})") from None
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as err:
        raise ResultsFileError(str(path), f"not JSON ({err.msg} at line {err.lineno})") from None
    return run_from_json(doc, str(path))
