"""What an arm's execution recorded as it ran: the tap's fingerprint and the execution evidence.

A verdict may only rest on what was recorded while the arm ran, never on what a configuration
implies: a `bcg` arm whose prefill silently ran eager proves nothing (design §3 rule 4), and an
arm whose tap never fired may not have been ablated (rule 1b). Torch-free, so the commands that
only read results stay light.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from typing import Any, Collection, Mapping, Sequence


@dataclass(frozen=True)
class DeepStackRecord:
    """Fingerprint of the DeepStack tensor the tap saw at the LM entry, before any zeroing.

    `nonzero_rows` > 0 and the same `sha256` in eager and graph arms prove both modes were handed
    the same features.
    """

    shape: tuple[int, ...]
    dtype: str
    nonzero_rows: int
    l2_norm: float
    sha256: str
    action: str  # what the tap then handed on: "normal" or "zero"
    calls: int = 1  # how many LM entries the tap saw for this request
    replay: bool | None = None  # whether the entry was a graph replay, when the backend knows
    # [first, last + 1) of its non-zero rows, as the tap saw them (trust v7: where the image's rows
    # sit, recorded as the run happened); None: no non-zero row, or a record from before v7.
    nonzero_span: tuple[int, int] | None = None

    def to_json(self) -> dict:
        return {
            "shape": list(self.shape), "dtype": self.dtype, "nonzero_rows": self.nonzero_rows,
            "l2_norm": self.l2_norm, "sha256": self.sha256, "action": self.action,
            "calls": self.calls, "replay": self.replay,
        } | ({} if self.nonzero_span is None else {"nonzero_span": list(self.nonzero_span)})

    @classmethod
    def from_json(cls, raw: Mapping[str, Any]) -> "DeepStackRecord":
        replay = raw.get("replay")
        if replay is not None and not isinstance(replay, bool):
            raise ValueError("replay must be true, false or null")
        return cls(
            shape=tuple(int(x) for x in raw["shape"]), dtype=str(raw["dtype"]),
            nonzero_rows=int(raw["nonzero_rows"]), l2_norm=float(raw["l2_norm"]),
            sha256=str(raw["sha256"]), action=str(raw["action"]), calls=int(raw.get("calls", 1)),
            replay=replay, nonzero_span=None if raw.get("nonzero_span") is None else (
                int(raw["nonzero_span"][0]), int(raw["nonzero_span"][1])),
        )


@dataclass(frozen=True)
class LeakWitness:
    """DeepStack rows an arm's requests read that an earlier request left in the engine's buffer.

    Seen in the model process: rows of an LM entry's real tokens that this entry did not write
    but that held DeepStack features when it ran (vLLM never clears its persistent DeepStack
    buffer after a step it replays whole). A correct engine never shows one.
    """

    rows: int  # the most such rows one LM entry read
    steps: int  # how many LM entries read such rows
    source_sha256: str | None = None  # the image (fixture sha256) whose request left them; None: unknown

    def merged(self, other: "LeakWitness | None") -> "LeakWitness":
        if other is None:
            return self
        return LeakWitness(max(self.rows, other.rows), self.steps + other.steps,
                           self.source_sha256 or other.source_sha256)

    def to_json(self) -> dict:
        return {"rows": self.rows, "steps": self.steps, "source_sha256": self.source_sha256}


@dataclass(frozen=True)
class InputFreshness:
    """One per-call input of one captured graph, over an arm's replays of it: the freshness witness
    (design §6, "Every input a graph reads, fresh for every request").

    Each replay reads rows of the input that a correct runner writes for the request in hand (which
    rows, per input, is the design's argument). A row is offending when this request's refresh did
    not write it (an earlier request left it: stale; nothing wrote it since the buffer was made, or
    the graph never reads the input the request supplied: unwritten) or wrote other values than the
    request supplies at the LM entry (miswritten). A correct runner shows none, whatever the answer.
    """

    graph: str  # "prefill 32", "context 32": the graph's kind and bucket
    input: str  # where the runner holds it: "input_embeds", "positions", "deepstack", "past_keys", ...
    replays: int  # replays of the graph that read it
    rows: int  # rows those replays read that a correct runner writes for their request (summed)
    stale: int = 0  # of them, rows an earlier request's write left
    unwritten: int = 0  # rows no write covered since the buffer was made, or supplied but never read
    miswritten: int = 0  # rows this request wrote, with other values than it supplies
    first: tuple[int, ...] = ()  # the first offending rows, of the first replay that had any
    left_by: str | None = None  # the image (fixture sha256) whose request left most stale rows; None: text
    # With --poison: rows that still held the sentinel after the request's refresh (the second
    # opinion, read from the buffer itself); None: not poisoned (poison off, or no sentinel fits it).
    poisoned: int | None = None

    @property
    def offending(self) -> int:
        return self.stale + self.unwritten + self.miswritten

    @property
    def fresh(self) -> bool:
        return not self.offending and not self.poisoned

    def merged(self, other: "InputFreshness") -> "InputFreshness":
        first = self.first or other.first
        poisoned = (None if self.poisoned is None and other.poisoned is None
                    else (self.poisoned or 0) + (other.poisoned or 0))
        return InputFreshness(
            self.graph, self.input, self.replays + other.replays, self.rows + other.rows, self.stale + other.stale,
            self.unwritten + other.unwritten, self.miswritten + other.miswritten, first,
            self.left_by if self.stale else other.left_by, poisoned)

    def inconsistency(self) -> str | None:
        if self.replays < 1 or min(self.rows, self.stale, self.unwritten, self.miswritten) < 0:
            return "a freshness record needs replays >= 1 and counts >= 0"
        if self.offending > self.rows:
            return f"{self.offending} offending rows of the {self.rows} read"
        if bool(self.first) != bool(self.offending) or len(self.first) > FIRST_OFFENDING_ROWS:
            return f"first must list 1..{FIRST_OFFENDING_ROWS} rows exactly when some row offends"
        if self.left_by is not None and not self.stale:
            return "left_by names a request, but no row is stale"
        if self.poisoned is not None and not 0 <= self.poisoned <= self.rows:
            return f"{self.poisoned} poisoned rows of the {self.rows} read"
        return None

    def to_json(self) -> dict:
        return {"graph": self.graph, "input": self.input, "replays": self.replays, "rows": self.rows,
                "stale": self.stale, "unwritten": self.unwritten, "miswritten": self.miswritten,
                "first": list(self.first), "left_by": self.left_by} | (
                    {} if self.poisoned is None else {"poisoned": self.poisoned})

    @classmethod
    def from_json(cls, raw: Mapping[str, Any]) -> "InputFreshness":
        """As `to_json` wrote it (an engine's channel; a results file goes through the loader)."""
        return cls(str(raw["graph"]), str(raw["input"]), int(raw["replays"]), int(raw["rows"]), int(raw["stale"]),
                   int(raw["unwritten"]), int(raw["miswritten"]), tuple(int(r) for r in raw["first"]),
                   raw.get("left_by"), None if raw.get("poisoned") is None else int(raw["poisoned"]))


FIRST_OFFENDING_ROWS = 8  # what a freshness record keeps of its offending rows


def merge_freshness(*records: "tuple[InputFreshness, ...]") -> tuple[InputFreshness, ...]:
    """One record per (graph, input), in the order they were first seen."""
    merged: dict[tuple[str, str], InputFreshness] = {}
    for record in (r for group in records for r in group):
        key = (record.graph, record.input)
        merged[key] = record if key not in merged else merged[key].merged(record)
    return tuple(merged.values())


# What a graph replay is checked on against the eager pass over its own padded shape (design §6):
# the last real row's logits (the next token), every real row's final hidden state, keys and values
# (per decoder layer: what decode reads, and where a departure first shows), and a vision-encoder
# graph's outputs.
CHECKED_TENSORS = ("logits", "hidden", "keys", "values", "encoder")
# Where a departure first shows: the embeddings (layer 0's input), the output of decoder layer k with
# DeepStack block k added after it or not (`L3`, `L0+DS0`: what fed the layer whose keys or values
# departed first), the final hidden state, the next-token logits, a vision-encoder graph's output.
DEPARTURE_POINT = re.compile(r"embeddings|L\d{1,4}(\+DS\d{1,4})?|final|logits|encoder")


@dataclass(frozen=True)
class TensorCheck:
    """One checked tensor over a request's graph replays: the largest |Δ| between a replay and the
    eager pass on its own padded shape, and the bound, the largest spread that repeats of that eager
    pass showed (0 where its kernels are deterministic)."""

    tensor: str
    delta: float
    bound: float

    def to_json(self) -> list:
        return [self.delta, self.bound]


@dataclass(frozen=True)
class GraphBound:
    """One tensor's bound for one graph: the spread repeats of the eager pass over that graph's shape
    showed, measured once per graph in a run (design §6), so every replay of it, in any arm, is held
    to the same bound."""

    graph: str  # "prefill 48", "context 48", "encoder grid 1x16x16"
    tensor: str
    bound: float


@dataclass(frozen=True)
class Departure:
    """Where a request's replay first left the eager pass on its own shape: beyond the bound, the
    graph path changed the computation."""

    replay: int  # which of the request's checked graph replays (0-based, in the order they ran)
    tensor: str  # one of CHECKED_TENSORS
    point: str  # DEPARTURE_POINT: the first place it shows
    position: int  # the first row beyond the bound: a prompt row (an encoder's: a patch row)
    delta: float
    bound: float

    def describe(self, replays: int) -> str:
        where = {"embeddings": "in the input embeddings", "final": "in the final hidden state",
                 "logits": "in the next-token logits", "encoder": "in the vision encoder's output"}.get(
            self.point, f"after {self.point} (the input of the next decoder layer)")
        which = f"replay {self.replay + 1} of {replays}" if replays > 1 else "the replay"
        return (f"{which} departs from eager on its own padded shape at row {self.position}, first {where} "
                f"({self.tensor} Δ {self.delta:.3g} > bound {self.bound:.3g})")

    def to_json(self) -> dict:
        return {"replay": self.replay, "tensor": self.tensor, "point": self.point, "position": self.position,
                "delta": self.delta, "bound": self.bound}


@dataclass(frozen=True)
class ReplayCheck:
    """A request's graph path judged against eager on the very shape it replayed (design §6): every
    replayed prefill (and vision-encoder graph) computed again eagerly on the exact padded inputs,
    compared tensor by tensor. Recorded in-process only; a server runs its own shapes."""

    replays: int  # graph replays checked
    tensors: tuple[TensorCheck, ...]  # in CHECKED_TENSORS order, those the replays had
    padding_noise: float | None  # max |Δ logits| of eager on the exact rows vs on the padded shape
    departure: Departure | None = None  # the first replay that left eager beyond the bound
    bounds: tuple[GraphBound, ...] = ()  # per graph it replayed, each tensor's bound (trust v7)

    def tensor(self, name: str) -> TensorCheck | None:
        return next((t for t in self.tensors if t.tensor == name), None)

    @classmethod
    def combined(cls, checks: Sequence["ReplayCheck"]) -> "ReplayCheck | None":
        """Several checks as one (a request's replays in the order they ran, or an arm's runs): the
        largest delta and bound per tensor, the largest padding noise, and the first departure,
        numbered among all the replays."""
        if not checks:
            return None
        found = [t for c in checks for t in c.tensors]
        tensors = tuple(TensorCheck(n, max(t.delta for t in found if t.tensor == n),
                                    max(t.bound for t in found if t.tensor == n))
                        for n in CHECKED_TENSORS if any(t.tensor == n for t in found))
        noise = [c.padding_noise for c in checks if c.padding_noise is not None]
        departure, offset = None, 0
        for check in checks:
            if departure is None and check.departure is not None:
                departure = replace(check.departure, replay=check.departure.replay + offset)
            offset += check.replays
        bounds = tuple(dict.fromkeys(b for c in checks for b in c.bounds))  # each once, in the order seen
        return cls(offset, tensors, max(noise) if noise else None, departure, bounds)

    def inconsistency(self) -> str | None:
        names = [t.tensor for t in self.tensors]
        if self.replays < 1 or not names or names != [n for n in CHECKED_TENSORS if n in names]:
            return f"a replay check needs replays >= 1 and its tensors once each, in the order {CHECKED_TENSORS}"
        if (any(t.delta < 0 or t.bound < 0 for t in self.tensors) or any(b.bound < 0 for b in self.bounds)
                or (self.padding_noise or 0) < 0):
            return "a replay check's deltas, bounds and padding noise are >= 0"
        problem = self._bounds_problem()
        if problem:
            return problem
        departed = [t.tensor for t in self.tensors if t.delta > t.bound]
        d = self.departure
        if d is None:
            return (None if not departed else
                    f"its {departed[0]} replay delta exceeds its bound, but no departure is recorded")
        found = self.tensor(d.tensor)
        if found is None or not 0 <= d.replay < self.replays or d.position < 0 or not DEPARTURE_POINT.fullmatch(d.point):
            return "its departure names no checked tensor, replay, row or point of it"
        if not (found.bound >= d.bound and found.delta >= d.delta > d.bound):
            return (f"its departure ({d.tensor} Δ {d.delta:g} > {d.bound:g}) is not within the {d.tensor} "
                    f"deltas and bounds it records ({found.delta:g}, {found.bound:g})")
        return None

    def _bounds_problem(self) -> str | None:
        """Each tensor's bound is the largest of its graphs' (when they are recorded), one per graph."""
        seen: dict[tuple[str, str], float] = {}
        for b in self.bounds:
            if seen.setdefault((b.graph, b.tensor), b.bound) != b.bound:
                return f"bounds[{b.graph!r}] gives {b.tensor} two bounds: one graph has one bound per tensor"
        for t in self.tensors:  # which tensors must have bounds is the check's shape (trust/requirements.py)
            graphs = [b.bound for b in self.bounds if b.tensor == t.tensor]
            if graphs and max(graphs) != t.bound:
                return (f"its {t.tensor} bound {t.bound:g} is not the largest of its graphs' "
                        f"({', '.join(f'{g:g}' for g in graphs)})")
        return None

    def to_json(self) -> dict:
        bounds: dict[str, dict[str, float]] = {}
        for b in self.bounds:
            bounds.setdefault(b.graph, {})[b.tensor] = b.bound
        return {"replays": self.replays, "tensors": {t.tensor: t.to_json() for t in self.tensors},
                "padding_noise": self.padding_noise,
                "departure": None if self.departure is None else self.departure.to_json()} | (
                    {"bounds": bounds} if bounds else {})


@dataclass(frozen=True)
class ChunkRun:
    """One prefill of part of a prompt (a chunk, or what a prefix-cache hit left): its rows
    `[start, end)`, the bucket it replayed in (None: eager) and how many of its rows are image rows."""

    start: int
    end: int
    bucket: int | None
    image_rows: int

    def to_json(self) -> list:
        return [self.start, self.end, self.bucket, self.image_rows]


@dataclass(frozen=True)
class EncoderRun:
    """How one image went through the vision-encoder graphs: its grid (t, h, w in patches), its
    patch count, the graph key, and whether an existing graph was replayed (False: captured for it)."""

    grid: tuple[int, int, int]
    patches: int
    key: str
    replayed: bool

    def to_json(self) -> dict:
        return {"grid": list(self.grid), "patches": self.patches, "key": self.key, "replayed": self.replayed}


@dataclass(frozen=True)
class BatchRun:
    """The forward a request's prefill (its last part, when it ran in chunks) shared with other
    requests: the session's serial of that forward, the bucket it replayed in (None: eager), how many
    requests and rows it held, and this request's rows `[start, end)` in it."""

    forward: int
    bucket: int | None
    requests: int
    rows: int
    start: int
    end: int

    def to_json(self) -> dict:
        return {"forward": self.forward, "bucket": self.bucket, "requests": self.requests, "rows": self.rows,
                "own": [self.start, self.end]}

    def inconsistency(self) -> str | None:
        if self.forward < 1 or self.requests < 1 or not 0 <= self.start < self.end <= self.rows:
            return "a batch needs forward >= 1, requests >= 1 and its own rows [start, end) within the forward's"
        if self.bucket is not None and self.rows > self.bucket:
            return f"its forward's {self.rows} rows do not fit the bucket of {self.bucket} it replayed in"
        return None


def image_span(prompt_ids: Sequence[int], visual_token_ids: Collection[int]) -> tuple[int, int] | None:
    """The rows [first, last + 1) of a prompt's image or video tokens (a video's timestamps between
    its frames included), or None."""
    rows = [i for i, token in enumerate(prompt_ids) if token in visual_token_ids]
    return (rows[0], rows[-1] + 1) if rows else None


@dataclass(frozen=True)
class ServingEvidence:
    """What a family scenario's serving path did for one request, recorded as it ran (design §10):
    the proof that the request reached the path its scenario is about."""

    chunks: tuple[ChunkRun, ...] = ()  # the prompt's prefills when it ran in parts; () when whole
    cached_tokens: int = 0  # prompt rows taken from the prefix cache
    image_span: tuple[int, int] | None = None  # the prompt's image rows [first, last + 1)
    # The DeepStack buffer's rows at start-up and after it grew, once it has grown (by this request
    # or an earlier one of the session); None: it never grew.
    buffer_growth: tuple[int, int] | None = None
    # Its first replay's graph existed before it arrived, captured at start-up or by a request without
    # DeepStack (a server's warm-up); None: it did not replay.
    graph_ready: bool | None = None
    encoder: EncoderRun | None = None  # its image's pass through the encoder graphs
    prompt_tokens: int | None = None  # the rows of the prompt these chunks serve (v5); None: not recorded
    batch: BatchRun | None = None  # the forward its prefill shared (the batch scenario); None: not batched

    def to_json(self) -> dict:
        return {"chunks": [c.to_json() for c in self.chunks], "cached_tokens": self.cached_tokens,
                "prompt_tokens": self.prompt_tokens,
                "image_span": None if self.image_span is None else list(self.image_span),
                "buffer_growth": None if self.buffer_growth is None else list(self.buffer_growth),
                "graph_ready": self.graph_ready,
                "encoder": None if self.encoder is None else self.encoder.to_json()} | (
                    {} if self.batch is None else {"batch": self.batch.to_json()})

    def inconsistency(self) -> str | None:
        if self.batch is not None and self.batch.inconsistency():
            return self.batch.inconsistency()
        last = self.chunks[-1] if self.chunks else None
        if self.batch is not None and last is not None and self.batch.end - self.batch.start != last.end - last.start:
            return (f"its batch rows [{self.batch.start}, {self.batch.end}) are not as many as its last prefill's "
                    f"[{last.start}, {last.end})")
        ends = [c.start for c in self.chunks[1:]]
        if any(c.end <= c.start or c.image_rows > c.end - c.start for c in self.chunks):
            return "a chunk must have start < end and at most end - start image rows"
        if ends != [c.end for c in self.chunks[:-1]] or (self.chunks and self.chunks[0].start != self.cached_tokens):
            return "chunks must follow each other from the cached tokens on"
        if any(c.bucket is not None and c.bucket < c.end - c.start for c in self.chunks):
            return "a chunk replayed in a bucket smaller than itself"
        if self.buffer_growth is not None and not 0 < self.buffer_growth[0] < self.buffer_growth[1]:
            return "a buffer growth must go from a smaller to a larger, positive size"
        return self._tiling_inconsistency()

    def _tiling_inconsistency(self) -> str | None:
        """The chunks and the cache hit cover the prompt exactly, and its image rows lie inside it."""
        total = self.prompt_tokens
        if total is None:
            return None
        if self.cached_tokens >= total:
            return f"cached_tokens {self.cached_tokens} leave none of the {total}-token prompt to compute"
        if self.chunks and self.chunks[-1].end != total:
            return (f"its chunks cover rows [{self.cached_tokens}, {self.chunks[-1].end}) of a {total}-token prompt, "
                    "not all of it")
        if self.image_span is not None and not 0 <= self.image_span[0] < self.image_span[1] <= total:
            return f"image_span {list(self.image_span)} is not inside the {total}-token prompt"
        return None


@dataclass(frozen=True)
class RankEvidence:
    """One model process's share of an arm's evidence: with tensor parallelism every rank runs the
    request, and each one's tap must have fired and its prefill replayed (design §8)."""

    rank: str  # how the server named the process: "TP1 (pid 4242)"
    lm_calls: int
    replayed_calls: int
    prefill_replayed: bool | None
    buckets: tuple[int, ...]
    tap_calls: int
    sha256: str | None = None  # fingerprint of the first DeepStack rows its tap saw; None: none

    def to_json(self) -> dict:
        return {"rank": self.rank, "lm_calls": self.lm_calls, "replayed_calls": self.replayed_calls,
                "prefill_replayed": self.prefill_replayed, "buckets": list(self.buckets),
                "tap_calls": self.tap_calls, "sha256": self.sha256}


def combine_ranks(ranks: tuple[RankEvidence, ...], prompt_tokens: int | None = None,
                  max_bucket: int | None = None, leak: LeakWitness | None = None) -> "Evidence":
    """One arm's evidence from its ranks', each field read the way its rule needs every rank: the
    prefill replayed only where every rank's did, the tap fired only where every rank's did (the
    fewest tap calls), a replay anywhere counts (an eager arm that replayed on one rank replayed),
    and every bucket any rank replayed in is checked against the policy. A leak witness is the
    arm's, not a rank's: it is carried as given."""
    shown = [r.prefill_replayed for r in ranks]
    replayed = False if False in shown else (None if None in shown else True)
    return Evidence(
        lm_calls=max(r.lm_calls for r in ranks), replayed_calls=max(r.replayed_calls for r in ranks),
        prefill_replayed=replayed, buckets=tuple(sorted({b for r in ranks for b in r.buckets})),
        tap_calls=min(r.tap_calls for r in ranks), prompt_tokens=prompt_tokens, max_bucket=max_bucket,
        leak=leak, ranks=tuple(ranks),
    )


@dataclass(frozen=True)
class Evidence:
    """How an arm's requests were executed, counted by the backend as they ran (design §4)."""

    lm_calls: int  # LM entries: prefills and decode steps
    replayed_calls: int  # of those, how many ran by graph replay
    # Whether every prefill that carried a prompt ran by graph replay; None: the backend cannot tell.
    prefill_replayed: bool | None
    buckets: tuple[int, ...]  # the buckets the prefill replays used
    tap_calls: int  # LM entries where the tap saw DeepStack rows
    prompt_tokens: int | None = None  # of the request, for the verdict's reason
    max_bucket: int | None = None  # the largest bucket the path under test could replay in
    leak: LeakWitness | None = None  # stale DeepStack rows read (engines that can tell); None: none seen
    ranks: tuple[RankEvidence, ...] = ()  # each rank's share, when more than one ran the arm
    serving: ServingEvidence | None = None  # a family scenario's serving path (design §10); None: none
    replay_check: ReplayCheck | None = None  # the replays against eager on their own shape (in-process)
    freshness: tuple[InputFreshness, ...] = ()  # every input its replayed graphs read (in-process)

    def merged(self, other: "Evidence") -> "Evidence":
        """One arm's evidence over several runs of it (`--repeat`): every prefill must have replayed."""
        if self.prefill_replayed is False or other.prefill_replayed is False:
            replayed: bool | None = False
        elif self.prefill_replayed is None or other.prefill_replayed is None:
            replayed = None
        else:
            replayed = True
        return Evidence(
            lm_calls=self.lm_calls + other.lm_calls,
            replayed_calls=self.replayed_calls + other.replayed_calls,
            prefill_replayed=replayed,
            buckets=tuple(sorted(set(self.buckets) | set(other.buckets))),
            tap_calls=self.tap_calls + other.tap_calls,
            prompt_tokens=self.prompt_tokens if self.prompt_tokens is not None else other.prompt_tokens,
            max_bucket=self.max_bucket if self.max_bucket is not None else other.max_bucket,
            leak=other.leak if self.leak is None else self.leak.merged(other.leak),
            serving=self.serving if self.serving is not None else other.serving,  # each run's stays with it
            replay_check=ReplayCheck.combined([c for c in (self.replay_check, other.replay_check) if c is not None]),
            freshness=merge_freshness(self.freshness, other.freshness),
        )

    def inconsistency(self) -> str | None:
        """Why these counts cannot describe one real execution, or None."""
        if min(self.lm_calls, self.replayed_calls, self.tap_calls) < 0:
            return "counts must be >= 0"
        if self.replayed_calls > self.lm_calls:
            return f"replayed_calls {self.replayed_calls} > lm_calls {self.lm_calls}"
        if self.tap_calls > self.lm_calls:
            return f"tap_calls {self.tap_calls} > lm_calls {self.lm_calls}"
        if self.prefill_replayed and self.replayed_calls == 0:
            return "prefill_replayed is true but no LM entry was replayed"
        # Buckets are those of replayed prefills; an engine may also replay decode steps (vLLM).
        if self.buckets and self.replayed_calls == 0:
            return "buckets are listed but no LM entry was replayed"
        if self.prefill_replayed and not self.buckets:
            return "prefill_replayed is true but no bucket is listed"
        if any(b <= 0 for b in self.buckets):
            return "bucket sizes must be > 0"
        if self.leak is not None and (self.leak.rows <= 0 or self.leak.steps <= 0 or self.leak.steps > self.lm_calls):
            return "a leak witness needs rows > 0 and 1..lm_calls steps"
        if self.replay_check is not None:
            problem = self.replay_check.inconsistency()
            if problem:
                return problem
            if self.replay_check.replays < self.replayed_calls:
                return (f"replay_check covers {self.replay_check.replays} graph replay(s) of the "
                        f"{self.replayed_calls} LM entries replayed")
        for record in self.freshness:
            problem = record.inconsistency()
            if problem:
                return f"freshness of {record.input!r} in the {record.graph} graph: {problem}"
        if len({(r.graph, r.input) for r in self.freshness}) < len(self.freshness):
            return "a graph's input has more than one freshness record"
        if self.serving is not None:
            problem = self.serving.inconsistency()
            if problem:
                return problem
            # The chunks are the generation's prefills; the arm also holds its scoring requests'.
            replayed = [c.bucket for c in self.serving.chunks if c.bucket is not None]
            if not set(replayed) <= set(self.buckets) or (self.prefill_replayed and len(replayed) < len(self.serving.chunks)):
                return ("its chunks' buckets are not among the arm's buckets, or prefill_replayed is true but a "
                        "chunk ran eagerly")
        return self._rank_inconsistency()

    def _rank_inconsistency(self) -> str | None:
        if not self.ranks:
            return None
        if len({r.sha256 for r in self.ranks if r.sha256}) > 1:
            return "its ranks' DeepStack fingerprints differ (a run gives such an arm an error, not evidence)"
        if combine_ranks(self.ranks, self.prompt_tokens, self.max_bucket, self.leak) != self:
            return "the arm's counts are not those of its ranks (every rank must show the tap and the replay)"
        return None

    def to_json(self) -> dict:
        return {
            "lm_calls": self.lm_calls, "replayed_calls": self.replayed_calls,
            "prefill_replayed": self.prefill_replayed, "buckets": list(self.buckets),
            "tap_calls": self.tap_calls, "prompt_tokens": self.prompt_tokens, "max_bucket": self.max_bucket,
        } | ({} if self.leak is None else {"leak": self.leak.to_json()}) | (
            {"ranks": [r.to_json() for r in self.ranks]} if self.ranks else {}) | (
            {} if self.serving is None else {"serving": self.serving.to_json()}) | (
            {} if self.replay_check is None else {"replay_check": self.replay_check.to_json()}) | (
            {"freshness": [r.to_json() for r in self.freshness]} if self.freshness else {})
