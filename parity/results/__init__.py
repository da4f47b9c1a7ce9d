"""The results of a run (design §4, `parity.results/2`): frozen dataclasses and their JSON form.

Every report is rendered from a `RunResult`; `results_loader` reads files back (both `/1` and
`/2`) and validates them. Written JSON never holds NaN or infinity: a backend that produces a
non-finite logprob fails that arm instead.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any, Mapping

from parity.design import (  # noqa: F401  (the scenario names, read by every module that reads a file)
    CASE_IMAGE, FOUR_ARM, REUSE, SCENARIOS, SEQUENCE_REQUESTS, SEQUENCE_SCENARIOS, STREAM, TWIN_IMAGE, RequestSpec,
)
from parity.evidence import DeepStackRecord, Evidence
from parity.results.signing import signed_head
from parity.textfiles import write_atomically

SCHEMA = "parity.results/2"
SCHEMA_V1 = "parity.results/1"


TopLogprobs = tuple[tuple[tuple[int, float], ...], ...]


def stored(value: float) -> float:
    """A logprob as a results file keeps it: the nine significant digits that hold every float32
    exactly (engines compute logprobs in float32), instead of a double's seventeen. A run judges
    these very values, so a file read back re-judges to the same verdict, at half the size."""
    return float(f"{value:.9g}")


_NO_FORCED: Mapping[str, tuple[float, ...]] = MappingProxyType({})


@dataclass(frozen=True)
class Repeat:
    """One extra run of an arm under `--repeat`, kept to measure the arm's own noise."""

    token_ids: tuple[int, ...]
    token_logprobs: tuple[float, ...]
    # How this repeat ran (rule 4 is checked per repeat); None in files written before v3.
    evidence: Evidence | None = None


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
    evidence: Evidence | None = None  # required in /2 for an arm that ran; absent in /1
    # reference arm name -> this arm's logprob of each of the reference's tokens (teacher forcing)
    forced: Mapping[str, tuple[float, ...]] = field(default_factory=lambda: _NO_FORCED)
    error: str | None = None
    seconds: float = 0.0  # generation, every repeat included
    forced_seconds: float = 0.0  # teacher-forced scoring, listed apart
    repeats: tuple[Repeat, ...] = ()

    @property
    def failed(self) -> bool:
        return self.error is not None


@dataclass(frozen=True)
class Comparison:
    a: str
    b: str  # the reference
    divergence_char: int
    token_match: bool
    first_token_divergence: int | None
    logprob_delta: float
    tie: bool
    tf_delta: float | None
    match: bool
    request: int | None = None  # index into the case's requests (sequence scenarios)
    logprob_mean: float = 0.0  # mean |Δ logprob| over the same steps as logprob_delta
    # A near-tie without teacher-forced scores: it cannot be excused, nor counted as a difference.
    tie_unscored: bool = False
    flip_delta: float | None = None  # a near-tie's largest |Δ| of its two tokens at the flip step
    # The graph arm's replay left eager on its own padded shape (design §6): where, in words.
    replay_departure: str | None = None

    @property
    def difference_shown(self) -> bool:
        """The arms answer differently, shown: a check that expects a difference (power, the graph
        sees DeepStack) may not rest on a near-tie it could not score."""
        return not self.match and not self.tie_unscored


@dataclass(frozen=True)
class Verdict:
    code: str
    reason: str


@dataclass(frozen=True)
class FixtureInfo:
    name: str
    sha256: str
    size: tuple[int, int]
    frames: int = 0  # a video's frame count; 0 for an image

    @property
    def kind(self) -> str:
        return "video" if self.frames else "image"

    @property
    def dimensions(self) -> str:
        """`128×96`, or `96×64, 5 frames` for a video."""
        size = f"{self.size[0]}×{self.size[1]}"
        return f"{size}, {self.frames} frames" if self.frames else size


@dataclass(frozen=True)
class RequestResult:
    """One request of a sequence scenario, answered once per execution mode."""

    label: str
    fixture: FixtureInfo | None  # None: a text-only request
    prompt: str
    arms: tuple[ArmResult, ...]
    deepstack: str = "normal"  # its DeepStack action, known even when no arm of it ran


@dataclass(frozen=True)
class LayerError:
    """One point of a per-layer comparison: a decoder layer's output, or the DeepStack add after it."""

    layer: int
    deepstack_block: int | None  # set: the hidden state right after DeepStack block k was added
    rel_error: float

    @property
    def label(self) -> str:
        """`L3` after decoder layer 3; `L0+DS0` right after DeepStack block 0 was added to it."""
        return f"L{self.layer}" if self.deepstack_block is None else f"L{self.layer}+DS{self.deepstack_block}"


