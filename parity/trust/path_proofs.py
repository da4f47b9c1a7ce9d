"""Every field a family scenario's path proof reads, derived from or checked against the rest of the
file (design §10, v6).

Rule 5b decides from `evidence.serving` whether a request reached its scenario's path: image rows
in two chunks or more, a cache hit, a grown buffer, a warm graph, an encoder graph. v5 held the
chunks to the prompt and the chunk size; each of those proofs was still one self-reported number
away from a flip (two image-row counts turned an INCONCLUSIVE chunked file into a PASS). Here every
such number must agree with another record of the same fact: image rows with the image span, the
span with the DeepStack record, a growth with the captured buckets and the prompt that grew the
buffer, a warm graph with the runner that captured it, an encoder graph's key and grid with its
patches and its image, a cache hit with the earlier request it came from. Torch-free.
"""

from __future__ import annotations

import math
from typing import Callable, Iterator

from parity import registry
from parity.evidence import EncoderRun, ServingEvidence
from parity.plan.entries import read_plan
from parity.preset_tokenizer import first_image_row
from parity.presets import PRESETS
from parity.results import ArmResult, RunResult
from parity.trust.consistency import _ran, _Request, _requests, _spec
from parity.trust.serving import _runs

# The runner that captures a bucket's graph on the first request that needs it (design §10, warmup).
CAPTURES_ON_FIRST_USE = "warmup-specialized"
# The runner whose encoder graphs are keyed by patch count alone (design §10, layout).
KEYED_BY_PATCHES = "layout-keyed"


def _served(run: RunResult) -> Iterator[tuple[_Request, ArmResult, str, ServingEvidence, int | None]]:
    """(request, arm, JSON path of its serving evidence, the evidence, the run's prompt tokens)."""
    for request in _requests(run):
        for arm in _ran(request):
            for where, evidence in _runs(arm):
                if evidence.serving is not None:
                    yield request, arm, f"{request.at(arm)}.{where}.serving", evidence.serving, evidence.prompt_tokens


def _overlap(start: int, end: int, span: tuple[int, int] | None) -> int:
    return 0 if span is None else max(0, min(end, span[1]) - max(start, span[0]))


def image_rows_are_the_image_span(run: RunResult) -> None:
    """A chunk's image rows are its rows inside the image span (a video's span holds its timestamps
    too, so there at most); in-process, where parity's tap records the whole prompt, the span of an
    image is the rows its DeepStack record saw. A text-only request has neither."""
    in_process = registry.of_run(run.config).in_process
    for request, arm, where, serving, _ in _served(run):
        span = serving.image_span
        if request.fixture is None and span is not None:
            raise request.contradiction(arm, f"{where}.image_span is {list(span)}, but the request has no image")
        video = request.fixture is not None and request.fixture.frames > 0
        for i, chunk in enumerate(serving.chunks):
            inside = _overlap(chunk.start, chunk.end, span)
            if chunk.image_rows > inside or (not video and in_process and chunk.image_rows != inside):
                raise request.contradiction(
                    arm, f"{where}.chunks[{i}] has {chunk.image_rows} image rows, but [{chunk.start}, {chunk.end}) holds "
                         f"{inside} row(s) of the image span {None if span is None else list(span)}")
        record = arm.deepstack_record
        # A video's span holds its timestamps too, so its chunks are held to the record instead (v7):
        # in-process the tap sees every computed row, and the chunks' image rows are the record's, split.
        if in_process and video and serving.chunks and record is not None and not serving.cached_tokens:
            counted = sum(chunk.image_rows for chunk in serving.chunks)
            if counted != record.nonzero_rows:
                raise request.contradiction(
                    arm, f"{where}.chunks hold {counted} image rows in all, but the arm's DeepStack record saw "
                         f"{record.nonzero_rows} non-zero rows of the prompt")
        if in_process and not video and span is not None and record is not None and record.nonzero_rows != span[1] - span[0]:
            raise request.contradiction(
                arm, f"{where}.image_span {list(span)} holds {span[1] - span[0]} rows, but the arm's DeepStack record saw "
                     f"{record.nonzero_rows} non-zero rows of the prompt")
        # Where the rows sit (trust v7): in-process the tap saw the whole prompt and recorded where its
        # non-zero rows were, so an image's span is exactly there, and a video's holds them.
        if in_process and span is not None and record is not None and record.nonzero_rows:
            held = record.nonzero_span
            if held is None or (held != span if not video else not span[0] <= held[0] < held[1] <= span[1]):
                raise request.contradiction(
                    arm, f"{where}.image_span is {list(span)}, but the arm's DeepStack record saw its non-zero rows at "
                         f"{'no recorded rows' if held is None else list(held)}")


