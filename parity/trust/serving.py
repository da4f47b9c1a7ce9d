"""A family scenario's serving evidence held to the run it claims to be from (design §10, v5).

Rule 5b reads `evidence.serving` to decide whether a request reached its scenario's path (chunks,
a cache hit, a grown buffer, an encoder graph). Evidence that only had to be well formed could be
rewritten to claim a path the run never took: chunks of 8 tokens in a run with `--chunk-size 1000`,
chunks that cover half the prompt, a buffer growth on an engine that has no growing buffer. Each
rule below holds the evidence to something else the file records: the prompt, the configured chunk
size, the arm's own replay count, the other mode's arm of the same request, and what the backend
declares it cannot reach. Torch-free.
"""

from __future__ import annotations

from typing import Callable, Iterator

from parity.design import PROVES_ENCODER_GRAPH, PROVES_GROWTH, PROVES_SHARED_FORWARD
from parity import registry
from parity.evidence import Evidence, ServingEvidence
from parity.results import ArmResult, RunResult
from parity.trust.consistency import _ran, _Request, _requests, _spec


def _runs(arm: ArmResult) -> Iterator[tuple[str, Evidence]]:
    """(JSON path suffix, evidence) of every run of the arm: the first, then each repeat's own."""
    if arm.evidence is not None:
        yield "evidence", arm.evidence
    for i, repeat in enumerate(arm.repeats):
        if repeat.evidence is not None:
            yield f"repeats[{i}].evidence", repeat.evidence


def _served(run: RunResult) -> Iterator[tuple[_Request, ArmResult, str, Evidence, ServingEvidence]]:
    for request in _requests(run):
        for arm in _ran(request):
            for where, evidence in _runs(arm):
                if evidence.serving is not None:
                    yield request, arm, f"{request.at(arm)}.{where}.serving", evidence, evidence.serving


def serving_names_its_prompt(run: RunResult) -> None:
    """Serving evidence says how long the prompt it serves is (v5), so that its chunks can be shown
    to tile it (`ServingEvidence.inconsistency`): without the length, any chunks would do."""
    for request, arm, where, _, serving in _served(run):
        if serving.prompt_tokens is None:
            raise request.contradiction(arm, f"{where}.prompt_tokens is missing: serving evidence records the prompt "
                                             "its chunks cover")


def chunks_within_the_chunk_size(run: RunResult) -> None:
    """A request served in chunks has none larger than `config.chunk_size`, and where parity cuts them
    itself every chunk but the last is exactly that size; a request served whole has at most one
    prefill."""
    size = run.config.get("chunk_size")
    exact = registry.of_run(run.config).in_process
    for request, arm, where, _, serving in _served(run):
        spec = _spec(request)
        # A batch's requests are served by the chunked servers, whose prefill budget may split any of them.
        if spec is None or not (spec.serving.chunked or spec.serving.batched):
            if len(serving.chunks) > 1:
                raise request.contradiction(arm, f"{where}.chunks has {len(serving.chunks)} prefills, but the request "
                                                 "is not served in chunks")
            continue
        if not (isinstance(size, int) and not isinstance(size, bool) and size >= 1):
            raise request.contradiction(arm, f"config.chunk_size is {size!r}, but {where} is of a request served "
                                             "in chunks of it")
        c = next((c for c in serving.chunks if c.end - c.start > size), None)
        if c is not None:
            raise request.contradiction(arm, f"{where}.chunks has [{c.start}, {c.end}), {c.end - c.start} tokens, "
                                             f"larger than config.chunk_size {size}")
        c = next((c for c in serving.chunks[:-1] if c.end - c.start != size), None) if exact else None
        if c is not None:
            raise request.contradiction(arm, f"{where}.chunks has [{c.start}, {c.end}), {c.end - c.start} tokens before "
                                             f"the last chunk: parity cuts chunks of config.chunk_size {size}")


def replays_are_the_replayed_chunks(run: RunResult) -> None:
    """Every chunk that replayed is a replay the arm counted: exactly its replays where parity counts
    every LM entry itself (the in-process backend), at least where a server's tap also counts the
    scoring requests' prefills and decode steps its engine replays."""
    exact = registry.of_run(run.config).in_process
    for request, arm, where, evidence, serving in _served(run):
        replayed = sum(c.bucket is not None for c in serving.chunks) if serving.chunks else int(
            bool(evidence.prefill_replayed))
        if evidence.replayed_calls < replayed or (exact and evidence.replayed_calls != replayed):
            raise request.contradiction(
                arm, f"{where} shows {replayed} replayed prefill(s), but {where.removesuffix('.serving')}.replayed_calls "
                     f"is {evidence.replayed_calls}")


