"""An arm's evidence from what the tap recorded in the server, per LM entry (design §4).

Nothing is inferred from the configuration: `prefill_replayed` says whether every extend batch
that carried one of the arm's prompts ran while BCG replay was active, as the hook saw it in the
process that ran the model. An arm is its generation plus its teacher-forced scoring requests,
each another prefill under the same mode and tap, so all of them are its evidence.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Mapping, Sequence

from parity.evidence import DeepStackRecord, Evidence, LeakWitness
from parity.serving.channel import TapEntry


@dataclass(frozen=True)
class TaggedRequest:
    """One request the arm sent and the LM entries the hook recorded for it."""

    prompt_tokens: int  # the expanded prompt the server prefilled
    has_image: bool
    entries: tuple[TapEntry, ...]

    @property
    def first_rank(self) -> tuple[TapEntry, ...]:
        # With tensor parallelism every rank sees the same entries; count one rank's.
        return tuple(e for e in self.entries if e.pid == self.entries[0].pid) if self.entries else ()

    @property
    def prefills(self) -> tuple[TapEntry, ...]:
        return tuple(e for e in self.first_rank if e.extend is not False)


class TapSilence(Exception):
    """The hook recorded nothing where it must have fired; the message says what is missing."""


def check_fired(request: TaggedRequest, deepstack_layers: int, what: str) -> None:
    """Raise TapSilence when the hook did not see the request's prefill, or, for an image request to
    a model that consumes DeepStack, saw no DeepStack rows in it (the ablation did not happen)."""
    if not request.prefills:
        raise TapSilence(f"the tap never fired for the {what}: the hook recorded no LM entry for it in the "
                         "server's model process")
    if request.has_image and deepstack_layers > 0 and not any(e.record for e in request.prefills):
        raise TapSilence(f"the tap never fired on the prefill of the {what}: the hook saw its LM entries but no "
                         "DeepStack rows, so DeepStack was neither recorded nor zeroed")


def arm_evidence(requests: Sequence[TaggedRequest], max_bucket: int | None,
                 sources: Mapping[str, str | None] | None = None) -> Evidence:
    """The arm's evidence over all its requests: generation first, then teacher-forced scoring.

    `sources` maps the tag of a request parity sent to the sha256 of its image, to name the
    request whose DeepStack rows a leak witness saw."""
    entries = [e for r in requests for e in r.first_rank]
    prefills = [e for r in requests for e in r.prefills]
    if not prefills or any(e.extend is None or e.replay is None for e in prefills):
        replayed: bool | None = None  # the batches did not say which carried the prompt, or how it ran
    else:
        replayed = all(e.replay for e in prefills)
    # For the verdict's hint: the longest request whose prefill did not replay, else the generation.
    eager = [r.prompt_tokens for r in requests if any(not e.replay for e in r.prefills)]
    return Evidence(
        lm_calls=len(entries),
        replayed_calls=sum(bool(e.replay) for e in entries),
        prefill_replayed=replayed,
        buckets=tuple(sorted({e.tokens for e in prefills if e.replay and e.tokens})),  # decode replays have none
        tap_calls=sum(e.record is not None for e in entries),
        prompt_tokens=max(eager) if eager else (requests[0].prompt_tokens if requests else None),
        max_bucket=max_bucket,
        leak=leak_witness(entries, sources or {}),
    )


def leak_witness(entries: Sequence[TapEntry], sources: Mapping[str, str | None]) -> LeakWitness | None:
    """What the entries' leak witness saw (stale DeepStack rows read), or None when it never fired."""
    stale = [e for e in entries if e.stale_rows > 0]
    if not stale:
        return None
    source = next((sources.get(e.stale_source) for e in stale if e.stale_source in sources), None)
    return LeakWitness(rows=max(e.stale_rows for e in stale), steps=len(stale), source_sha256=source)


def request_record(request: TaggedRequest) -> DeepStackRecord | None:
    """The fingerprint of the request's first LM entry with DeepStack rows, counting such entries."""
    tapped = [e for e in request.first_rank if e.record is not None]
    if not tapped:
        return None
    return replace(tapped[0].record, calls=len(tapped), replay=tapped[0].replay)


def processes(entries: Sequence[TapEntry]) -> list[str]:
    """Where the hook fired: "pid N (title)" per process, for the results' config."""
    seen = dict.fromkeys((e.pid, e.role) for e in entries)
    return [f"pid {pid} ({role})" for pid, role in seen]