@dataclass(frozen=True)
class Localization:
    """Where a replayed prefill first leaves its eager reference (design §7)."""

    arm: str
    reference: str
    request: int | None
    threshold: float
    points: tuple[LayerError, ...]
    first: int | None  # index into points of the first one above the threshold; None: none is

    @property
    def first_point(self) -> LayerError | None:
        return None if self.first is None else self.points[self.first]


@dataclass(frozen=True)
class CaseResult:
    id: str
    fixture: FixtureInfo | None
    prompt: str
    arms: tuple[ArmResult, ...] = ()  # the four arms of a four-arm case
    requests: tuple[RequestResult, ...] = ()  # the requests of a sequence case, in order
    comparisons: tuple[Comparison, ...] = ()
    verdict: Verdict | None = None
    scenario: str = FOUR_ARM
    plot: str | None = None
    localization: Localization | None = None
    localization_plot: str | None = None
    # Planned (config.plan) but not in the file: judged INCOMPLETE, never written back (design §4b).
    absent: bool = False

    @property
    def is_sequence(self) -> bool:
        return self.scenario in SEQUENCE_SCENARIOS

    def all_arms(self) -> tuple[ArmResult, ...]:
        return self.arms + tuple(arm for request in self.requests for arm in request.arms)

    def arm(self, name: str, request: int | None = None) -> ArmResult | None:
        arms = self.arms if request is None else self.requests[request].arms
        return next((a for a in arms if a.name == name), None)

    def comparison(self, a: str, b: str, request: int | None = None) -> Comparison | None:
        return next((c for c in self.comparisons if (c.a, c.b, c.request) == (a, b, request)), None)


@dataclass(frozen=True)
class Timings:
    """Where a run's wall time went, in seconds; None where the backend has no such phase (an
    in-process run starts no server, a server captures its graphs inside itself). Each arm's own
    time is the arm's `seconds` and `forced_seconds`."""

    load_s: float | None = None  # the model loaded (in-process), or the backend set up
    capture_s: float | None = None  # every prefill graph captured, recaptures included (in-process)
    server_start_s: float | None = None  # servers started until ready and probed (server backends)
    eager_s: float | None = None  # the eager session: its arms, in plan order
    bcg_s: float | None = None  # the graph session: its arms, and its capture when it comes first
    localize_s: float | None = None  # the per-layer probes of divergent cases
    total_s: float | None = None  # from the backend's creation to the judged run

    def to_json(self) -> dict:
        return {k: None if v is None else round(v, 4) for k, v in self.__dict__.items()}


TIMING_KEYS = tuple(Timings.__dataclass_fields__)


@dataclass(frozen=True)
class RunResult:
    created: str
    environment: Mapping[str, Any]
    config: Mapping[str, Any]
    cases: tuple[CaseResult, ...]
    verdict: Verdict | None = None
    schema: str = field(default=SCHEMA)
    interrupted: bool = False  # Ctrl-C: what finished is kept, the rest is INCOMPLETE
    timings: Timings | None = None  # None: a merge, or a file written before parity recorded them
    # A verdict found before any arm ran (a model without DeepStack): the file holds no case, and its
    # shard of a CI gate is still there (`run_command.write_before_run`, design §4c).
    before_run: Verdict | None = None

    @property
    def logprob_tol(self) -> float:
        """The run's bound; 0 for a verdict before any arm, which compared nothing."""
        return float(self.config.get("logprob_tol", 0.0))

    @property
    def logprob_mean_tol(self) -> float | None:
        """The bound on the mean |Δ| (v3, reduced precision); None: only the max is bounded."""
        value = self.config.get("logprob_mean_tol")
        return None if value is None else float(value)

    @property
    def tie_margin(self) -> float | None:
        """None for a /1 file: the tie rule did not exist, so nothing is a tie."""
        value = self.config.get("tie_margin")
        return None if value is None else float(value)

    @property
    def deepstack_layers(self) -> int | None:
        """How many DeepStack blocks the model adds; None for a /1 file (inferred from records)."""
        value = self.config.get("deepstack_layers")
        return None if value is None else int(value)


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
        "forced": {ref: None if lps is None else list(lps) for ref, lps in arm.forced.items()} or None,
        "evidence": arm.evidence.to_json() if arm.evidence else None,
        "error": arm.error,
        "seconds": arm.seconds,
        "forced_seconds": arm.forced_seconds,
    }
    if arm.repeats:
        out["repeats"] = [{"token_ids": list(r.token_ids), "token_logprobs": list(r.token_logprobs),
                           "evidence": r.evidence.to_json() if r.evidence else None} for r in arm.repeats]
    return out