def image_spans_start_where_the_template_puts_them(run: RunResult) -> None:
    """An embedded preset's chat template is parity's own, so where it puts an image's first row is
    recomputed from the request's prompt (`parity.preset_tokenizer`), not read from the file (trust
    v7). Not recomputed: a checkpoint's template (its tokenizer may not be on the machine that
    judges), a video's (the processor puts timestamps before its frames) and a server's spans; those
    are held by `one_span_per_image_size` and, in-process, the DeepStack record's rows."""
    if run.config.get("model") not in PRESETS or not registry.of_run(run.config).in_process:
        return
    for request, arm, where, serving, _ in _served(run):
        span = serving.image_span
        if span is None or request.fixture is None or request.fixture.frames:
            continue
        start = first_image_row(request.prompt)
        if span[0] != start:
            raise request.contradiction(
                arm, f"{where}.image_span starts at row {span[0]}, but {run.config['model']}'s chat template puts "
                     f"an image's first row at {start} for this prompt")


def one_span_per_image_size(run: RunResult) -> None:
    """An image's rows sit where the chat template puts them, after the same text whatever the
    prompt, and an image's size fixes their count: every request with an image (or video) of one
    size and frame count records the same image span, in every arm, scenario and case."""
    spans: dict[tuple, tuple[str, tuple[int, int]]] = {}
    for request, arm, where, serving, _ in _served(run):
        if request.fixture is None or serving.image_span is None:
            continue
        key = (tuple(request.fixture.size), request.fixture.frames)
        first = spans.setdefault(key, (where, serving.image_span))
        if first[1] != serving.image_span:
            raise request.contradiction(
                arm, f"{where}.image_span is {list(serving.image_span)}, but {first[0]}.image_span, of an image of the "
                     f"same size, is {list(first[1])}: the template puts an image's rows in one place")


def prompts_are_the_evidence(run: RunResult) -> None:
    """The prompt serving evidence covers is the arm's (in-process, where parity counts both), and no
    longer than the plan's for its case, on every backend."""
    in_process = registry.of_run(run.config).in_process
    try:
        planned = {entry.id: entry.prompt_tokens for entry in read_plan(run.config)}
    except ValueError:
        planned = {}  # the loader has refused the plan already
    for request, arm, where, serving, prompt_tokens in _served(run):
        if in_process and prompt_tokens is not None and serving.prompt_tokens != prompt_tokens:
            raise request.contradiction(arm, f"{where}.prompt_tokens is {serving.prompt_tokens}, but the arm's evidence "
                                             f"records a {prompt_tokens}-token prompt")
        limit = planned.get(request.case.id)
        if limit is not None and serving.prompt_tokens is not None and serving.prompt_tokens > limit:
            raise request.contradiction(arm, f"{where}.prompt_tokens is {serving.prompt_tokens}, longer than the {limit} "
                                             f"tokens config.plan plans for {request.case.id}")


def graph_readiness_is_the_runners(run: RunResult) -> None:
    """A warm graph needs a graph: it is recorded only where something replayed (an eager arm that
    replayed, a runner bug, is rule 4's). In-process it is the runner's: every graph is captured at
    start-up, so a request's first prefill found its graph warm exactly when it replayed; the runner
    that captures on first use found one warm only in a bucket a request without DeepStack replayed."""
    in_process = registry.of_run(run.config).in_process
    runner = run.config.get("runner")
    text_buckets = {b for request in _requests(run) if request.fixture is None for arm in _ran(request)
                    if arm.mode == "bcg" for _, evidence in _runs(arm) for b in evidence.buckets}
    for request, arm, where, serving, _ in _served(run):
        ready = serving.graph_ready
        if ready is None:
            continue
        if ready and not _buckets(arm):
            raise request.contradiction(arm, f"{where}.graph_ready is {str(ready).lower()}, but the arm replayed no "
                                             "graph")
        first = serving.chunks[0].bucket if serving.chunks else _buckets(arm)[0]
        if not in_process:
            continue
        if runner == CAPTURES_ON_FIRST_USE:
            why = None if not ready or first in text_buckets else "no request without DeepStack replayed its bucket"
        else:
            why = None if ready == (first is not None) else (
                "every graph is captured at start-up, and its first prefill "
                + ("replayed" if first is not None else "ran eagerly"))
        if why is not None:
            raise request.contradiction(arm, f"{where}.graph_ready is {str(ready).lower()}, but {why} "
                                             f"(runner {runner!r})")


def _buckets(arm: ArmResult) -> tuple[int, ...]:
    return arm.evidence.buckets if arm.evidence is not None else ()


def buffer_growth_is_the_grown_prompts(run: RunResult) -> None:
    """A grown DeepStack buffer grew for a prompt past every bucket: in-process from the largest
    captured bucket (the slot's size at start-up) to a prompt some graph arm of the run served
    eagerly; on every backend no larger than the longest planned prompt."""
    in_process = registry.of_run(run.config).in_process
    captured = run.config.get("captured_buckets")
    largest = max(captured) if isinstance(captured, list) and captured else None
    try:
        planned = max((entry.prompt_tokens for entry in read_plan(run.config)), default=None)
    except ValueError:
        planned = None
    grown_prompts = {evidence.prompt_tokens for request in _requests(run) for arm in _ran(request)
                     if arm.mode == "bcg" for _, evidence in _runs(arm) if not evidence.replayed_calls}
    for request, arm, where, serving, _ in _served(run):
        growth = serving.buffer_growth
        if growth is None:
            continue
        start, end = growth
        if planned is not None and end > planned:
            raise request.contradiction(arm, f"{where}.buffer_growth grew to {end} rows, more than the longest planned "
                                             f"prompt ({planned} tokens)")
        if in_process and (start != largest or end not in grown_prompts):
            raise request.contradiction(
                arm, f"{where}.buffer_growth is {list(growth)}, but the buffer starts at the largest captured bucket "
                     f"({largest}) and grows to a prompt a graph arm served eagerly "
                     f"({sorted(p for p in grown_prompts if p is not None) or 'none'})")


