"""What a run's evidence must show for a verdict to rest on it (design §3, rules 1b, 1c and 4), read
the same way from `/2` evidence and `/1` tap records: whether an arm's prompt prefill replayed,
whether its tap fired, and whether a replay used the bucket the policy assigns.
"""

from __future__ import annotations

from dataclasses import dataclass

from parity.buckets import smallest_fitting
from parity.engines import registry
from parity.evidence import Evidence
from parity.metrics import Tolerances
from parity.results import ArmResult, RunResult


@dataclass(frozen=True)
class Rules:
    """What judging needs from a run besides its arms."""

    tolerances: Tolerances
    deepstack_layers: int | None  # None (a /1 file): inferred from the tap records
    backend: str = registry.DEFAULT
    captured: tuple[int, ...] | None = None  # the buckets the run captured; None: not recorded
    repeat: int = 1  # --repeat: every arm runs this often
    runner: str | None = None  # the transformers backend's runner variant

    @classmethod
    def of(cls, run: RunResult) -> "Rules":
        captured = run.config.get("captured_buckets")
        repeat = run.config.get("repeat")
        return cls(Tolerances(run.logprob_tol, run.tie_margin, run.logprob_mean_tol), run.deepstack_layers,
                   str(run.config.get("backend", registry.DEFAULT)),
                   None if captured is None else tuple(sorted(int(b) for b in captured)),
                   repeat if isinstance(repeat, int) and repeat >= 1 else 1, run.config.get("runner"))


def replay_shown(arm: ArmResult) -> bool | None:
    """Whether the arm's prompt prefill ran by graph replay: /2 evidence, else the /1 record."""
    if arm.evidence is not None:
        return arm.evidence.prefill_replayed
    return arm.deepstack_record.replay if arm.deepstack_record is not None else None


def tap_fired(arm: ArmResult) -> bool:
    if arm.evidence is not None:
        return arm.evidence.tap_calls > 0
    return arm.deepstack_record is not None and arm.deepstack_record.nonzero_rows > 0


def runs_of(arm: ArmResult) -> tuple[tuple[str, Evidence | None, bool | None], ...]:
    """(label, evidence, replay shown) of every run of the arm: the first, then each repeat. A repeat
    without its own evidence (a file from before v3) is covered by the arm's, which merged them."""
    runs = [(arm.name, arm.evidence, replay_shown(arm))]
    for i, rep in enumerate(arm.repeats):
        if rep.evidence is not None:
            runs.append((f"{arm.name} (repeat {i + 2})", rep.evidence, rep.evidence.prefill_replayed))
    return tuple(runs)


def bucket_fault(label: str, evidence: Evidence | None, rules: Rules) -> str | None:
    """Why a replay's bucket breaks the policy (design §6 v3), or None: a replay must use the
    smallest captured bucket that fits its prompt."""
    if evidence is None or not evidence.prefill_replayed or evidence.prompt_tokens is None:
        return None
    tokens = evidence.prompt_tokens
    small = [b for b in evidence.buckets if b < tokens]
    if small:
        return f"{label} replayed its {tokens}-token prompt in bucket {small[0]}, smaller than the prompt"
    if rules.captured is None:
        return None
    stray = [b for b in evidence.buckets if b not in rules.captured]
    if stray:
        return f"{label} replayed in bucket {stray[0]}, which the run never captured ({list(rules.captured)})"
    policy = smallest_fitting(rules.captured, tokens)
    if policy not in evidence.buckets:
        return (f"{label} replayed its {tokens}-token prompt in bucket {evidence.buckets[0]}, but the bucket "
                f"policy assigns bucket {policy} (the smallest captured bucket that fits)")
    return None


def not_replayed_reason(label: str, arm: ArmResult, evidence: Evidence | None, shown: bool | None,
                         rules: Rules) -> str | None:
    if arm.mode == "eager":
        if shown or (evidence is not None and evidence.replayed_calls > 0):
            return (f"{label} is an eager arm but ran by graph replay, so it is not an eager reference; "
                    "check that the eager path really disables the prefill graph")
        return None
    if shown is True:
        return None
    tokens = "?" if evidence is None or evidence.prompt_tokens is None else evidence.prompt_tokens
    largest = "unknown" if evidence is None or evidence.max_bucket is None else evidence.max_bucket
    how = "was not shown to run by graph replay" if shown is None else "ran eagerly, not by graph replay"
    hint = registry.info(rules.backend).not_replayed_hint(evidence)
    return (f"{label}: the prefill of its {tokens}-token prompt {how} (largest captured bucket: {largest}), "
            f"so the graph path was not tested; {hint}")
