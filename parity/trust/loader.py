"""Reading a results file back (`parity.results/2`, and `/1` as written by parity 0.1).

The loader validates meaning, not only types: arm names are the known four and agree with their
`mode` and `deepstack`, numbers are finite and in range, case ids are unique, a sequence case holds
its scenario's requests, and the file does not contradict itself (`results_consistency`). Anything
else is a `ResultsFileError` naming the file and the place, never a traceback. Stored comparisons
and verdicts are dropped: `verdict.judge_run` recomputes them from the arms.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from types import MappingProxyType
from typing import Any

from parity.arms import ARM_ORDER
from parity.arms import arm as arm_of
from parity.errors import ResultsFileError
from parity.plan.entries import PlanEntry, read_plan
from parity.results import (
    FOUR_ARM, REUSE, SCENARIOS, SCHEMA, SCHEMA_V1, SEQUENCE_REQUESTS, SEQUENCE_SCENARIOS, ArmResult, CaseResult,
    TIMING_KEYS, LayerError, Localization, RequestResult, RunResult, Timings,
)
from parity.trust.arms import read_arms, read_fixture
from parity.trust.before_run import BEFORE_RUN_KEY, read_before_run
from parity.trust.config import MIN_LOGPROB_TOL, config_from_json  # noqa: F401 (the CLI's floor too)
from parity.trust.consistency import Contradiction
from parity.trust.fields import Invalid, get, non_negative_int, number, parse_unique_keys, positive
from parity.trust.plan_check import planned_but_absent
from parity.trust.requirements import check_all
from parity.trust.sequences import completed, read_requests
from parity.results import signing
from parity.textfiles import NotAFile, TooLarge, described, read_text_capped

# A run's file is tens of KB per case; a merged sweep of 5,000 cases at 64 new tokens is a few hundred
# MB (scripts/bench_merge_scale.py). Anything larger is not a results file, and reading it is a hang.
MAX_FILE_BYTES = 1024 * 1024 * 1024


def read_timings(raw: Any) -> Timings | None:
    """Where the run's time went: informative only (no rule reads it), but a closed set of
    non-negative numbers like every other field."""
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise Invalid("timings must be an object")
    unknown = sorted(set(raw) - set(TIMING_KEYS))
    if unknown:
        raise Invalid(f"timings.{unknown[0]} is not a timing parity records ({', '.join(TIMING_KEYS)})")
    values = {}
    for key in TIMING_KEYS:
        value = raw.get(key)
        if value is not None and number(value, f"timings.{key}") < 0:
            raise Invalid(f"timings.{key} must be >= 0, got {value}")
        values[key] = None if value is None else float(value)
    return Timings(**values)


def _localization(raw: Any, where: str, n_requests: int) -> Localization | None:
    """design §7: a bcg arm against the eager arm of the same DeepStack action, per probe point;
    `request` is the request's place in its scenario (0 in a four-arm case is null)."""
    if raw is None:
        return None
    arm, reference = get(raw, "arm", str, where), get(raw, "reference", str, where)
    for key, name, mode in (("arm", arm, "bcg"), ("reference", reference, "eager")):
        if name not in ARM_ORDER or arm_of(name).mode != mode:
            raise Invalid(f"{where}.{key} must be {'a bcg' if mode == 'bcg' else 'an eager'} arm, got {name!r}")
    if arm_of(arm).deepstack != arm_of(reference).deepstack:
        raise Invalid(f"{where} compares {arm} with {reference}: a localization compares one DeepStack action")
    request = get(raw, "request", int, where, optional=True)
    if (request is None) != (not n_requests) or (request is not None and not 0 <= request < n_requests):
        raise Invalid(f"{where}.request must be the index of one of the case's {n_requests} requests "
                      "(null in a four-arm case)")
    threshold = positive(get(raw, "threshold", (int, float), where), f"{where}.threshold")
    points = []
    for i, point in enumerate(get(raw, "points", list, where)):
        pwhere = f"{where}.points[{i}]"
        block = get(point, "deepstack_block", int, pwhere, optional=True)
        error = number(get(point, "rel_error", (int, float), pwhere), f"{pwhere}.rel_error")
        if error < 0:
            raise Invalid(f"{pwhere}.rel_error must be >= 0, got {error}")
        points.append(LayerError(non_negative_int(get(point, "layer", int, pwhere), f"{pwhere}.layer"),
                                 None if block is None else non_negative_int(block, f"{pwhere}.deepstack_block"),
                                 error))
    if not points:
        raise Invalid(f"{where}.points is empty")
    first = get(raw, "first_divergent", int, where, optional=True)
    expected = next((i for i, p in enumerate(points) if p.rel_error > threshold), None)
    if first is not None and not 0 <= first < len(points):
        raise Invalid(f"{where}.first_divergent {first} is not a point index (0..{len(points) - 1})")
    if first != expected:
        raise Invalid(f"{where}.first_divergent is {first}, but the first point above the threshold is {expected}")
    return Localization(arm, reference, request, threshold, tuple(points), first)


