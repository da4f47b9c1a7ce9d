"""An arm read back from a results file: its answer, top-k, DeepStack record, teacher-forced scores,
evidence and repeats, each value checked and a bad one named by its JSON path (`Invalid`).
"""

from __future__ import annotations

from types import MappingProxyType
from typing import Any

from parity.arms import ARM_ORDER
from parity.arms import arm as arm_of
from parity.evidence import (
    BatchRun, CHECKED_TENSORS, ChunkRun, DeepStackRecord, Departure, EncoderRun, Evidence, GraphBound, InputFreshness,
    LeakWitness, RankEvidence, ReplayCheck, ServingEvidence, TensorCheck,
)
from parity.results import ArmResult, FixtureInfo, Repeat, TopLogprobs
from parity.trust.fields import (
    MAX_COUNT, SHA256_HEX, Invalid, get, ints, is_logprob, logprobs, non_negative_int, number, shared_int,
)



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
    if not SHA256_HEX.fullmatch(sha):
        raise Invalid(f"{where}.sha256 must be 64 lowercase hex digits")
    action = get(raw, "action", str, where)
    if action not in ("normal", "zero"):
        raise Invalid(f"{where}.action must be 'normal' or 'zero', got {action!r}")
    norm = number(get(raw, "l2_norm", (int, float), where), f"{where}.l2_norm")
    if norm < 0:
        raise Invalid(f"{where}.l2_norm must be >= 0, got {norm}")
    calls = get(raw, "calls", int, where, optional=True)
    span = get(raw, "nonzero_span", list, where, optional=True)
    if span is not None:
        first, end = ints(span, f"{where}.nonzero_span") if len(span) == 2 else (0, 0)  # (0, 0): never valid
        if not (0 <= first < end <= (shape[0] if shape else end) and end - first >= rows > 0):
            raise Invalid(f"{where}.nonzero_span {span} is not [first, last + 1) of {rows} non-zero row(s) "
                          f"within its {shape[0] if shape else '?'} rows")
    return DeepStackRecord(
        shape=shape, dtype=get(raw, "dtype", str, where), nonzero_rows=rows, l2_norm=norm, sha256=sha,
        action=action, calls=1 if calls is None else non_negative_int(calls, f"{where}.calls"),
        replay=get(raw, "replay", bool, where, optional=True), nonzero_span=None if span is None else (first, end),
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
        serving=_serving(raw.get("serving"), f"{where}.serving"),
        replay_check=_replay_check(raw.get("replay_check"), f"{where}.replay_check"),
        freshness=tuple(_freshness(r, f"{where}.freshness[{i}]")
                        for i, r in enumerate(get(raw, "freshness", list, where, optional=True) or [])),
    )
    problem = evidence.inconsistency()
    if problem:
        raise Invalid(f"{where} is inconsistent: {problem}")
    return evidence


def _serving(raw: Any, where: str) -> ServingEvidence | None:
    # Optional: only a family scenario's requests record their serving path.
    if raw is None:
        return None

    def pair(key: str) -> tuple[int, int] | None:
        value = get(raw, key, list, where, optional=True)
        if value is None:
            return None
        if len(value) != 2:
            raise Invalid(f"{where}.{key} must be [a, b]")
        return ints(value, f"{where}.{key}")  # type: ignore[return-value]

    def count(key: str) -> int | None:
        value = get(raw, key, int, where, optional=True)
        return None if value is None else non_negative_int(value, f"{where}.{key}", 1)

    chunks = []
    for i, chunk in enumerate(get(raw, "chunks", list, where)):
        cwhere = f"{where}.chunks[{i}]"
        if not isinstance(chunk, list) or len(chunk) != 4:
            raise Invalid(f"{cwhere} must be [start, end, bucket or null, image rows]")
        start, end, rows = ints([chunk[0], chunk[1], chunk[3]], cwhere)
        bucket = None if chunk[2] is None else ints([chunk[2]], cwhere, minimum=1)[0]
        chunks.append(ChunkRun(start, end, bucket, rows))
    encoder_raw = get(raw, "encoder", dict, where, optional=True)
    encoder = None
    if encoder_raw is not None:
        ewhere = f"{where}.encoder"
        grid = ints(get(encoder_raw, "grid", list, ewhere), f"{ewhere}.grid", minimum=1)
        if len(grid) != 3:
            raise Invalid(f"{ewhere}.grid must be [t, h, w]")
        encoder = EncoderRun(grid, non_negative_int(get(encoder_raw, "patches", int, ewhere), f"{ewhere}.patches", 1),
                             get(encoder_raw, "key", str, ewhere), get(encoder_raw, "replayed", bool, ewhere))
    batch_raw = get(raw, "batch", dict, where, optional=True)
    batch = None
    if batch_raw is not None:
        bwhere = f"{where}.batch"
        own = get(batch_raw, "own", list, bwhere)
        if len(own) != 2:
            raise Invalid(f"{bwhere}.own must be [start, end]")
        bucket = get(batch_raw, "bucket", int, bwhere, optional=True)

        def positive(key: str) -> int:
            return non_negative_int(get(batch_raw, key, int, bwhere), f"{bwhere}.{key}", 1)
        batch = BatchRun(positive("forward"), None if bucket is None else non_negative_int(bucket, f"{bwhere}.bucket", 1),
                         positive("requests"), positive("rows"), *ints(own, f"{bwhere}.own"))
    return ServingEvidence(
        chunks=tuple(chunks),
        cached_tokens=non_negative_int(get(raw, "cached_tokens", int, where), f"{where}.cached_tokens"),
        image_span=pair("image_span"), buffer_growth=pair("buffer_growth"),
        graph_ready=get(raw, "graph_ready", bool, where, optional=True), encoder=encoder,
        prompt_tokens=count("prompt_tokens"), batch=batch,
    )


