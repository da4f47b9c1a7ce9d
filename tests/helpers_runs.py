"""Synthetic, judged results for tests: arms from token id lists, cases from arms, runs from cases.

Nothing here loads a model; a whole four-arm run is a few dataclasses, so report, verdict and CI
tests can state the exact token ids that make a case PASS or FAIL. Arms carry the evidence a
correct backend records (bcg prefills replayed, the tap fired) unless a test says otherwise.
"""

from __future__ import annotations

import hashlib
from dataclasses import replace
from types import MappingProxyType
from typing import Mapping, Sequence

from parity.arms import ARM_ORDER, BCG_NORMAL, BCG_ZERO, EAGER_NORMAL, EAGER_ZERO
from parity.arms import arm as arm_of
from parity.errors import UsageError
from parity.media.catalog import builtin_fixture
from parity.plan.entries import PlanEntry, plan_json, text_sha256
from parity import registry
from parity.evidence import DeepStackRecord, Evidence, GraphBound, InputFreshness, ReplayCheck, TensorCheck
from parity.results import (
    SEQUENCE_REQUESTS, STREAM, TWIN_IMAGE, ArmResult, CaseResult, FixtureInfo, Repeat, RequestResult, RunResult,
    TopLogprobs,
)
from parity.judge.verdict import FOUR_ARMS, checks_for, judge_run

# Two answers that differ from the first token on: what DeepStack on/off gives a working model.
NORMAL_IDS: tuple[int, ...] = (11, 12, 13, 14, 15)
ZERO_IDS: tuple[int, ...] = (21, 22, 23, 24, 25)
CREATED = "2025-01-02T03:04:05+00:00"
PROMPT_TOKENS = 39
BUCKET = 48
_DEFAULT = object()


def _text_of(ids: Sequence[int]) -> str:
    # One word per id, so a token divergence is also a character divergence at a predictable place.
    return " ".join(f"w{i}" for i in ids)


def clean_replay_check(replays: int = 1, bucket: int = BUCKET) -> ReplayCheck:
    """What a correct in-process replay records: every tensor equal to eager on its own shape."""
    tensors = ("logits", "hidden", "keys", "values")
    return ReplayCheck(replays, tuple(TensorCheck(name, 0.0, 0.0) for name in tensors), padding_noise=1e-6,
                       bounds=tuple(GraphBound(f"prefill {bucket}", name, 0.0) for name in tensors))


def clean_freshness(bucket: int = BUCKET, replays: int = 1) -> tuple[InputFreshness, ...]:
    """What a correct in-process replay's freshness witness records: every input fresh."""
    return tuple(InputFreshness(f"prefill {bucket}", name, replays, rows * replays)
                 for name, rows in (("input_embeds", bucket), ("positions", PROMPT_TOKENS), ("deepstack", bucket)))


def make_evidence(mode: str, replayed: bool | None = _DEFAULT, tap_calls: int = 1, lm_calls: int = 20,
                  max_bucket: int = 8192) -> Evidence:
    """What a correct in-process backend records for one arm: bcg prefills replayed (and checked
    against eager on their own shape), eager ones not (`make_run` drops the checks of a server's)."""
    replayed = (mode == "bcg") if replayed is _DEFAULT else replayed
    return Evidence(lm_calls=lm_calls, replayed_calls=int(bool(replayed)), prefill_replayed=replayed,
                    buckets=(BUCKET,) if replayed else (), tap_calls=tap_calls, prompt_tokens=PROMPT_TOKENS,
                    max_bucket=max_bucket, replay_check=clean_replay_check() if replayed and mode == "bcg" else None,
                    freshness=clean_freshness() if replayed and mode == "bcg" else ())


def served_by(case: CaseResult, backend: str) -> CaseResult:
    """The case as `backend` records it: a server's arms carry no replay check nor freshness witness
    (design §6)."""
    if registry.info(backend).in_process:
        return case

    def unchecked(arm: ArmResult) -> ArmResult:
        return arm if arm.evidence is None else replace(arm, evidence=replace(arm.evidence, replay_check=None,
                                                                                freshness=()))

    return replace(case, arms=tuple(map(unchecked, case.arms)),
                   requests=tuple(replace(r, arms=tuple(map(unchecked, r.arms))) for r in case.requests))