def modes_agree_on_serving(run: RunResult) -> None:
    """The eager and the graph arm of one request, with the same DeepStack action, were served alike:
    the same prompt, cut into the same chunks (with the same image rows each) after the same cache
    hit. Only how each ran differs."""
    for request in _requests(run):
        arms = list(_ran(request))
        for arm in arms:
            if arm.mode != "bcg" or arm.evidence is None or arm.evidence.serving is None:
                continue
            eager = next((a for a in arms if a.mode == "eager" and a.deepstack == arm.deepstack), None)
            if eager is None or eager.evidence is None or eager.evidence.serving is None:
                continue
            mine, theirs = _layout(arm.evidence.serving), _layout(eager.evidence.serving)
            if mine != theirs:
                field = next(k for k in mine if mine[k] != theirs[k])
                raise request.contradiction(
                    arm, f"{request.at(arm)}.evidence.serving.{field} is {mine[field]}, but {eager.name}'s is "
                         f"{theirs[field]}: the two modes serve one request alike")


def _layout(serving: ServingEvidence) -> dict:
    return {"prompt_tokens": serving.prompt_tokens, "cached_tokens": serving.cached_tokens,
            "chunks": [[c.start, c.end, c.image_rows] for c in serving.chunks],
            "image_span": None if serving.image_span is None else list(serving.image_span)}


# What each path the backend may declare unreachable leaves in serving evidence when it was reached.
_REACHED: dict[str, Callable[[ServingEvidence], bool]] = {
    PROVES_GROWTH: lambda serving: serving.buffer_growth is not None,
    PROVES_ENCODER_GRAPH: lambda serving: serving.encoder is not None,
    PROVES_SHARED_FORWARD: lambda serving: serving.batch is not None and serving.batch.requests > 1,
}


def unreachable_paths_never_reached(run: RunResult) -> None:
    """A path the backend declares it has no way to reach (`BackendInfo.unreachable`) was not reached."""
    backend = registry.of_run(run.config)
    for request, arm, where, _, serving in _served(run):
        for path, why in backend.unreachable.items():
            if _REACHED[path](serving):
                raise request.contradiction(arm, f"{where} shows {path}, which the {backend.name} backend cannot "
                                                 f"reach: {why}")


def batches_tile_their_forwards(run: RunResult) -> None:
    """The requests of a case that name one forward (one arm name, one run of it) are as many as it
    says it held, all in its bucket, their rows side by side, tiling the forward's rows exactly: a
    forward claimed shared must have held them all."""
    forwards: dict[tuple, list[tuple[_Request, ArmResult, str, ServingEvidence]]] = {}
    for request, arm, where, _, serving in _served(run):
        if serving.batch is not None:
            which_run = where.removeprefix(request.at(arm))  # ".evidence.serving", ".repeats[i].evidence.serving"
            key = (request.case_index, arm.name, which_run, serving.batch.forward)
            forwards.setdefault(key, []).append((request, arm, where, serving))
    for members in forwards.values():
        request, arm, where, first = members[0]
        batch = first.batch
        alike = all((s.batch.requests, s.batch.rows, s.batch.bucket) == (batch.requests, batch.rows, batch.bucket)
                    for _, _, _, s in members)
        if len(members) != batch.requests or not alike:
            raise request.contradiction(arm, f"{where}.batch says forward {batch.forward} held {batch.requests} "
                                             f"request(s), {batch.rows} rows in bucket {batch.bucket}, but "
                                             f"{len(members)} of the case's requests name it, not all alike")
        spans = sorted((s.batch.start, s.batch.end) for _, _, _, s in members)
        ends = [0] + [end for _, end in spans]
        if [start for start, _ in spans] != ends[:-1] or ends[-1] != batch.rows:
            raise request.contradiction(arm, f"{where}.batch: forward {batch.forward}'s requests hold rows {spans}, "
                                             f"which do not tile its {batch.rows} rows")


RULES: tuple[Callable[[RunResult], None], ...] = (
    serving_names_its_prompt, chunks_within_the_chunk_size, replays_are_the_replayed_chunks, modes_agree_on_serving,
    unreachable_paths_never_reached, batches_tile_their_forwards,
)
