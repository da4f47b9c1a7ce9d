"""Reading a results file back (`parity.results/2`, and `/1` as written by parity 0.1).

The loader validates meaning, not only types: arm names are the known four and agree with their
`mode` and `deepstack`, numbers are finite and in range, case ids are unique, a sequence case holds
its scenario's requests, and the file does not contradict itself (`results_consistency`). Anything
else is a `ResultsFileError` naming the file and the place, never a traceback. Stored comparisons
and verdicts are dropped: `verdict.judge_run` recomputes them from the arms.
"""

from __future__ import annotations

import json
import re
from dataclasses import replace
from pathlib import Path
from types import MappingProxyType
from typing import Any

from parity.arms import ARM_ORDER, arm_mode_and_deepstack
from parity.errors import ResultsFileError
from parity.evidence import DeepStackRecord, Evidence, LeakWitness, RankEvidence
from parity.plan import PlanEntry, read_plan
from parity.textfiles import TooLarge, read_text_capped
from parity.verdict import SEQUENCE_POWER_ARM
from parity.results import (
    CASE_IMAGE, FOUR_ARM, REUSE, SCENARIOS, SCHEMA, SCHEMA_V1, SEQUENCE_REQUESTS, SEQUENCE_SCENARIOS, ArmResult,
    CaseResult, FixtureInfo, LayerError, Localization, Repeat, RequestResult, RequestSpec, RunResult, TopLogprobs,
)
from parity.results_config import MIN_LOGPROB_TOL, config_from_json  # noqa: F401 (the CLI's floor too)
from parity.results_consistency import Contradiction
from parity.results_plan import planned_but_absent
from parity.results_requirements import check_all
from parity.results_json import (
    MAX_COUNT, Invalid, get, ints, is_logprob, logprobs, non_negative_int, number, parse_unique_keys, positive,
    shared_int,
)

# A run's file is tens of KB per case; a merged sweep of 5,000 cases at 64 new tokens is a few hundred
# MB (scripts/bench_merge_scale.py). Anything larger is not a results file, and reading it is a hang.
MAX_FILE_BYTES = 1024 * 1024 * 1024
_SHA256 = re.compile(r"[0-9a-f]{64}")


def _top(raw: Any, where: str) -> TopLogprobs | None:
    if raw is None:
        return None
    if not isinstance(raw, list):
        raise Invalid(f"{where} must be a list of [[token_id, logprob], ...] per step")
    steps = []
    for i, step in enumerate(raw):
        if isinstance(step, list) and all(type(p) is list and len(p) == 2 and type(p[0]) is int
                                          and 0 <= p[0] <= MAX_COUNT and is_logprob(p[1]) for p in step):
            steps.append(tuple((shared_int(p[0], p[0]), float(p[1])) for p in step))  # every valid file
            continue
        if not isinstance(step, list) or not all(isinstance(p, list) and len(p) == 2 for p in step):
            raise Invalid(f"{where}[{i}] must be a list of [token_id, logprob] pairs")
        ids = ints([t for t, _ in step], f"{where}[{i}]")
        steps.append(tuple(zip(ids, logprobs([lp for _, lp in step], f"{where}[{i}]"))))
    return tuple(steps)


def _record(raw: Any, where: str) -> DeepStackRecord | None:
    if raw is None:
        return None
    shape = ints(get(raw, "shape", list, where), f"{where}.shape")
    rows = non_negative_int(get(raw, "nonzero_rows", int, where), f"{where}.nonzero_rows")
    if shape and rows > shape[0]:
        raise Invalid(f"{where}.nonzero_rows is {rows}, more than the {shape[0]} rows of its shape")
    sha = get(raw, "sha256", str, where)
    if not _SHA256.fullmatch(sha):
        raise Invalid(f"{where}.sha256 must be 64 lowercase hex digits")
    action = get(raw, "action", str, where)
    if action not in ("normal", "zero"):
        raise Invalid(f"{where}.action must be 'normal' or 'zero', got {action!r}")
    norm = number(get(raw, "l2_norm", (int, float), where), f"{where}.l2_norm")
    if norm < 0:
        raise Invalid(f"{where}.l2_norm must be >= 0, got {norm}")
    calls = get(raw, "calls", int, where, optional=True)
    return DeepStackRecord(
        shape=shape, dtype=get(raw, "dtype", str, where), nonzero_rows=rows, l2_norm=norm, sha256=sha,
        action=action, calls=1 if calls is None else non_negative_int(calls, f"{where}.calls"),
        replay=get(raw, "replay", bool, where, optional=True),
    )