def make_record(action: str) -> DeepStackRecord:
    """The tap's record of the same made-up DeepStack rows, handed on as `action`."""
    return DeepStackRecord(shape=(PROMPT_TOKENS, 6), dtype="float32", nonzero_rows=4, l2_norm=1.0,
                           sha256=hashlib.sha256(b"deepstack").hexdigest(), action=action)


def make_arm(
    name: str,
    ids: Sequence[int],
    text: str | None = None,
    logprobs: Sequence[float] | None = None,
    error: str | None = None,
    repeats: Sequence[Repeat | Sequence[int]] = (),
    seconds: float = 1.0,
    evidence: Evidence | None = _DEFAULT,
    top: TopLogprobs | None = None,
    forced: Mapping[str, Sequence[float]] | None = None,
) -> ArmResult:
    """An arm from its token ids; text, logprobs (-0.1 each) and evidence are derived unless given.

    A repeat may be a `Repeat` or a bare id list (then it reuses the arm's logprobs, so only the
    ids decide whether the arm reproduced itself).
    """
    mode, deepstack = arm_of(name).mode, arm_of(name).deepstack
    lps = tuple(float(x) for x in logprobs) if logprobs is not None else tuple(-0.1 for _ in ids)
    reps = tuple(r if isinstance(r, Repeat) else Repeat(tuple(r), lps[: len(r)]) for r in repeats)
    if evidence is _DEFAULT:
        evidence = None if error else make_evidence(mode)
    # Where the tap fired it recorded what it saw (design §4b, v5): the same rows for every arm.
    record = make_record(deepstack.value) if evidence is not None and evidence.tap_calls else None
    return ArmResult(
        name=name, mode=mode, deepstack=deepstack, token_ids=tuple(ids),
        text=_text_of(ids) if text is None else text, token_logprobs=lps, top_logprobs=top,
        deepstack_record=record,
        evidence=evidence, forced=MappingProxyType({k: tuple(v) for k, v in (forced or {}).items()}),
        error=error, seconds=seconds, repeats=reps,
    )


def fixture_info(name: str) -> FixtureInfo:
    """A built-in fixture's own sha256 and size (a file holds no other under its name); any other
    name gets a made-up image."""
    try:
        fixture = builtin_fixture(name)
    except UsageError:
        return FixtureInfo(name=name, sha256=hashlib.sha256(name.encode()).hexdigest(), size=(64, 64))
    return FixtureInfo(name, fixture.sha256, fixture.size)


def make_case(
    arms: Sequence[ArmResult],
    case_id: str = "rgb-stripes/describe",
    prompt: str = "Describe the image.",
    fixture: FixtureInfo | None = _DEFAULT,
) -> CaseResult:
    """An unjudged four-arm case; `make_run` computes its comparisons and verdict."""
    info = fixture_info(case_id.split("/")[0]) if fixture is _DEFAULT else fixture
    return CaseResult(id=case_id, fixture=info, prompt=prompt, arms=tuple(arms))


def make_sequence(
    requests: Sequence[tuple[str, bool, Sequence[ArmResult]]],
    case_id: str = "stream/rgb-stripes/describe",
    scenario: str = "stream",
) -> CaseResult:
    """An unjudged sequence case from (label, has an image, arms) per request; a request the
    scenario sends with the twin image gets the twin's fixture (same size, other pixels)."""
    info = fixture_info("rgb-stripes")
    twin = FixtureInfo("rgb-stripes-twin", fixture_info("rgb-stripes-twin").sha256, info.size)
    specs = {spec.label: spec for spec in SEQUENCE_REQUESTS.get(scenario, ())}

    def request(label: str, image: bool, arms: Sequence[ArmResult]) -> RequestResult:
        spec = specs.get(label)
        fixture = (twin if spec is not None and spec.image == TWIN_IMAGE else info) if image else None
        deepstack = arms[0].deepstack if arms else (spec.deepstack if spec is not None else "normal")
        return RequestResult(label, fixture, "Describe the image.", tuple(arms), deepstack)

    return CaseResult(id=case_id, fixture=info, prompt="Describe the image.", scenario=scenario,
                      requests=tuple(request(*r) for r in requests))


# The fields each backend's every run writes (trust v6: a file without them, or with another backend's,
# is refused), with what the embedded preset's runs write.
_SERVER_CONFIG = {"servers": {"eager": ["--model-path", "/ckpt"], "bcg": ["--model-path", "/ckpt", "--graph"]},
                  "concurrent": False, "start_order": None,
                  "gpus": {"eager": None, "bcg": None}, "launches": 2, "tap_processes": {}}