def comparison_to_json(c: Comparison) -> dict:
    out = {"a": c.a, "b": c.b, "divergence_char": c.divergence_char, "token_match": c.token_match,
           "first_token_divergence": c.first_token_divergence, "logprob_delta": c.logprob_delta,
           "logprob_mean": c.logprob_mean, "tie": c.tie, "tf_delta": c.tf_delta, "match": c.match}
    if c.tie:
        out.update(flip_delta=c.flip_delta, tie_unscored=c.tie_unscored)
    if c.replay_departure is not None:
        out["replay_departure"] = c.replay_departure
    if c.request is not None:
        out["request"] = c.request
    return out


def fixture_to_json(fixture: FixtureInfo | None) -> dict | None:
    if fixture is None:
        return None
    out = {"name": fixture.name, "sha256": fixture.sha256, "size": list(fixture.size)}
    if fixture.frames:
        out["frames"] = fixture.frames
    return out


def localization_to_json(loc: Localization) -> dict:
    return {
        "arm": loc.arm, "reference": loc.reference, "request": loc.request, "threshold": loc.threshold,
        "points": [{"layer": p.layer, "deepstack_block": p.deepstack_block, "rel_error": p.rel_error}
                   for p in loc.points],
        "first_divergent": loc.first,
    }


def _verdict_json(v: Verdict | None) -> dict | None:
    return None if v is None else {"code": v.code, "reason": v.reason}


def case_to_json(case: CaseResult) -> dict:
    out: dict[str, Any] = {
        "id": case.id,
        "scenario": case.scenario,
        "fixture": fixture_to_json(case.fixture),
        "prompt": case.prompt,
    }
    if case.is_sequence:
        out["requests"] = [{"label": r.label, "fixture": fixture_to_json(r.fixture), "prompt": r.prompt,
                            "arms": {arm.name: arm_to_json(arm) for arm in r.arms}} for r in case.requests]
    else:
        out["arms"] = {arm.name: arm_to_json(arm) for arm in case.arms}
    out["comparisons"] = [comparison_to_json(c) for c in case.comparisons]
    out["verdict"] = _verdict_json(case.verdict)
    if case.localization is not None:
        out["localization"] = localization_to_json(case.localization)
    for key in ("plot", "localization_plot"):
        if getattr(case, key) is not None:
            out[key] = getattr(case, key)
    return out


def _head_json(run: RunResult) -> dict:
    out = {
        "schema": run.schema,
        "created": run.created,
        "environment": dict(run.environment),
        "config": dict(run.config),
        "verdict": _verdict_json(run.verdict),
    }
    if run.interrupted:
        out["interrupted"] = True
    if run.timings is not None:
        out["timings"] = run.timings.to_json()
    if run.before_run is not None:
        out["before_run"] = _verdict_json(run.before_run)
    return out


def run_to_json(run: RunResult) -> dict:
    return {**_head_json(run), "cases": [case_to_json(c) for c in run.cases if not c.absent]}


def dumps(run: RunResult, key: bytes | None = None) -> str:
    """The results document: one line per case, each case compact, built one case at a time. A
    sweep of thousands of cases stays a file the loader reads back (design §4b); indenting every
    logprob pair made it 4x larger. allow_nan=False: a bare NaN is not JSON, and no reader should
    have to guess what it meant. With a `key`, signed (design §4d)."""
    kept = [case for case in run.cases if not case.absent]
    # Signed, each case's JSON is built twice (once for the MAC, once for the text): never all at once.
    head = json.dumps(signed_head(_head_json(run), (case_to_json(c) for c in kept), key), ensure_ascii=False,
                      allow_nan=False)
    body = ",\n".join(json.dumps(case_to_json(case), ensure_ascii=False, allow_nan=False) for case in kept)
    return f'{head[:-1]}, "cases": [\n{body}\n]}}'


def write_results(run: RunResult, path: Path, key: bytes | None = None) -> None:
    write_atomically(Path(path), dumps(run, key) + "\n")
