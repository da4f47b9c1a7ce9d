"""Reading a results file back (`parity.results/2`, and `/1` as written by parity 0.1).

The loader validates meaning, not only types: arm names are the known four and agree with their
`mode` and `deepstack`, numbers are finite, case ids are unique, evidence is consistent. Anything
else is a `ResultsFileError` naming the file and the place, never a traceback. Stored comparisons
and verdicts are dropped: `verdict.judge_run` recomputes them from the arms.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from types import MappingProxyType
from typing import Any

from parity.arms import ARM_ORDER, arm_mode_and_deepstack
from parity.errors import ResultsFileError
from parity.evidence import DeepStackRecord, Evidence, LeakWitness
from parity.metrics import NOISE_FLOOR
from parity.verdict import SEQUENCE_POWER_ARM
from parity.results import (
    FOUR_ARM, REUSE, SCENARIOS, SCHEMA, SCHEMA_V1, SEQUENCE_SCENARIOS, ArmResult, CaseResult, FixtureInfo, LayerError,
    Localization, Repeat, RequestResult, RunResult, TopLogprobs,
)

V2_MIN_LOGPROB_TOL = 1e-6  # what files written before v3 may hold
MIN_LOGPROB_TOL = NOISE_FLOOR  # a smaller tolerance cannot be met by a correct run on every CPU
# A results file is a few hundred KB; anything far larger is not one, and reading it is a hang.
MAX_FILE_BYTES = 256 * 1024 * 1024


class _Invalid(Exception):
    """A problem in the document, reported with the JSON path where it was found."""


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
    kinds = kind if isinstance(kind, tuple) else (kind,)
    # bool is an int in Python; a JSON true where a number belongs is still an error.
    if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
        raise _Invalid(f"{where}.{key} must be {'/'.join(k.__name__ for k in kinds)}, got {type(value).__name__}")
    return value


def _number(value: Any, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise _Invalid(f"{where} must be a number")
    if not math.isfinite(value):
        raise _Invalid(f"{where} is {value}: numbers in a results file must be finite")
    return float(value)


def _int(value: Any, where: str, minimum: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise _Invalid(f"{where} must be an integer")
    if minimum is not None and value < minimum:
        raise _Invalid(f"{where} must be >= {minimum}, got {value}")
    return value


def _ints(values: Any, where: str) -> tuple[int, ...]:
    if not isinstance(values, list):
        raise _Invalid(f"{where} must be a list of integers")
    return tuple(_int(v, f"{where}[{i}]") for i, v in enumerate(values))


def _floats(values: Any, where: str) -> tuple[float, ...]:
    if not isinstance(values, list):
        raise _Invalid(f"{where} must be a list of numbers")
    return tuple(_number(v, f"{where}[{i}]") for i, v in enumerate(values))


def _top(raw: Any, where: str) -> TopLogprobs | None:
    if raw is None:
        return None
    if not isinstance(raw, list):
        raise _Invalid(f"{where} must be a list of [[token_id, logprob], ...] per step")
    steps = []
    for i, step in enumerate(raw):
        if not isinstance(step, list) or not all(isinstance(p, list) and len(p) == 2 for p in step):
            raise _Invalid(f"{where}[{i}] must be a list of [token_id, logprob] pairs")
        steps.append(tuple((_int(t, f"{where}[{i}]"), _number(lp, f"{where}[{i}]")) for t, lp in step))
    return tuple(steps)


def _record(raw: Any, where: str) -> DeepStackRecord | None:
    if raw is None:
        return None
    try:
        record = DeepStackRecord.from_json(raw)
    except (KeyError, TypeError, ValueError, AttributeError):
        raise _Invalid(f"{where} is malformed") from None
    if not math.isfinite(record.l2_norm) or record.nonzero_rows < 0:
        raise _Invalid(f"{where} has a non-finite norm or a negative row count")
    return record


def _evidence(raw: Any, where: str) -> Evidence:
    replayed = _get(raw, "prefill_replayed", bool, where, optional=True)
    evidence = Evidence(
        lm_calls=_int(_get(raw, "lm_calls", int, where), f"{where}.lm_calls", 0),
        replayed_calls=_int(_get(raw, "replayed_calls", int, where), f"{where}.replayed_calls", 0),
        prefill_replayed=replayed,
        buckets=_ints(_get(raw, "buckets", list, where), f"{where}.buckets"),
        tap_calls=_int(_get(raw, "tap_calls", int, where), f"{where}.tap_calls", 0),
        prompt_tokens=_get(raw, "prompt_tokens", int, where, optional=True),
        max_bucket=_get(raw, "max_bucket", int, where, optional=True),
        leak=_leak(raw.get("leak"), f"{where}.leak"),
    )
    problem = evidence.inconsistency()
    if problem:
        raise _Invalid(f"{where} is inconsistent: {problem}")
    return evidence


def _leak(raw: Any, where: str) -> LeakWitness | None:
    # Optional: only engines with a leak witness (vLLM) write it, and only when it fired.
    if raw is None:
        return None
    source = _get(raw, "source_sha256", str, where, optional=True)
    return LeakWitness(_int(_get(raw, "rows", int, where), f"{where}.rows", 1),
                       _int(_get(raw, "steps", int, where), f"{where}.steps", 1), source)


def _forced(raw: Any, where: str) -> dict[str, tuple[float, ...]]:
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise _Invalid(f"{where} must be an object of reference arm -> logprobs")
    for name in raw:
        if name not in ARM_ORDER:
            raise _Invalid(f"{where} names unknown reference arm {name!r}")
    return {name: _floats(lps, f"{where}.{name}") for name, lps in raw.items()}


def _arm(name: str, raw: Any, where: str, v2: bool) -> ArmResult:
    if name not in ARM_ORDER:
        raise _Invalid(f"{where}: unknown arm {name!r}; known arms: {', '.join(ARM_ORDER)}")
    mode = _get(raw, "mode", str, where)
    deepstack = _get(raw, "deepstack", str, where)
    if (mode, deepstack) != arm_mode_and_deepstack(name):
        expected = arm_mode_and_deepstack(name)
        raise _Invalid(f"{where} has mode {mode!r} / deepstack {deepstack!r}, but arm {name} is "
                       f"{expected[0]!r} / {expected[1]!r}")
    error = _get(raw, "error", str, where, optional=True)
    token_ids = _ints(_get(raw, "token_ids", list, where), f"{where}.token_ids")
    logprobs = _floats(_get(raw, "token_logprobs", list, where), f"{where}.token_logprobs")
    top = _top(raw.get("top_logprobs"), f"{where}.top_logprobs")
    if error is None and len(token_ids) != len(logprobs):
        raise _Invalid(f"{where} has {len(token_ids)} token_ids but {len(logprobs)} token_logprobs")
    if error is None and top is not None and len(top) != len(token_ids):
        raise _Invalid(f"{where} has {len(token_ids)} token_ids but {len(top)} top_logprobs steps")
    evidence_raw = raw.get("evidence")
    if v2 and error is None and evidence_raw is None:
        raise _Invalid(f"{where} lacks 'evidence': a /2 arm that ran must say how it was executed")
    repeats = []
    for i, rep in enumerate(_get(raw, "repeats", list, where, optional=True) or []):
        rwhere = f"{where}.repeats[{i}]"
        rep_evidence = rep.get("evidence") if isinstance(rep, dict) else None
        repeats.append(Repeat(_ints(_get(rep, "token_ids", list, rwhere), f"{rwhere}.token_ids"),
                              _floats(_get(rep, "token_logprobs", list, rwhere), f"{rwhere}.token_logprobs"),
                              None if rep_evidence is None else _evidence(rep_evidence, f"{rwhere}.evidence")))
    seconds = {key: _number(_get(raw, key, (int, float), where, optional=True) or 0.0, f"{where}.{key}")
               for key in ("seconds", "forced_seconds")}
    return ArmResult(
        name=name, mode=mode, deepstack=deepstack, token_ids=token_ids,
        text=_get(raw, "text", str, where), token_logprobs=logprobs, top_logprobs=top,
        deepstack_record=_record(raw.get("deepstack_record"), f"{where}.deepstack_record"),
        evidence=None if evidence_raw is None else _evidence(evidence_raw, f"{where}.evidence"),
        forced=MappingProxyType(_forced(raw.get("forced"), f"{where}.forced")) if v2 else MappingProxyType({}),
        error=error, seconds=seconds["seconds"], forced_seconds=seconds["forced_seconds"], repeats=tuple(repeats),
    )


def _arms(raw: Any, where: str, v2: bool) -> tuple[ArmResult, ...]:
    if not isinstance(raw, dict):
        raise _Invalid(f"{where} must be an object of arm name -> arm")
    arms = tuple(_arm(name, arm, f"{where}.{name}", v2) for name, arm in raw.items())
    by_name = {a.name: a for a in arms}
    for arm in arms:
        for ref, lps in arm.forced.items():
            reference = by_name.get(ref)
            if reference is None or reference.failed:
                raise _Invalid(f"{where}.{arm.name}.forced scores reference {ref}, which is not in the case")
            if len(lps) != len(reference.token_ids):
                raise _Invalid(f"{where}.{arm.name}.forced.{ref} has {len(lps)} scores for "
                               f"{len(reference.token_ids)} reference tokens")
    return arms


def _fixture(raw: Any, where: str) -> FixtureInfo | None:
    if raw is None:
        return None
    size = _get(raw, "size", list, where)
    if len(size) != 2:
        raise _Invalid(f"{where}.size must be [width, height]")
    width, height = _ints(size, f"{where}.size")
    return FixtureInfo(_get(raw, "name", str, where), _get(raw, "sha256", str, where), (width, height))


def _requests(raw: Any, where: str) -> tuple[RequestResult, ...]:
    if not isinstance(raw, list) or not raw:
        raise _Invalid(f"{where} must be a non-empty list of requests")
    requests = []
    for i, request in enumerate(raw):
        rwhere = f"{where}[{i}]"
        arms = _arms(_get(request, "arms", dict, rwhere), f"{rwhere}.arms", v2=True)
        # One DeepStack action in both modes; only the first request adds its eager power arm.
        graph_actions = {a.deepstack for a in arms if not (i == 0 and a.name == SEQUENCE_POWER_ARM)}
        if len(graph_actions) > 1:
            raise _Invalid(f"{rwhere}.arms mixes DeepStack actions; a request is one action in both modes")
        requests.append(RequestResult(
            label=_get(request, "label", str, rwhere),
            fixture=_fixture(request.get("fixture"), f"{rwhere}.fixture"),
            prompt=_get(request, "prompt", str, rwhere),
            arms=arms,
        ))
    return tuple(requests)


def _positive(value: Any, where: str) -> float:
    number = _number(value, where)
    if number <= 0:
        raise _Invalid(f"{where} must be > 0, got {number}")
    return number


def _localization(raw: Any, where: str, requests: tuple[RequestResult, ...]) -> Localization | None:
    """Design §7: a bcg arm against the eager arm of the same DeepStack action, per probe point."""
    if raw is None:
        return None
    arm, reference = _get(raw, "arm", str, where), _get(raw, "reference", str, where)
    for key, name, mode in (("arm", arm, "bcg"), ("reference", reference, "eager")):
        if name not in ARM_ORDER or arm_mode_and_deepstack(name)[0] != mode:
            raise _Invalid(f"{where}.{key} must be {'a bcg' if mode == 'bcg' else 'an eager'} arm, got {name!r}")
    if arm_mode_and_deepstack(arm)[1] != arm_mode_and_deepstack(reference)[1]:
        raise _Invalid(f"{where} compares {arm} with {reference}: a localization compares one DeepStack action")
    request = _get(raw, "request", int, where, optional=True)
    if (request is None) != (not requests) or (request is not None and not 0 <= request < len(requests)):
        raise _Invalid(f"{where}.request must be the index of one of the case's {len(requests)} requests "
                       "(null in a four-arm case)")
    threshold = _positive(_get(raw, "threshold", (int, float), where), f"{where}.threshold")
    points = []
    for i, point in enumerate(_get(raw, "points", list, where)):
        pwhere = f"{where}.points[{i}]"
        block = _get(point, "deepstack_block", int, pwhere, optional=True)
        error = _number(_get(point, "rel_error", (int, float), pwhere), f"{pwhere}.rel_error")
        if error < 0:
            raise _Invalid(f"{pwhere}.rel_error must be >= 0, got {error}")
        points.append(LayerError(_int(_get(point, "layer", int, pwhere), f"{pwhere}.layer", 0),
                                 None if block is None else _int(block, f"{pwhere}.deepstack_block", 0), error))
    if not points:
        raise _Invalid(f"{where}.points is empty")
    first = _get(raw, "first_divergent", int, where, optional=True)
    expected = next((i for i, p in enumerate(points) if p.rel_error > threshold), None)
    if first is not None and not 0 <= first < len(points):
        raise _Invalid(f"{where}.first_divergent {first} is not a point index (0..{len(points) - 1})")
    if first != expected:
        raise _Invalid(f"{where}.first_divergent is {first}, but the first point above the threshold is {expected}")
    return Localization(arm, reference, request, threshold, tuple(points), first)


def _case(raw: Any, where: str, v2: bool) -> CaseResult:
    scenario = _get(raw, "scenario", str, where, optional=True) or FOUR_ARM
    allowed = SCENARIOS if v2 else (FOUR_ARM, REUSE)
    if scenario not in allowed:
        raise _Invalid(f"{where}.scenario {scenario!r} is not one of {', '.join(allowed)}")
    prompt = _get(raw, "prompt", str, where)
    fixture = _fixture(raw.get("fixture") if v2 else _get(raw, "fixture", dict, where), f"{where}.fixture")
    arms: tuple[ArmResult, ...] = ()
    requests: tuple[RequestResult, ...] = ()
    if v2 and scenario in SEQUENCE_SCENARIOS:
        requests = _requests(_get(raw, "requests", list, where), f"{where}.requests")
    elif scenario == REUSE:
        # A /1 reuse case kept only the text-only follow-up; its image primer was never recorded.
        requests = (RequestResult("follow-up (text only)", None, prompt,
                                  _arms(_get(raw, "arms", dict, where), f"{where}.arms", v2)),)
    else:
        arms = _arms(_get(raw, "arms", dict, where), f"{where}.arms", v2)
    return CaseResult(
        id=_get(raw, "id", str, where), fixture=fixture, prompt=prompt, arms=arms, requests=requests,
        scenario=scenario, plot=_get(raw, "plot", str, where, optional=True),
        localization=_localization(raw.get("localization"), f"{where}.localization", requests),
        localization_plot=_get(raw, "localization_plot", str, where, optional=True),
    )


def _config(raw: Any, v2: bool) -> dict:
    config = dict(_get(raw, "config", dict, "document"))
    tol = _number(_get(config, "logprob_tol", (int, float), "config"), "config.logprob_tol")
    # Files written before v3 held tolerances down to 1e-6: read them as written.
    floor = V2_MIN_LOGPROB_TOL if v2 else 0.0
    if tol < floor:
        raise _Invalid(f"config.logprob_tol must be >= {floor:g}, got {tol}")
    if config.get("logprob_mean_tol") is not None:
        mean = _number(config["logprob_mean_tol"], "config.logprob_mean_tol")
        if mean < floor:
            raise _Invalid(f"config.logprob_mean_tol must be >= {floor:g}, got {mean}")
    if v2:
        margin = _number(_get(config, "tie_margin", (int, float), "config"), "config.tie_margin")
        if margin < 0:
            raise _Invalid(f"config.tie_margin must be >= 0, got {margin}")
        _int(_get(config, "deepstack_layers", int, "config"), "config.deepstack_layers", 0)
        if config.get("localize_threshold") is not None:
            _positive(config["localize_threshold"], "config.localize_threshold")
    else:  # the v1 rules: no ties, DeepStack use inferred from the records
        config.pop("tie_margin", None)
        config.pop("deepstack_layers", None)
    return config


def run_from_json(doc: Any, source: str) -> RunResult:
    """Parse and validate a results document; stored comparisons and verdicts are dropped."""
    schema = SCHEMA
    try:
        schema = _get(doc, "schema", str, "document")
        if schema not in (SCHEMA, SCHEMA_V1):
            raise _Invalid(f"schema is {schema!r}, expected {SCHEMA!r} or {SCHEMA_V1!r}")
        v2 = schema == SCHEMA
        cases_raw = _get(doc, "cases", list, "document")
        if not cases_raw:
            raise _Invalid("cases is empty")
        cases = tuple(_case(c, f"cases[{i}]", v2) for i, c in enumerate(cases_raw))
        seen: set[str] = set()
        for case in cases:
            if case.id in seen:
                raise _Invalid(f"case id {case.id!r} appears twice; case ids must be unique")
            seen.add(case.id)
        return RunResult(
            created=_get(doc, "created", str, "document"),
            environment=MappingProxyType(_get(doc, "environment", dict, "document")),
            config=MappingProxyType(_config(doc, v2)),
            cases=cases,
            schema=schema,
            interrupted=bool(_get(doc, "interrupted", bool, "document", optional=True)),
        )
    except _Invalid as err:
        shown = schema if schema in (SCHEMA, SCHEMA_V1) else SCHEMA
        raise ResultsFileError(source, f"not valid {shown}: {err}") from None


def load_results(path: str | Path) -> RunResult:
    shown = str(path)
    try:
        path = Path(path)
        if path.stat().st_size > MAX_FILE_BYTES:
            raise ResultsFileError(shown, f"is larger than {MAX_FILE_BYTES // 2**20} MiB; not a results file")
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ResultsFileError(shown, "no such file") from None
    except (OSError, UnicodeDecodeError, ValueError) as err:
        # A directory, no permission, a name too long, a path under a file, bytes that are not UTF-8.
        reason = getattr(err, "strerror", None) or err.__class__.__name__
        raise ResultsFileError(shown, f"cannot be read ({reason})") from None
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as err:
        raise ResultsFileError(shown, f"not JSON ({err.msg} at line {err.lineno})") from None
    except RecursionError:
        raise ResultsFileError(shown, "not a results file (JSON nested too deeply)") from None
    return run_from_json(doc, shown)