BACKEND_CONFIG: Mapping[str, Mapping] = MappingProxyType({
    "transformers": {"runner": "fixed", "poison": False, "graph_backend": "emulated", "buckets": "auto",
                     "captured_buckets": [4, 8, 12, 16, 20, 24, 28, 32, 48], "deepstack_slot_bytes": 36864,
                     "preset_seed": 0, "chunk_size": 8, "prefix_cache_page": 8, "localize_threshold": 1e-4},
    "sglang": {**{f"sglang_{k}": v for k, v in _SERVER_CONFIG.items()}, "chunk_size": 8, "top_logprobs_num": 5,
               "sglang_args": [], "sglang_prefill_buckets": {"max": 64, "count": 10}, "sglang_device": "cuda",
               "tp_size": 1, "sglang_graph_backend": None, "sglang_server_dtype": {}, "sglang_fix": None,
               "sglang_fix_slots": {}},
    "vllm": {**{f"vllm_{k}": v for k, v in _SERVER_CONFIG.items()}, "chunk_size": 8, "top_logprobs_num": 5,
             "engine": "vllm", "engine_version": "0.34.0", "graph_mode": "full", "graph_cudagraph_modes": {},
             "graph_breakable": False, "vllm_server_env": {}, "vllm_args": [], "vllm_capture_sizes": {"max": 64, "count": 10},
             "vllm_fix": None, "vllm_fix_records": {}, "vllm_device": "cuda", "vllm_graph_backend": None,
             "vllm_compile_mode": "vllm default"},
})
ENGINE_VERSIONS = {"sglang": "0.5.23", "vllm": "0.34.0"}


def make_run(
    cases: Sequence[CaseResult],
    model: str = "tiny-qwen3-vl",
    logprob_tol: float = 0.25,
    backend: str = "transformers",
    created: str = CREATED,
    tie_margin: float = 0.1,
    deepstack_layers: int = 3,
) -> RunResult:
    """A run judged by `judge_run`, exactly as `parity run` would store it."""
    cases = tuple(served_by(scored(c, keep=True), backend) for c in cases)
    config = {"model": model, "backend": backend, "dtype": "float32", "max_new_tokens": 20,
              "logprob_tol": logprob_tol, "logprob_tol_source": "user", "tie_margin": tie_margin, "tie_margin_source": "user",
              "deepstack_layers": deepstack_layers, **plan_config(cases)}
    repeats = {len(a.repeats) for c in cases for a in c.all_arms() if not a.failed}
    if len(repeats) == 1 and repeats != {0}:  # as --repeat writes it: every arm repeated alike
        config["repeat"] = repeats.pop() + 1
    config.update(BACKEND_CONFIG[backend])
    config["model_identity"] = identity_of(model).to_json()
    env = {"parity": "test", "parity_source": "test+0", "python": "3", "torch": "x", "transformers": "x",
           "sglang": None, "device": "cpu", "gpu": None}
    if backend in ENGINE_VERSIONS:
        env[backend] = ENGINE_VERSIONS[backend]
    run = RunResult(created=created, environment=MappingProxyType(env), config=MappingProxyType(config),
                    cases=cases)
    return judge_run(run)


def identity_of(model: str, seed: int = 0):
    """A made-up identity of `model`, as a run records it (design §4b, v5): the sha256 of its name."""
    import hashlib

    from parity.model_identity import CHECKPOINT, PRESET, ModelIdentity
    from parity.presets import PRESETS

    preset = model in PRESETS
    return ModelIdentity(model, PRESET if preset else CHECKPOINT, seed if preset else None,
                         hashlib.sha256(f"{model}|{seed}".encode()).hexdigest())


def plan_config(cases: Sequence[CaseResult]) -> dict:
    """config.scenarios, config.arms and config.plan as `parity run` writes them for these cases
    (given scenario-major, each scenario over the same fixtures and prompts)."""
    scenarios = list(dict.fromkeys(c.scenario for c in cases))
    plan = []
    for case in cases:
        tokens = [a.evidence.prompt_tokens for a in case.all_arms() if a.evidence and a.evidence.prompt_tokens]
        plan.append(PlanEntry(case.id, case.scenario, case.fixture.sha256 if case.fixture else None,
                              text_sha256(case.prompt), max(tokens, default=PROMPT_TOKENS)))
    arms = sorted({a.name for c in cases for a in c.all_arms()} | set(FOUR_ARMS), key=ARM_ORDER.index)
    return {"scenarios": scenarios, "arms": arms, "plan": plan_json(plan)}