def _evidence(raw: Any, where: str) -> Evidence:
    def count(key: str, optional: bool = False, minimum: int = 0) -> int | None:
        value = get(raw, key, int, where, optional=optional)
        return None if value is None else non_negative_int(value, f"{where}.{key}", minimum)

    evidence = Evidence(
        lm_calls=count("lm_calls"), replayed_calls=count("replayed_calls"),
        prefill_replayed=get(raw, "prefill_replayed", bool, where, optional=True),
        buckets=ints(get(raw, "buckets", list, where), f"{where}.buckets", minimum=1),
        tap_calls=count("tap_calls"), prompt_tokens=count("prompt_tokens", True, 1),
        max_bucket=count("max_bucket", True, 1), leak=_leak(raw.get("leak"), f"{where}.leak"),
        ranks=tuple(_rank(r, f"{where}.ranks[{i}]")
                    for i, r in enumerate(get(raw, "ranks", list, where, optional=True) or [])),
    )
    problem = evidence.inconsistency()
    if problem:
        raise Invalid(f"{where} is inconsistent: {problem}")
    return evidence


def _leak(raw: Any, where: str) -> LeakWitness | None:
    # Optional: only engines with a leak witness (vLLM) write it, and only when it fired.
    if raw is None:
        return None
    return LeakWitness(rows=non_negative_int(get(raw, "rows", int, where), f"{where}.rows", 1),
                       steps=non_negative_int(get(raw, "steps", int, where), f"{where}.steps", 1),
                       source_sha256=get(raw, "source_sha256", str, where, optional=True))
def _rank(raw: Any, where: str) -> RankEvidence:
    return RankEvidence(
        rank=get(raw, "rank", str, where),
        lm_calls=non_negative_int(get(raw, "lm_calls", int, where), f"{where}.lm_calls"),
        replayed_calls=non_negative_int(get(raw, "replayed_calls", int, where), f"{where}.replayed_calls"),
        prefill_replayed=get(raw, "prefill_replayed", bool, where, optional=True),
        buckets=ints(get(raw, "buckets", list, where), f"{where}.buckets", minimum=1),
        tap_calls=non_negative_int(get(raw, "tap_calls", int, where), f"{where}.tap_calls"),
        sha256=get(raw, "sha256", str, where, optional=True),
    )


def _forced(raw: Any, where: str) -> dict[str, tuple[float, ...]]:
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise Invalid(f"{where} must be an object of reference arm -> logprobs")
    for name in raw:
        if name not in ARM_ORDER:
            raise Invalid(f"{where} names unknown reference arm {name!r}")
    # null: the backend could not score exactly the reference's tokens (no tf delta then).
    return {name: None if lps is None else logprobs(lps, f"{where}.{name}") for name, lps in raw.items()}


def _arm(name: str, raw: Any, where: str, v2: bool) -> ArmResult:
    if name not in ARM_ORDER:
        raise Invalid(f"{where}: unknown arm {name!r}; known arms: {', '.join(ARM_ORDER)}")
    mode = get(raw, "mode", str, where)
    deepstack = get(raw, "deepstack", str, where)
    if (mode, deepstack) != arm_mode_and_deepstack(name):
        expected = arm_mode_and_deepstack(name)
        raise Invalid(f"{where} has mode {mode!r} / deepstack {deepstack!r}, but arm {name} is "
                      f"{expected[0]!r} / {expected[1]!r}")
    error = get(raw, "error", str, where, optional=True)
    token_ids = ints(get(raw, "token_ids", list, where), f"{where}.token_ids")
    lps = logprobs(get(raw, "token_logprobs", list, where), f"{where}.token_logprobs")
    top = _top(raw.get("top_logprobs"), f"{where}.top_logprobs")
    if error is None and len(token_ids) != len(lps):
        raise Invalid(f"{where} has {len(token_ids)} token_ids but {len(lps)} token_logprobs")
    if error is None and top is not None and len(top) != len(token_ids):
        raise Invalid(f"{where} has {len(token_ids)} token_ids but {len(top)} top_logprobs steps")
    evidence_raw = raw.get("evidence")
    if v2 and error is None and evidence_raw is None:
        raise Invalid(f"{where} lacks 'evidence': a /2 arm that ran must say how it was executed")
    repeats = []
    for i, rep in enumerate(get(raw, "repeats", list, where, optional=True) or []):
        rwhere = f"{where}.repeats[{i}]"
        rep_evidence = rep.get("evidence") if isinstance(rep, dict) else None
        repeats.append(Repeat(ints(get(rep, "token_ids", list, rwhere), f"{rwhere}.token_ids"),
                              logprobs(get(rep, "token_logprobs", list, rwhere), f"{rwhere}.token_logprobs"),
                              None if rep_evidence is None else _evidence(rep_evidence, f"{rwhere}.evidence")))
    seconds = {key: number(get(raw, key, (int, float), where, optional=True) or 0.0, f"{where}.{key}")
               for key in ("seconds", "forced_seconds")}
    return ArmResult(
        name=name, mode=mode, deepstack=deepstack, token_ids=token_ids,
        text=get(raw, "text", str, where), token_logprobs=lps, top_logprobs=top,
        deepstack_record=_record(raw.get("deepstack_record"), f"{where}.deepstack_record"),
        evidence=None if evidence_raw is None else _evidence(evidence_raw, f"{where}.evidence"),
        forced=MappingProxyType(_forced(raw.get("forced"), f"{where}.forced")) if v2 else MappingProxyType({}),
        error=error, seconds=seconds["seconds"], forced_seconds=seconds["forced_seconds"], repeats=tuple(repeats),
    )