def _case(raw: Any, where: str, v2: bool) -> CaseResult:
    case_id = get(raw, "id", str, where)
    if not case_id.strip():
        raise Invalid(f"{where}.id is empty; a case needs an id to be reported and selected")
    scenario = get(raw, "scenario", str, where, optional=True) or FOUR_ARM
    allowed = SCENARIOS if v2 else (FOUR_ARM, REUSE)
    if scenario not in allowed:
        raise Invalid(f"{where}.scenario {scenario!r} is not one of {', '.join(allowed)}")
    prompt = get(raw, "prompt", str, where)
    fixture = read_fixture(raw.get("fixture") if v2 else get(raw, "fixture", dict, where), f"{where}.fixture")
    arms: tuple[ArmResult, ...] = ()
    requests: tuple[RequestResult, ...] = ()
    if v2 and scenario in SEQUENCE_SCENARIOS:
        requests = read_requests(get(raw, "requests", list, where), f"{where}.requests", scenario, fixture, prompt)
    elif scenario == REUSE:
        # A /1 reuse case kept only the text-only follow-up; its image primer was never recorded.
        requests = (RequestResult("follow-up (text only)", None, prompt,
                                  read_arms(get(raw, "arms", dict, where), f"{where}.arms", v2)),)
    else:
        arms = read_arms(get(raw, "arms", dict, where), f"{where}.arms", v2)
    return CaseResult(
        id=case_id, fixture=fixture, prompt=prompt, arms=arms, requests=requests,
        scenario=scenario, plot=get(raw, "plot", str, where, optional=True),
        # A /2 sequence's localization names the request's place in the scenario, whatever the file holds.
        localization=_localization(raw.get("localization"), f"{where}.localization",
                                   len(SEQUENCE_REQUESTS[scenario]) if requests and v2 else len(requests)),
        localization_plot=get(raw, "localization_plot", str, where, optional=True),
    )


# Fields parity 0.1 never wrote: a /1 file that has one is a /2 file relabelled, which would switch
# the /2 rules off (design §4b).
_V2_ONLY_CONFIG = ("tie_margin", "tie_margin_source", "deepstack_layers", "logprob_mean_tol", "logprob_tol_source",
                   "plan", "shard",
                   "localize_threshold", "tp_size")
_V2_ONLY_CASE = ("requests", "localization", "localization_plot")
_V2_ONLY_ARM = ("evidence", "forced", "forced_seconds")


def _check_v1_fields(config: dict, cases: list) -> None:
    found = [f"config.{k}" for k in _V2_ONLY_CONFIG if k in config]
    for ci, case in enumerate(cases):
        if not isinstance(case, dict):
            continue
        found += [f"cases[{ci}].{k}" for k in _V2_ONLY_CASE if k in case]
        arms = case.get("arms")
        for name, arm in arms.items() if isinstance(arms, dict) else ():
            if not isinstance(arm, dict):
                continue
            found += [f"cases[{ci}].arms.{name}.{k}" for k in _V2_ONLY_ARM if k in arm]
            found += [f"cases[{ci}].arms.{name}.repeats[{i}].evidence" for i, r in enumerate(arm.get("repeats") or [])
                      if isinstance(r, dict) and "evidence" in r]
    if found:
        raise Invalid(f"{found[0]} is a {SCHEMA} field, which a {SCHEMA_V1} file never has: a relabelled file")


def _taken(items: list, i: int, consume: bool) -> Any:
    item = items[i]
    if consume:
        items[i] = None
    return item