def _replay_check(raw: Any, where: str) -> ReplayCheck | None:
    # Written by the in-process backend for every graph arm that replayed (trust/requirements.py).
    if raw is None:
        return None
    tensors_raw = get(raw, "tensors", dict, where)
    unknown = sorted(set(tensors_raw) - set(CHECKED_TENSORS))
    if unknown:
        raise Invalid(f"{where}.tensors.{unknown[0]} is not a checked tensor ({', '.join(CHECKED_TENSORS)})")
    tensors = []
    for name in CHECKED_TENSORS:
        if name not in tensors_raw:
            continue
        pair = tensors_raw[name]
        if not isinstance(pair, list) or len(pair) != 2:
            raise Invalid(f"{where}.tensors.{name} must be [delta, bound]")
        tensors.append(TensorCheck(name, number(pair[0], f"{where}.tensors.{name}[0]"),
                                   number(pair[1], f"{where}.tensors.{name}[1]")))
    noise = get(raw, "padding_noise", (int, float), where, optional=True)
    departure_raw = get(raw, "departure", dict, where, optional=True)
    departure = None
    if departure_raw is not None:
        dwhere = f"{where}.departure"
        departure = Departure(
            non_negative_int(get(departure_raw, "replay", int, dwhere), f"{dwhere}.replay"),
            get(departure_raw, "tensor", str, dwhere), get(departure_raw, "point", str, dwhere),
            non_negative_int(get(departure_raw, "position", int, dwhere), f"{dwhere}.position"),
            number(get(departure_raw, "delta", (int, float), dwhere), f"{dwhere}.delta"),
            number(get(departure_raw, "bound", (int, float), dwhere), f"{dwhere}.bound"))
    bounds = []
    for graph, per_tensor in (get(raw, "bounds", dict, where, optional=True) or {}).items():
        if not isinstance(per_tensor, dict):
            raise Invalid(f"{where}.bounds[{graph!r}] must map each tensor to its bound")
        bounds += [GraphBound(graph, tensor, number(bound, f"{where}.bounds[{graph!r}].{tensor}"))
                   for tensor, bound in per_tensor.items()]
    return ReplayCheck(non_negative_int(get(raw, "replays", int, where), f"{where}.replays", 1), tuple(tensors),
                       None if noise is None else number(noise, f"{where}.padding_noise"), departure, tuple(bounds))


def _leak(raw: Any, where: str) -> LeakWitness | None:
    # Optional: only engines with a leak witness (vLLM) write it, and only when it fired.
    if raw is None:
        return None
    return LeakWitness(rows=non_negative_int(get(raw, "rows", int, where), f"{where}.rows", 1),
                       steps=non_negative_int(get(raw, "steps", int, where), f"{where}.steps", 1),
                       source_sha256=get(raw, "source_sha256", str, where, optional=True))


def _freshness(raw: Any, where: str) -> InputFreshness:
    def count(key: str, minimum: int = 0) -> int:
        return non_negative_int(get(raw, key, int, where), f"{where}.{key}", minimum)

    left_by = get(raw, "left_by", str, where, optional=True)
    if left_by is not None and not SHA256_HEX.fullmatch(left_by):
        raise Invalid(f"{where}.left_by must be an image's sha256 (64 lowercase hex digits) or null")
    return InputFreshness(
        graph=get(raw, "graph", str, where), input=get(raw, "input", str, where), replays=count("replays", 1),
        rows=count("rows"), stale=count("stale"), unwritten=count("unwritten"), miswritten=count("miswritten"),
        first=ints(get(raw, "first", list, where), f"{where}.first"), left_by=left_by,
        poisoned=None if raw.get("poisoned") is None else count("poisoned"))


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
    expected = arm_of(name)
    if (mode, deepstack) != (expected.mode, expected.deepstack):
        raise Invalid(f"{where} has mode {mode!r} / deepstack {deepstack!r}, but arm {name} is "
                      f"{expected.mode.value!r} / {expected.deepstack.value!r}")
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


def read_arms(raw: Any, where: str, v2: bool) -> tuple[ArmResult, ...]:
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


def read_fixture(raw: Any, where: str) -> FixtureInfo | None:
    if raw is None:
        return None
    size = get(raw, "size", list, where)
    if len(size) != 2:
        raise Invalid(f"{where}.size must be [width, height]")
    width, height = ints(size, f"{where}.size", minimum=1)
    frames = get(raw, "frames", int, where, optional=True)
    if frames is not None and frames < 1:
        raise Invalid(f"{where}.frames must be a video's frame count (1 or more), or absent for an image")
    return FixtureInfo(get(raw, "name", str, where), get(raw, "sha256", str, where), (width, height), frames or 0)