def _arms(raw: Any, where: str, v2: bool) -> tuple[ArmResult, ...]:
    if not isinstance(raw, dict):
        raise Invalid(f"{where} must be an object of arm name -> arm")
    arms = tuple(_arm(name, arm, f"{where}.{name}", v2) for name, arm in raw.items())
    by_name = {a.name: a for a in arms}
    for arm in arms:
        for ref, lps in arm.forced.items():
            reference = by_name.get(ref)
            if reference is None or reference.failed:
                raise Invalid(f"{where}.{arm.name}.forced scores reference {ref}, which is not in the case")
            if lps is not None and len(lps) != len(reference.token_ids):
                raise Invalid(f"{where}.{arm.name}.forced.{ref} has {len(lps)} scores for "
                              f"{len(reference.token_ids)} reference tokens")
    return arms


def _fixture(raw: Any, where: str) -> FixtureInfo | None:
    if raw is None:
        return None
    size = get(raw, "size", list, where)
    if len(size) != 2:
        raise Invalid(f"{where}.size must be [width, height]")
    width, height = ints(size, f"{where}.size", minimum=1)
    return FixtureInfo(get(raw, "name", str, where), get(raw, "sha256", str, where), (width, height))


def _requests(raw: Any, where: str, scenario: str, fixture: FixtureInfo | None, prompt: str
              ) -> tuple[RequestResult, ...]:
    """The requests the file holds, in file order; each must be one of the scenario's, in its order."""
    if not isinstance(raw, list) or not raw:
        raise Invalid(f"{where} must be a non-empty list of requests")
    specs = SEQUENCE_REQUESTS[scenario]
    labels = [spec.label for spec in specs]
    requests, last = [], -1
    for i, request in enumerate(raw):
        rwhere = f"{where}[{i}]"
        label = get(request, "label", str, rwhere)
        if label not in labels:
            raise Invalid(f"{rwhere}.label {label!r} is not a request of the {scenario} scenario "
                          f"({', '.join(map(repr, labels))})")
        if labels.index(label) <= last:
            raise Invalid(f"{rwhere}.label {label!r} is repeated or out of order; a {scenario} case holds "
                          f"{', '.join(map(repr, labels))} in that order")
        last = labels.index(label)
        spec = specs[last]
        arms = _arms(get(request, "arms", dict, rwhere), f"{rwhere}.arms", v2=True)
        # One DeepStack action in both modes; a power request adds its eager zero-DeepStack arm.
        wrong = [a.name for a in arms if a.deepstack != spec.deepstack
                 and not (spec.power and a.name == SEQUENCE_POWER_ARM)]
        if wrong:
            raise Invalid(f"{rwhere}.arms has {', '.join(wrong)}, but the request {label!r} runs DeepStack "
                          f"{spec.deepstack!r} in both modes")
        result = RequestResult(label, _fixture(request.get("fixture"), f"{rwhere}.fixture"),
                               get(request, "prompt", str, rwhere), arms, spec.deepstack)
        if arms:  # an arm-less request (interrupted) is INCOMPLETE whatever it claims
            _check_request(result, spec, rwhere, fixture, prompt)
        requests.append(result)
    return tuple(requests)


