"""An arm's evidence from what the tap recorded in the server, per LM entry (design §4).

Nothing is inferred from the configuration: `prefill_replayed` says whether every extend batch
that carried one of the arm's prompts ran while BCG replay was active, as the hook saw it in the
process that ran the model. An arm is its generation plus its teacher-forced scoring requests,
each another prefill under the same mode and tap, so all of them are its evidence.

With tensor parallelism (`--tp-size N`) every rank's model process runs every request and records
its own entries (design §8). Each rank is kept apart and labelled by the title SGLang gives its
process (`sglang::scheduler_TP1` -> "TP1 (pid …)"): the tap must have fired in every rank, a rank
that recorded nothing is silence, and ranks whose DeepStack fingerprints differ did not see the
same input, which no ablation can be trusted after.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from typing import Mapping, Sequence

from parity.evidence import (
    DeepStackRecord, Evidence, InputFreshness, LeakWitness, RankEvidence, combine_ranks, merge_freshness,
)
from parity.engines.channel import TapEntry

_SCHEDULER_TITLE = re.compile(r"sglang::scheduler_?(\S*)")

RankKey = tuple[int, str]  # (pid, process title): one model process


def rank_key(entry: TapEntry) -> RankKey:
    return entry.pid, entry.role


def rank_label(key: RankKey) -> str:
    """"TP1 (pid 4242)" from SGLang's process title `sglang::scheduler_TP1` (DP/PP parts kept)."""
    pid, role = key
    match = _SCHEDULER_TITLE.search(role)
    name = match[1].replace("_", " ") if match and match[1] else "rank"
    return f"{name} (pid {pid})"


@dataclass(frozen=True)
class TaggedRequest:
    """One request the arm sent and the LM entries the hook recorded for it, in every rank."""

    prompt_tokens: int  # the expanded prompt the server prefilled
    # Whether its prefill computes image or video rows (False for text, and for a prefix-cache hit
    # that covers them all: no DeepStack row is left for the tap to see).
    visual_rows: bool
    entries: tuple[TapEntry, ...]

    @property
    def ranks(self) -> tuple[RankKey, ...]:
        """The model processes that recorded entries, in the order they first did."""
        return tuple(dict.fromkeys(rank_key(e) for e in self.entries))

    def of_rank(self, key: RankKey) -> tuple[TapEntry, ...]:
        return tuple(e for e in self.entries if rank_key(e) == key)

    def prefills(self, key: RankKey) -> tuple[TapEntry, ...]:
        return tuple(e for e in self.of_rank(key) if e.extend is not False)

    def fingerprint(self, key: RankKey) -> DeepStackRecord | None:
        """What the rank's tap saw in the request's first prefill entry with DeepStack rows."""
        return next((e.record for e in self.prefills(key) if e.record is not None), None)


class EvidenceFault(Exception):
    """What the hook recorded cannot stand as evidence; the message says why. The arm fails (ERROR)."""


class TapSilence(EvidenceFault):
    """The hook recorded nothing where it must have fired, in some rank or all of them."""


class RankDisagreement(EvidenceFault):
    """Ranks of one server saw different DeepStack inputs for the same request."""


def check_fired(request: TaggedRequest, deepstack_layers: int, what: str, ranks: int = 1) -> None:
    """Raise when the hook did not see the request's prefill in every one of the server's `ranks`
    tensor-parallel ranks, or, for an image request to a model that consumes DeepStack, a rank saw no
    DeepStack rows in it (the ablation did not happen there), or the ranks' fingerprints differ."""
    if not request.entries:
        raise TapSilence(f"the tap never fired for the {what}: the hook recorded no LM entry for it in the "
                         "server's model process")
    seen = request.ranks
    if len(seen) < ranks:
        raise TapSilence(f"the tap fired in {len(seen)} of the server's {ranks} tensor-parallel ranks for the "
                         f"{what} ({', '.join(map(rank_label, seen))}): a silent rank's model process cannot be "
                         "shown to have seen or zeroed DeepStack; check that parity's plugin loads in every rank")
    where = (lambda key: f" in rank {rank_label(key)}") if len(seen) > 1 else (lambda key: "")
    for key in seen:
        if not request.prefills(key):
            raise TapSilence(f"the tap never fired for the prefill of the {what}{where(key)}: the hook recorded "
                             "no prompt batch for it")
        if request.visual_rows and deepstack_layers > 0 and request.fingerprint(key) is None:
            raise TapSilence(f"the tap never fired on the prefill of the {what}{where(key)}: the hook saw its LM "
                             "entries but no DeepStack rows, so DeepStack was neither recorded nor zeroed")
    prints = {key: request.fingerprint(key) for key in seen}
    if len({p.sha256 for p in prints.values() if p is not None}) > 1:
        shown = ", ".join(f"{rank_label(k)} sha256 {p.sha256[:12]}…" for k, p in prints.items() if p is not None)
        raise RankDisagreement(f"the ranks saw different DeepStack inputs for the {what} ({shown}): tensor-parallel "
                               "ranks must be handed the same features, so no comparison can be trusted")