def _absent(entry: PlanEntry) -> CaseResult:
    """A planned case the file does not hold: no arms, judged INCOMPLETE by name."""
    return CaseResult(entry.id, None, "", scenario=entry.scenario, absent=True)


def run_from_json(doc: Any, source: str, consume: bool = False) -> RunResult:
    """Parse and validate a results document; stored comparisons and verdicts are dropped.
    `consume`: each case's JSON is dropped from `doc` once read, so a large file's document and its
    run are never both whole in memory."""
    schema = SCHEMA
    try:
        schema = get(doc, "schema", str, "document")
        if schema not in (SCHEMA, SCHEMA_V1):
            raise Invalid(f"schema is {schema!r}, expected {SCHEMA!r} or {SCHEMA_V1!r}")
        v2 = schema == SCHEMA
        environment = get(doc, "environment", dict, "document")
        if v2 and BEFORE_RUN_KEY in doc:
            return read_before_run(doc, environment)
        raw_config = get(doc, "config", dict, "document")
        cases_raw = get(doc, "cases", list, "document")
        if not v2:
            _check_v1_fields(raw_config, cases_raw)
        config = config_from_json(raw_config, environment, v2)
        if not cases_raw:
            raise Invalid("cases is empty")
        cases = tuple(_case(_taken(cases_raw, i, consume), f"cases[{i}]", v2) for i in range(len(cases_raw)))
        seen: set[str] = set()
        for case in cases:
            if case.id in seen:
                raise Invalid(f"case id {case.id!r} appears twice; case ids must be unique")
            seen.add(case.id)
        absent = planned_but_absent(config, cases) if v2 else ()
        run = RunResult(
            created=get(doc, "created", str, "document"),
            environment=MappingProxyType(environment),
            config=MappingProxyType(config),
            cases=cases,
            schema=schema,
            interrupted=bool(get(doc, "interrupted", bool, "document", optional=True)),
            timings=read_timings(doc.get("timings")),
        )
        check_all(run)  # on the requests as the file holds them, so places name file indices
        if not v2:
            return run
        held = {c.id: completed(c) for c in cases}
        held.update((entry.id, completed(_absent(entry))) for entry in absent)
        return replace(run, cases=tuple(held[e.id] for e in read_plan(config) if e.id in held))
    except (Invalid, Contradiction) as err:
        shown = schema if schema in (SCHEMA, SCHEMA_V1) else SCHEMA
        raise ResultsFileError(source, f"not valid {shown}: {err}") from None


def load_results(path: str | Path, require_signed: bool = False) -> RunResult:
    """The file's run, validated; its signature verified whenever the environment holds a key
    (design §4d), and required under `require_signed`."""
    shown = str(path)
    key = signing.signing_key()  # a bad key is refused before the file is read
    try:
        text = read_text_capped(path, MAX_FILE_BYTES)
    except TooLarge as err:
        raise ResultsFileError(shown, f"{err}; not a results file") from None
    except NotAFile as err:
        raise ResultsFileError(shown, f"{err}; give a results.json") from None
    except FileNotFoundError:
        raise ResultsFileError(shown, "no such file") from None
    except OSError as err:
        # No permission, a name too long, a path under a file, a symbolic-link loop.
        raise ResultsFileError(shown, f"cannot be read ({described(err)})") from None
    except (UnicodeDecodeError, ValueError) as err:
        raise ResultsFileError(shown, f"cannot be read ({err.__class__.__name__})") from None
    try:
        doc = parse_unique_keys(text)
        del text  # a sweep's file is hundreds of MB: not held beside what is built from it
    except json.JSONDecodeError as err:
        raise ResultsFileError(shown, f"not JSON ({err.msg} at line {err.lineno})") from None
    except RecursionError:
        raise ResultsFileError(shown, "not a results file (JSON nested too deeply)") from None
    except ValueError as err:  # an integer literal of thousands of digits (Python's conversion limit)
        raise ResultsFileError(shown, f"not a results file ({err})") from None
    except Invalid as err:
        raise ResultsFileError(shown, f"not valid JSON for a results file: {err}") from None
    signing.check(doc, shown, require_signed, key)
    return run_from_json(doc, shown, consume=True)
