"""What a run's evidence must show for a verdict to rest on it (design §3, rules 1b, 1c and 4), read
the same way from `/2` evidence and `/1` tap records: whether an arm's prompt prefill replayed,
whether its tap fired, and whether a replay used the bucket the policy assigns.
"""

from __future__ import annotations

from dataclasses import dataclass

from parity.runner.buckets import smallest_fitting
from parity.design import (
    PROVES_CACHE_HIT, PROVES_CHUNKS, PROVES_ENCODER_GRAPH, PROVES_GROWTH, PROVES_SHARED_FORWARD, PROVES_WARM_GRAPH,
)
from parity import registry
from parity.evidence import Evidence
from parity.judge.metrics import Tolerances
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
    smallest captured bucket that fits its prompt (each chunk's, when it ran in parts)."""
    if evidence is None or not evidence.prefill_replayed or evidence.prompt_tokens is None:
        return None
    serving = evidence.serving
    if serving is not None and serving.chunks:
        parts = [(c.end - c.start, (c.bucket,), f"{label}'s chunk [{c.start}, {c.end})")
                 for c in serving.chunks if c.bucket is not None]
    else:
        parts = [(evidence.prompt_tokens, evidence.buckets, label)]
    batch = None if serving is None else serving.batch
    if batch is not None and batch.bucket is not None:  # its last part: the forward's rows, all requests'
        parts[-1] = (batch.rows, (batch.bucket,), f"{label}'s forward {batch.forward} ({batch.requests} requests)")
    for tokens, buckets, where in parts:
        fault = _bucket_fault(where, tokens, buckets, rules)
        if fault:
            return fault
    return None


def _bucket_fault(label: str, tokens: int, buckets: tuple[int, ...], rules: Rules) -> str | None:
    if not buckets:  # no replay's bucket recorded (the evidence's own rules refuse a replay without one)
        return None
    small = [b for b in buckets if b < tokens]
    if small:
        return f"{label} replayed its {tokens}-token prompt in bucket {small[0]}, smaller than the prompt"
    if rules.captured is None:
        return None
    stray = [b for b in buckets if b not in rules.captured]
    if stray:
        return f"{label} replayed in bucket {stray[0]}, which the run never captured ({list(rules.captured)})"
    policy = smallest_fitting(rules.captured, tokens)
    if policy not in buckets:
        return (f"{label} replayed its {tokens}-token prompt in bucket {buckets[0]}, but the bucket "
                f"policy assigns bucket {policy} (the smallest captured bucket that fits)")
    return None


def path_not_reached(proves: str, evidence: Evidence | None, earlier: Evidence | None,
                     cannot: str | None = None) -> str | None:
    """Why a graph arm's evidence does not show the serving path its request must reach (design
    §10), or None. `earlier`: the evidence of the scenario's previous request with a path; `cannot`:
    why the backend has no such path (`BackendInfo.unreachable`), which then replaces the hint."""
    found = _not_reached(proves, evidence, earlier)
    if found is None:
        return None
    fact, hint = found
    if cannot is not None:
        return f"{fact}, and the backend cannot reach it: {cannot}"
    return f"{fact}{hint}"


def _not_reached(proves: str, evidence: Evidence | None, earlier: Evidence | None) -> tuple[str, str] | None:
    """(what the evidence lacks, a hint at how to reach it), or None."""
    serving = None if evidence is None else evidence.serving
    if serving is None:
        return "it recorded no serving evidence", ""
    if proves == PROVES_CHUNKS:
        with_image = [c for c in serving.chunks if c.image_rows]
        if len(with_image) < 2:
            return (f"its image rows fell in {len(with_image)} chunk(s), not two or more (chunks "
                    f"{[(c.start, c.end) for c in serving.chunks]})", "; give a smaller --chunk-size")
        if any(c.bucket is None for c in serving.chunks):
            return "not every chunk replayed a graph", ""
    elif proves == PROVES_CACHE_HIT and not serving.cached_tokens:
        return "no prompt row came from the prefix cache", ""
    elif proves == PROVES_GROWTH and serving.buffer_growth is None:
        return ("the DeepStack buffer did not grow",
                " (the request fit it: with an explicit --buckets list, it may fit the largest bucket)")
    elif proves == PROVES_WARM_GRAPH and serving.graph_ready is not True:
        return ("its bucket's graph was not captured before it arrived, at start-up or by a request without "
                "DeepStack", " (an earlier image request captured it)")
    elif proves == PROVES_SHARED_FORWARD:
        batch = serving.batch
        if batch is None or batch.requests < 2:
            return ("its prefill ran alone, in no forward shared with another request",
                    " (no captured graph fit the requests together: give --buckets auto, or a larger bucket)")
        if batch.bucket is None:
            return f"the forward it shared with {batch.requests - 1} other request(s) ran eagerly", ""
    elif proves == PROVES_ENCODER_GRAPH:
        if serving.encoder is None:
            return "its image did not go through the encoder graphs", ""
        before = None if earlier is None or earlier.serving is None else earlier.serving.encoder
        now = serving.encoder
        if before is not None and (before.patches != now.patches or before.grid == now.grid):
            return (f"its image has {now.patches} patches on grid {'x'.join(map(str, now.grid))}, the one before "
                    f"{before.patches} on {'x'.join(map(str, before.grid))}: not the same token count on another "
                    "grid", "")
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