def encoder_graphs_are_their_images(run: RunResult) -> None:
    """An encoder graph ran for an image, over grid t x h x w patches, shaped as the
    image (wider grid, wider image), with as many patches per DeepStack row as every other image of
    the run (the merge size squared); in-process its key is its grid (its patch count, for the runner
    keyed by patches), and a key the request's earlier requests already used was a replay."""
    in_process = registry.of_run(run.config).in_process
    per_row: set[int] = set()
    seen: dict[tuple[int, str], list[str]] = {}
    for request, arm, where, serving, _ in _served(run):
        encoder = serving.encoder
        if encoder is None:
            continue
        fixture = request.fixture
        problem = _encoder_problem(encoder, arm, fixture, serving, per_row)
        if problem is None and in_process:
            key = (f"{encoder.patches} patches" if run.config.get("runner") == KEYED_BY_PATCHES
                   else "grid {}x{}x{}".format(*encoder.grid))
            earlier = seen.setdefault((request.case_index, arm.name), [])
            if encoder.key != key:
                problem = f"its key is {encoder.key!r}, but runner {run.config.get('runner')!r} keys it {key!r}"
            elif encoder.key in earlier and not encoder.replayed:
                problem = f"its key {encoder.key!r} was captured by an earlier request of the case, yet it is not a replay"
            earlier.append(encoder.key)
        if problem is not None:
            raise request.contradiction(arm, f"{where}.encoder: {problem}")


def _encoder_problem(encoder: EncoderRun, arm: ArmResult, fixture, serving: ServingEvidence,
                     per_row: set[int]) -> str | None:
    t, h, w = encoder.grid
    if fixture is None:
        return "an encoder graph ran for a request without an image"
    if encoder.patches != t * h * w:
        return f"{encoder.patches} patches, but grid {t}x{h}x{w} holds {t * h * w}"
    width, height = fixture.size
    if (width > height, width < height) != (w > h, w < h):
        return f"grid {t}x{h}x{w} is not shaped as the {width}x{height} image"
    span = serving.image_span
    if fixture.frames == 0 and span is not None:
        rows = span[1] - span[0]
        ratio = encoder.patches // rows if rows else 0
        if not rows or encoder.patches % rows or math.isqrt(ratio) ** 2 != ratio:
            return f"{encoder.patches} patches for {rows} image rows: not a square merge of patches into rows"
        per_row.add(ratio)
        if len(per_row) > 1:
            return f"{ratio} patches per image row, where another image of the run has {min(per_row - {ratio})}"
    return None


def cache_hits_come_from_earlier_requests(run: RunResult) -> None:
    """Prompt rows come from the prefix cache only for a request served with it, in whole pages
    in-process, and never more than an earlier request of the case put there: one with the same
    image, in the same mode, whose prompt was at least that long. The sequence's first request
    starts on an emptied cache."""
    in_process = registry.of_run(run.config).in_process
    page = run.config.get("prefix_cache_page")
    filled: dict[tuple[int, str], list[tuple[str | None, int]]] = {}
    for request, arm, where, serving, _ in _served(run):
        spec = _spec(request)
        earlier = filled.setdefault((request.case_index, arm.mode), [])
        cached = serving.cached_tokens
        image = None if request.fixture is None else request.fixture.sha256
        if cached:
            why = None
            if spec is None or not spec.serving.prefix_cache or spec.serving.empty_cache:
                why = "the request is not served from a filled prefix cache"
            elif in_process and isinstance(page, int) and cached % page:
                why = f"it is not a whole number of config.prefix_cache_page {page}-token pages"
            elif not any(i == image and tokens >= cached for i, tokens in earlier):
                why = "no earlier request of the case with its image and mode prefilled that many rows"
            if why is not None:
                raise request.contradiction(arm, f"{where}.cached_tokens is {cached}, but {why}")
        if ".repeats[" not in where and serving.prompt_tokens is not None:
            earlier.append((image, serving.prompt_tokens))


RULES: tuple[Callable[[RunResult], None], ...] = (
    image_rows_are_the_image_span, image_spans_start_where_the_template_puts_them, one_span_per_image_size,
    prompts_are_the_evidence, graph_readiness_is_the_runners, buffer_growth_is_the_grown_prompts,
    encoder_graphs_are_their_images, cache_hits_come_from_earlier_requests,
)