def _check_request(request: RequestResult, spec: RequestSpec, where: str, fixture: FixtureInfo | None,
                   prompt: str) -> None:
    """The request is what its scenario sends: the case's image, its twin, or no image."""
    got = request.fixture
    if spec.image is None:
        if got is not None:
            raise Invalid(f"{where}.fixture is {got.name!r}, but {spec.label!r} is a text-only request")
        return
    if got is None:
        raise Invalid(f"{where}.fixture is null, but {spec.label!r} is an image request")
    if request.prompt != prompt:
        raise Invalid(f"{where}.prompt differs from the case's prompt, which {spec.label!r} sends")
    if fixture is None:
        return
    same = (got.sha256, got.size) == (fixture.sha256, fixture.size)
    if spec.image == CASE_IMAGE and not same:
        raise Invalid(f"{where}.fixture is not the case's image ({fixture.name}, sha256 {fixture.sha256[:12]}…), "
                      f"which {spec.label!r} sends")
    if spec.image != CASE_IMAGE and (same or got.size != fixture.size):
        raise Invalid(f"{where}.fixture must be the twin of the case's image (same size, other pixels)")


def _completed(case: CaseResult) -> CaseResult:
    """A /2 sequence case with every request of its scenario: one the file lacks has no arms, so
    the verdict counts it like an arm that was not run (INCOMPLETE)."""
    if not case.is_sequence:
        return case
    held = {r.label: r for r in case.requests}
    requests = tuple(held.get(spec.label) or RequestResult(
        spec.label, case.fixture if spec.image == CASE_IMAGE else None,
        case.prompt if spec.image is not None else "", (), spec.deepstack)
        for spec in SEQUENCE_REQUESTS[case.scenario])
    return replace(case, requests=requests)


def _localization(raw: Any, where: str, n_requests: int) -> Localization | None:
    """Design §7: a bcg arm against the eager arm of the same DeepStack action, per probe point;
    `request` is the request's place in its scenario (0 in a four-arm case is null)."""
    if raw is None:
        return None
    arm, reference = get(raw, "arm", str, where), get(raw, "reference", str, where)
    for key, name, mode in (("arm", arm, "bcg"), ("reference", reference, "eager")):
        if name not in ARM_ORDER or arm_mode_and_deepstack(name)[0] != mode:
            raise Invalid(f"{where}.{key} must be {'a bcg' if mode == 'bcg' else 'an eager'} arm, got {name!r}")
    if arm_mode_and_deepstack(arm)[1] != arm_mode_and_deepstack(reference)[1]:
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
    fixture = _fixture(raw.get("fixture") if v2 else get(raw, "fixture", dict, where), f"{where}.fixture")
    arms: tuple[ArmResult, ...] = ()
    requests: tuple[RequestResult, ...] = ()
    if v2 and scenario in SEQUENCE_SCENARIOS:
        requests = _requests(get(raw, "requests", list, where), f"{where}.requests", scenario, fixture, prompt)
    elif scenario == REUSE:
        # A /1 reuse case kept only the text-only follow-up; its image primer was never recorded.
        requests = (RequestResult("follow-up (text only)", None, prompt,
                                  _arms(get(raw, "arms", dict, where), f"{where}.arms", v2)),)
    else:
        arms = _arms(get(raw, "arms", dict, where), f"{where}.arms", v2)
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
_V2_ONLY_CONFIG = ("tie_margin", "deepstack_layers", "logprob_mean_tol", "logprob_tol_source", "plan", "shard",
                   "captured_buckets", "localize_threshold", "tp_size")
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
        )
        check_all(run)  # on the requests as the file holds them, so places name file indices
        if not v2:
            return run
        held = {c.id: _completed(c) for c in cases}
        held.update((entry.id, _completed(_absent(entry))) for entry in absent)
        return replace(run, cases=tuple(held[e.id] for e in read_plan(config) if e.id in held))
    except (Invalid, Contradiction) as err:
        shown = schema if schema in (SCHEMA, SCHEMA_V1) else SCHEMA
        raise ResultsFileError(source, f"not valid {shown}: {err}") from None


def load_results(path: str | Path) -> RunResult:
    shown = str(path)
    try:
        text = read_text_capped(path, MAX_FILE_BYTES)
    except TooLarge as err:
        raise ResultsFileError(shown, f"{err}; not a results file") from None
    except FileNotFoundError:
        raise ResultsFileError(shown, "no such file") from None
    except (OSError, UnicodeDecodeError, ValueError) as err:
        # A directory, no permission, a name too long, a path under a file, bytes that are not UTF-8.
        reason = getattr(err, "strerror", None) or err.__class__.__name__
        raise ResultsFileError(shown, f"cannot be read ({reason})") from None
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
    return run_from_json(doc, shown, consume=True)