# --- the canonical four-arm outcomes --------------------------------------------------------------

def four_arms(bcg_normal: Sequence[int], *, bcg_zero: Sequence[int] = ZERO_IDS,
              eager_zero: Sequence[int] = ZERO_IDS, eager_normal: Sequence[int] = NORMAL_IDS,
              logprobs: Sequence[float] | None = None) -> tuple[ArmResult, ...]:
    """All four arms, with eager answering NORMAL_IDS / ZERO_IDS unless overridden."""
    return (
        make_arm(EAGER_NORMAL, eager_normal, logprobs=logprobs),
        make_arm(EAGER_ZERO, eager_zero, logprobs=logprobs),
        make_arm(BCG_NORMAL, bcg_normal, logprobs=logprobs),
        make_arm(BCG_ZERO, bcg_zero, logprobs=logprobs),
    )


def legacy_arms() -> tuple[ArmResult, ...]:
    """The upstream drop: graph replay with DeepStack answers as if DeepStack were zero."""
    return four_arms(bcg_normal=ZERO_IDS)


def fixed_arms() -> tuple[ArmResult, ...]:
    """A correct runtime: graph replay answers as eager does."""
    return four_arms(bcg_normal=NORMAL_IDS)


def stream_case(bcg_ids: Sequence[Sequence[int]] | None = None, case_id: str = "stream/rgb-stripes/describe",
                power_ids: Sequence[int] | None = None):
    """The five requests of a stream case; eager answers request i with ids (i*10+1, ...). The first
    request's power arm (eager, DeepStack zeroed) answers `power_ids`, by default request 2's answer."""
    specs = [(r.label, r.image is not None, r.deepstack) for r in SEQUENCE_REQUESTS[STREAM]]
    eager_ids = [tuple(range(i * 10 + 1, i * 10 + 6)) for i in range(len(specs))]
    bcg_ids = eager_ids if bcg_ids is None else bcg_ids
    requests = []
    for (label, image, deepstack), e_ids, b_ids in zip(specs, eager_ids, bcg_ids):
        eager, bcg = (EAGER_NORMAL, BCG_NORMAL) if deepstack == "normal" else (EAGER_ZERO, BCG_ZERO)
        tap = 1 if image else 0
        requests.append((label, image, [
            make_arm(eager, e_ids, evidence=make_evidence("eager", tap_calls=tap)),
            make_arm(bcg, b_ids, evidence=make_evidence("bcg", tap_calls=tap)),
        ]))
    power = make_arm(EAGER_ZERO, eager_ids[1] if power_ids is None else power_ids,
                     evidence=make_evidence("eager", tap_calls=1))
    requests[0][2].append(power)
    return make_sequence(requests, case_id)


def scored(case: CaseResult, keep: bool = False) -> CaseResult:
    """The case as a backend that teacher-forces writes it: each arm scored on its own tokens and on
    every reference it is compared against, with its own logprobs where its tokens agree with the
    reference's, -2.0 after. `keep`: scores an arm already has stay as they are."""
    forced: dict[tuple[int | None, str], dict[str, tuple[float, ...]]] = {}
    for group, check in checks_for(case):
        a, b = group.arms.get(check.a), group.arms.get(check.b)
        for arm in (a, b):
            if arm is not None and not arm.failed:
                forced.setdefault((group.request, arm.name), {})[arm.name] = arm.token_logprobs
        if a is None or b is None or a.failed or b.failed:
            continue
        same = next((i for i, (x, y) in enumerate(zip(a.token_ids, b.token_ids)) if x != y),
                    min(len(a.token_ids), len(b.token_ids)))
        scores = tuple(a.token_logprobs[i] if i < same else -2.0 for i in range(len(b.token_ids)))
        forced.setdefault((group.request, a.name), {})[b.name] = scores

    def with_scores(arms: Sequence[ArmResult], request: int | None) -> tuple[ArmResult, ...]:
        return tuple(arm if arm.failed else
                     replace(arm, forced=MappingProxyType(forced.get((request, arm.name), {})
                                                          | (dict(arm.forced) if keep else {})))
                     for arm in arms)

    if not case.is_sequence:
        return replace(case, arms=with_scores(case.arms, None))
    return replace(case, requests=tuple(replace(r, arms=with_scores(r.arms, i)) for i, r in enumerate(case.requests)))


