"""Synthetic, judged results for tests: arms from token id lists, cases from arms, runs from cases.

Nothing here loads a model; a whole four-arm run is a few dataclasses, so report, verdict and CI
tests can state the exact token ids that make a case PASS or FAIL.
"""

from __future__ import annotations

import hashlib
from types import MappingProxyType
from typing import Sequence

from parity.arms import ARM_ORDER, BCG_NORMAL, BCG_ZERO, EAGER_NORMAL, EAGER_ZERO
from parity.results import ArmResult, CaseResult, FixtureInfo, Repeat, RunResult
from parity.verdict import judge_run

# Two answers that differ from the first token on: what DeepStack on/off gives a working model.
NORMAL_IDS: tuple[int, ...] = (11, 12, 13, 14, 15)
ZERO_IDS: tuple[int, ...] = (21, 22, 23, 24, 25)
CREATED = "2025-01-02T03:04:05+00:00"


def _mode_and_deepstack(name: str) -> tuple[str, str]:
    # Canonical names carry both facts ("bcg_zero_deepstack"); anything else is a test's typo.
    if name not in ARM_ORDER:
        raise ValueError(f"make_arm needs a canonical arm name ({', '.join(ARM_ORDER)}), got {name!r}")
    mode, _, rest = name.partition("_")
    return mode, "zero" if rest.startswith("zero") else "normal"


def _text_of(ids: Sequence[int]) -> str:
    # One word per id, so a token divergence is also a character divergence at a predictable place.
    return " ".join(f"w{i}" for i in ids)


def make_arm(
    name: str,
    ids: Sequence[int],
    text: str | None = None,
    logprobs: Sequence[float] | None = None,
    error: str | None = None,
    repeats: Sequence[Repeat | Sequence[int]] = (),
    seconds: float = 1.0,
) -> ArmResult:
    """An arm from its token ids; text and logprobs (-0.1 each) are derived unless given.

    A repeat may be a `Repeat` or a bare id list (then it reuses the arm's logprobs, so only the
    ids decide whether the arm reproduced itself).
    """
    mode, deepstack = _mode_and_deepstack(name)
    lps = tuple(float(x) for x in logprobs) if logprobs is not None else tuple(-0.1 for _ in ids)
    reps = tuple(r if isinstance(r, Repeat) else Repeat(tuple(r), lps[: len(r)]) for r in repeats)
    return ArmResult(
        name=name, mode=mode, deepstack=deepstack, token_ids=tuple(ids),
        text=_text_of(ids) if text is None else text, token_logprobs=lps,
        error=error, seconds=seconds, repeats=reps,
    )


def _fixture_for(case_id: str) -> FixtureInfo:
    # "reuse/rgb-stripes/describe" and "rgb-stripes/describe" both name fixture "rgb-stripes".
    parts = case_id.split("/")
    name = parts[1] if parts[0] == "reuse" and len(parts) > 2 else parts[0]
    return FixtureInfo(name=name, sha256=hashlib.sha256(name.encode()).hexdigest(), size=(64, 64))


def make_case(
    arms: Sequence[ArmResult],
    case_id: str = "rgb-stripes/describe",
    scenario: str = "four-arm",
    prompt: str = "Describe the image.",
    fixture: FixtureInfo | None = None,
) -> CaseResult:
    """An unjudged case; `make_run` computes its comparisons and verdict."""
    return CaseResult(
        id=case_id, fixture=fixture or _fixture_for(case_id), prompt=prompt, arms=tuple(arms),
        scenario=scenario, primer="Describe the image." if scenario == "reuse" else None,
    )


def make_run(
    cases: Sequence[CaseResult],
    model: str = "tiny-qwen3-vl",
    logprob_tol: float = 0.25,
    backend: str = "transformers",
    created: str = CREATED,
) -> RunResult:
    """A run judged by `judge_run`, exactly as `parity run` would store it."""
    config = {"model": model, "backend": backend, "dtype": "float32", "max_new_tokens": 20,
              "logprob_tol": logprob_tol}
    env = {"parity": "test", "python": "3", "torch": "x", "transformers": "x", "sglang": None,
           "device": "cpu", "gpu": None}
    run = RunResult(created=created, environment=MappingProxyType(env), config=MappingProxyType(config),
                    cases=tuple(cases))
    return judge_run(run)


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