def _rank_evidence(requests: Sequence[TaggedRequest], key: RankKey) -> RankEvidence:
    entries = [e for r in requests for e in r.of_rank(key)]
    per_request = [r.prefills(key) for r in requests]
    prefills = [e for p in per_request for e in p]
    if not all(per_request) or any(e.extend is None or e.replay is None for e in prefills):
        # A request without its prefill here, or batches that did not say which carried the
        # prompt, or how it ran.
        replayed: bool | None = None
    else:
        replayed = all(e.replay for e in prefills)
    first = requests[0].fingerprint(key) if requests else None
    return RankEvidence(
        rank=rank_label(key), lm_calls=len(entries), replayed_calls=sum(bool(e.replay) for e in entries),
        prefill_replayed=replayed,
        buckets=tuple(sorted({e.tokens for e in prefills if e.replay and e.tokens})),  # decode replays have none
        tap_calls=sum(e.record is not None for e in entries), sha256=None if first is None else first.sha256,
    )


Replays = Sequence[tuple[RankKey, tuple[InputFreshness, ...]]]  # a request's graph replays, as witnessed


def arm_evidence(requests: Sequence[TaggedRequest], max_bucket: int | None,
                 sources: Mapping[str, str | None] | None = None,
                 unscored: Sequence[TaggedRequest] = (), witnessed: Mapping[str, Replays] | None = None) -> Evidence:
    """The arm's evidence over all its requests (generation first, then teacher-forced scoring) and
    all its ranks, each rule needing every rank (`evidence.combine_ranks`).

    `sources` maps the tag of a request parity sent to the sha256 of its image, to name the
    request whose DeepStack rows a leak witness saw. `unscored` are scoring requests whose scores
    were discarded (the server re-tokenized the answer otherwise): no verdict reads what they
    computed, so how they ran proves nothing, but stale rows they read are the engine's all the same.
    `witnessed` maps a tag to the freshness witness's records of its graph replays (engines whose
    replays parity watches, design §6), read as the first rank saw them, like the leak witness."""
    keys = tuple(dict.fromkeys(k for r in requests for k in r.ranks))
    ranks = tuple(_rank_evidence(requests, k) for k in keys) or (
        RankEvidence("none", 0, 0, None, (), 0),)
    # For the verdict's hint: the longest request whose prefill did not replay, else the generation.
    eager = [r.prompt_tokens for r in requests if any(not e.replay for k in r.ranks for e in r.prefills(k))]
    prompt_tokens = max(eager) if eager else (requests[0].prompt_tokens if requests else None)
    # The leak witness as the first rank saw it: every rank runs the same steps.
    first = [e for r in (*requests, *unscored) for e in r.of_rank(keys[0])] if keys else []
    evidence = combine_ranks(ranks, prompt_tokens, max_bucket, leak_witness(first, sources or {}))
    if keys and witnessed:  # the requests judged: a discarded score's replays are not the arm's buckets
        tags = dict.fromkeys(e.tag for r in requests for e in r.of_rank(keys[0]))
        evidence = replace(evidence, freshness=freshness(
            [records for tag in tags for key, records in witnessed.get(tag, ()) if key == keys[0]], sources or {}))
    # One rank (no tensor parallelism): the file reads as it always did.
    return evidence if len(ranks) > 1 else replace(evidence, ranks=())


def leak_witness(entries: Sequence[TapEntry], sources: Mapping[str, str | None]) -> LeakWitness | None:
    """What the entries' leak witness saw (stale DeepStack rows read), or None when it never fired."""
    stale = [e for e in entries if e.stale_rows > 0]
    if not stale:
        return None
    source = next((sources.get(e.stale_source) for e in stale if e.stale_source in sources), None)
    return LeakWitness(rows=max(e.stale_rows for e in stale), steps=len(stale), source_sha256=source)


def freshness(replays: Sequence[tuple[InputFreshness, ...]], sources: Mapping[str, str | None]) -> tuple[
        InputFreshness, ...]:
    """One record per graph and input over the replays; the server names the request that left stale
    rows by its tag, the file by its image (`sources`: tag -> sha256; None for a text request)."""
    named = [tuple(replace(r, left_by=sources.get(r.left_by)) if r.left_by is not None else r for r in replay)
             for replay in replays]
    return merge_freshness(*named)


def request_record(request: TaggedRequest) -> DeepStackRecord | None:
    """The fingerprint of the request's first LM entry whose DeepStack holds features (first rank),
    else of its first tapped entry, counting tapped entries; check_fired has made sure every rank
    saw the same. A chunked video's first chunk can hold only the template and a timestamp: its
    DeepStack is all zeros, and the features come with a later chunk."""
    if not request.ranks:
        return None
    tapped = [e for e in request.of_rank(request.ranks[0]) if e.record is not None]
    if not tapped:
        return None
    first = next((e for e in tapped if e.record.nonzero_rows > 0), tapped[0])
    return replace(first.record, calls=len(tapped), replay=first.replay)


def processes(entries: Sequence[TapEntry]) -> list[str]:
    """Where the hook fired: "pid N (title)" per process, for the results' config."""
    seen = dict.fromkeys((e.pid, e.role) for e in entries)
    return [f"pid {pid} ({role})" for pid, role in seen]
