"""How the embedded engine serves one prompt's prefill, as a server does (design §10): the one
place that decides eager vs replay for a prefill (`LMExecutor`), which rows come from the prefix
cache and in which chunks the rest is computed, and what one mode keeps between requests
(`PromptServer`: the prefix cache, the vision-encoder graphs).

A server fills its prefix cache with every prompt it prefilled and matches new prompts against it
by whole pages; the rows after the hit are prefilled in chunks of at most the chunk size, each
attending to the cached rows and the chunks before it. Both modes schedule alike, so an eager
session is the reference for a graph session's every chunk.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Callable

import torch

from parity.backends.protocol import Request
from parity.runner.encoder_graphs import EncoderGraphs
from parity.evidence import (
    BatchRun, ChunkRun, EncoderRun, InputFreshness, ReplayCheck, ServingEvidence, image_span, merge_freshness,
)
from parity.runner.graph_runner import PrefillGraphRunner, Window, graph_label
from parity.runner.lm_body import Past
from parity.runner.packing import Member, Packed
from parity.runner.replay_check import ReplayChecker
from parity.models.qwen3_vl import PreparedPrompt, Qwen3VLAdapter
from parity.design import PAGE_TOKENS
from parity.runner.tap import apply_tap

TokenKey = tuple  # one prompt token as the cache matches it: (token id, image sha256 or None)


@dataclass
class PrefixCache:
    """Prompts already prefilled, with their keys and values `[T, layers, kv_heads, head_dim]`,
    apart per DeepStack action: a zeroed-DeepStack prefill leaves other keys and values."""

    page: int = PAGE_TOKENS
    _entries: dict[str, list[tuple[tuple[TokenKey, ...], torch.Tensor, torch.Tensor]]] = field(default_factory=dict)

    def lookup(self, action: str, key: tuple[TokenKey, ...]
               ) -> tuple[int, torch.Tensor | None, torch.Tensor | None]:
        """(cached rows, their keys, their values) for the longest whole-page match, leaving at
        least one row to compute (its logits are the answer's first token)."""
        best, found = 0, None
        for entry in self._entries.get(action, ()):
            common = next((i for i, (a, b) in enumerate(zip(entry[0], key)) if a != b), min(len(entry[0]), len(key)))
            if common > best:
                best, found = common, entry
        cached = min(best, len(key) - 1) // self.page * self.page
        if not cached:
            return 0, None, None
        return cached, found[1][:cached], found[2][:cached]

    def insert(self, action: str, key: tuple[TokenKey, ...], keys: torch.Tensor, values: torch.Tensor) -> None:
        self._entries.setdefault(action, []).append((key, keys, values))

    def empty(self, action: str) -> None:
        self._entries.pop(action, None)


def token_keys(input_ids: torch.Tensor, image_token_id: int | None, image_sha256: str | None) -> tuple[TokenKey, ...]:
    """The prompt as the cache matches it: image (or video) tokens by their pixels, since the same
    placeholder id stands for every image."""
    return tuple((int(t), image_sha256 if int(t) == image_token_id else None) for t in input_ids.tolist())


def schedule(total: int, cached: int, chunk: int | None) -> tuple[Window, ...]:
    """The prefills of a `total`-row prompt after `cached` rows: one, or chunks of `chunk` rows."""
    step = chunk or total
    return tuple(Window(start, min(start + step, total), cached) for start in range(cached, total, step))


@dataclass(frozen=True)
class Prefill:
    """One prompt prefill's outputs (real rows only) and how it ran."""

    hidden: torch.Tensor  # [T, H]
    keys: torch.Tensor  # [T, layers, kv_heads, head_dim]
    values: torch.Tensor
    bucket: int | None  # the bucket it replayed in; None: eager
    check: ReplayCheck | None = None  # a replay against eager on its own shape (design §6)
    freshness: tuple[InputFreshness, ...] = ()  # its replay's inputs and their rows not written for it


def replay_checker(adapter: Qwen3VLAdapter) -> ReplayChecker:
    """A checker of replays against eager, naming each probe point as the body's layers do."""
    body = adapter.body
    return ReplayChecker(adapter.lm_head, lambda layer: f"L{layer}" + (
        "" if body.deepstack_block_after(layer) is None else f"+DS{body.deepstack_block_after(layer)}"))


class LMExecutor:
    """The one place that decides eager vs replay for a prefill; in graph mode, each replay is
    checked against eager on its own padded shape (design §6)."""

    def __init__(self, adapter: Qwen3VLAdapter, runner: PrefillGraphRunner | None,
                 checker: ReplayChecker | None = None) -> None:
        self.adapter = adapter
        self.runner = runner
        # `checker`: the run's, shared by its sessions, so a graph has one bound in every arm.
        self.checker = None if runner is None else checker or replay_checker(adapter)

    def will_replay(self, num_tokens: int, past: Past | None = None) -> bool:
        return (self.runner is not None and self.runner.can_replay(num_tokens)
                and (past is None or past.keys.shape[0] <= self.runner.context_rows))

    def prefill(self, prompt: PreparedPrompt, deepstack: torch.Tensor | None, probe: bool = False,
                window: Window | None = None, past: Past | None = None, owner: str | None = None):
        """(Prefill, probe points [T, P, H] or None): the whole prompt, or, with a `window`, its
        rows `[start, end)` after `past` (DeepStack is the whole prompt's either way). `owner`: the
        request's tag (its image's sha256), which names the rows it leaves in the DeepStack buffer."""
        embeds, positions = prompt.input_embeds, prompt.positions
        if window is not None:
            embeds, positions = embeds[window.start:window.end], positions[:, window.start:window.end]
        num_tokens = embeds.shape[0]
        rows = deepstack if window is None else window.of(deepstack)  # what a correct engine hands its LM
        bucket = check = None
        freshness: tuple[InputFreshness, ...] = ()
        if self.will_replay(num_tokens, past):
            outputs = self.runner.replay(embeds, positions, deepstack, probe=probe, window=window, past=past,
                                         owner=owner)
            bucket = self.runner.bucket_for(num_tokens)
            if not probe:
                check = self.checker.prefill(graph_label(bucket, past is not None), self.adapter.body, outputs,
                                             self.runner.padded_inputs(embeds, positions, rows, past),
                                             (embeds, positions, rows, past), 0 if window is None else window.start)
                freshness = self.runner.freshness(embeds, positions, rows, past)
        elif self.runner is not None:  # graph mode, no graph fits: eager, through the engine's buffer
            outputs = self.runner.eager(embeds, positions, deepstack, probe=probe, window=window, past=past,
                                        owner=owner)
        else:
            outputs = self.adapter.body(embeds, positions, rows, probe=probe, past=past)
        points = outputs[3] if probe else None
        return Prefill(outputs[0], outputs[1], outputs[2], bucket, check, freshness), points

    def prefill_packed(self, packed: Packed, starts: tuple[int, ...], probe: bool = False
                       ) -> tuple[tuple[Prefill, torch.Tensor | None], ...]:
        """Requests that share one forward (design §10, batch), in graph mode by one replay: per
        member (its rows starting at prompt row `starts[i]`), its outputs with its own check against
        eager and the forward's witness, and, with `probe`, its rows' probe points."""
        outputs = self.runner.replay_packed(packed, probe=probe)
        bucket = self.runner.bucket_for(packed.rows)
        checks: tuple[ReplayCheck | None, ...] = (None,) * len(packed.members)
        freshness: tuple[InputFreshness, ...] = ()
        if not probe:
            embeds, positions, rows = packed.embeds, packed.positions, packed.deepstack()
            past = packed.past(self.adapter.body.kv_shape)
            checks = self.checker.prefill_packed(
                graph_label(bucket, True), self.adapter.body, outputs,
                self.runner.padded_inputs(embeds, positions, rows, past), (embeds, positions, rows, past),
                tuple((first, end, start) for (first, end), start in zip(packed.ranges, starts)))
            freshness = self.runner.freshness(embeds, positions, rows, past, packed.spans)
        split = [packed.split(t) for t in outputs]
        points = split[3] if probe else [None] * len(packed.members)
        return tuple((Prefill(hidden, keys, values, bucket, check, freshness), p)
                     for hidden, keys, values, check, p in zip(*split[:3], checks, points))


@dataclass(frozen=True)
class Served:
    """A prompt's whole prefill as the engine scheduled it: the last part's outputs with every
    row's keys and values, the buckets its parts replayed in, and the serving path's evidence."""

    prefill: Prefill
    parts: int
    buckets: tuple[int | None, ...]
    serving: ServingEvidence | None
    points: torch.Tensor | None = None  # with probe: [computed rows, P, H], the rows not from the cache
    checks: tuple[ReplayCheck, ...] = ()  # its graph replays against eager on their own shape, in order
    freshness: tuple[InputFreshness, ...] = ()  # every input its parts' replays read, and how fresh

    @property
    def replay_check(self) -> ReplayCheck | None:
        return ReplayCheck.combined(self.checks)


@dataclass
class _Parts:
    """A prompt's prefills so far, each after the rows before it: the keys and values of every row
    (a prefix hit's first), what each part ran as and its outputs, and whether the first part found
    its graph warm (None until a part ran in graph mode)."""

    keys: torch.Tensor | None = None
    values: torch.Tensor | None = None
    runs: list[ChunkRun] = field(default_factory=list)
    prefills: list[Prefill] = field(default_factory=list)
    points: list[torch.Tensor | None] = field(default_factory=list)
    ready: bool | None = None

    def past(self, rows: int) -> Past | None:
        """The rows so far, as the past of a part of `rows` rows."""
        return None if self.keys is None else Past.of(self.keys, self.values, rows)

    def add(self, window: Window, part: Prefill, points: torch.Tensor | None, image_rows: int) -> None:
        self.keys = part.keys if self.keys is None else torch.cat([self.keys, part.keys])
        self.values = part.values if self.values is None else torch.cat([self.values, part.values])
        self.runs.append(ChunkRun(window.start, window.end, part.bucket, image_rows))
        self.prefills.append(part)
        self.points.append(points)

    def served(self, evidence: ServingEvidence | None, probe: bool) -> "Served":
        last = self.prefills[-1]
        return Served(Prefill(last.hidden, self.keys, self.values, last.bucket), len(self.prefills),
                      tuple(p.bucket for p in self.prefills), evidence, torch.cat(self.points) if probe else None,
                      tuple(p.check for p in self.prefills if p.check is not None),
                      merge_freshness(*(p.freshness for p in self.prefills)))


class PromptServer:
    """What one mode's engine does with a request before its first decode step, as a server does
    it (design §10): its LM inputs (in graph mode through the encoder graphs when it asks for
    them), the tap, and the prompt's prefill scheduled by its serving features, with what a server
    keeps between requests (its prefix cache, its vision-encoder graphs)."""

    def __init__(self, executor: LMExecutor, prepared: Callable[[Request], PreparedPrompt], chunk_size: int,
                 encoder_by_grid: bool = True) -> None:
        self._executor = executor
        self._prepared_once = prepared  # the run's LM inputs of a request, prepared once for every arm
        self._chunk_size = chunk_size
        self._encoder_by_grid = encoder_by_grid
        self._prefix_cache = PrefixCache()
        self._encoder_graphs: EncoderGraphs | None = None
        self._forwards = 0  # the packed forwards served: each request of one names it by this serial

    def close(self) -> None:
        if self._encoder_graphs is not None:
            self._encoder_graphs.close()

    def _prepared(self, request: Request) -> tuple[PreparedPrompt, EncoderRun | None, tuple[ReplayCheck, ...],
                                                   tuple[InputFreshness, ...]]:
        """The request's LM inputs; in graph mode, through the encoder graphs when it asks for them
        (with their replay's check and its inputs' freshness)."""
        if not (request.serving.encoder_graph and self._executor.runner is not None and request.fixture):
            return self._prepared_once(request), None, (), ()
        if self._encoder_graphs is None:
            self._encoder_graphs = EncoderGraphs(self._executor.adapter.visual, self._encoder_by_grid,
                                                 self._executor.checker)
        self._encoder_graphs.owner = _owner(request)
        prompt = self._executor.adapter.prepare(request.fixture, request.prompt, self._encoder_graphs)
        graphs = self._encoder_graphs
        return prompt, graphs.runs[-1], (graphs.checks[-1],), graphs.freshness[-1]

    def prefill(self, request: Request, tap_mode: str, probe: bool = False):
        """(prompt, the tap's record, the request's whole prefill as served): what a request does
        before its first decode step, and all a probe needs."""
        prompt, encoder, checks, freshness = self._prepared(request)
        # The tap at the LM entry, outside anything a graph captured.
        deepstack, record = apply_tap(tap_mode, prompt.deepstack)
        served = self._serve(request, prompt, deepstack, tap_mode, encoder, probe)
        return prompt, record, replace(served, checks=checks + served.checks,
                                       freshness=merge_freshness(freshness, served.freshness))

    def prefill_together(self, requests: list[tuple[Request, str]], probe: bool = False) -> list[tuple]:
        """Requests submitted at once (the batch scenario): in graph mode their prefills share one
        forward (design §10), a chunked one's earlier chunks first, alone, its last beside the
        others; (prompt, the tap's record, served) per request, in order. The eager reference, or a
        batch no captured graph fits, is served one request at a time: its evidence then shows no
        shared forward, which the verdict reports as not replayed. `probe`: each request's computed
        rows' probe points too (in its `Served`)."""
        taps = []
        for request, tap_mode in requests:
            prompt = self._prepared(request)[0]  # a batch's requests ask for no encoder graph
            deepstack, record = apply_tap(tap_mode, prompt.deepstack)
            taps.append((request, prompt, deepstack, record, tap_mode))
        plans = [schedule(prompt.input_ids.shape[0], 0, self._chunk_size if request.serving.chunked else None)
                 for request, prompt, _, _, _ in taps]
        if not self._fits_one_forward(plans):
            return [(prompt, record, self._serve(request, prompt, deepstack, tap_mode, None, probe))
                    for request, prompt, deepstack, record, tap_mode in taps]
        return self._one_forward(taps, plans, probe)

    def _fits_one_forward(self, plans) -> bool:
        """Whether requests so scheduled can share a replayed forward: graph mode, two or more of
        them, at most one continuing its earlier chunks (one past slot), a context graph fitting."""
        runner = self._executor.runner
        lasts = [windows[-1] for windows in plans]
        past_rows = max(w.start for w in lasts)
        return (runner is not None and len(plans) > 1 and sum(len(w) > 1 for w in plans) <= 1
                and 0 < runner.context_rows and past_rows <= runner.context_rows
                and runner.can_replay(sum(w.end - w.start for w in lasts)))

    def _one_forward(self, taps, plans, probe: bool) -> list[tuple]:
        """The requests' last parts in one packed replay, a continued request's earlier chunks first."""
        parts = [self._prefill_parts(request, prompt, deepstack, windows[:-1], probe, _Parts())
                 for (request, prompt, deepstack, _, _), windows in zip(taps, plans)]
        lasts = [windows[-1] for windows in plans]
        packed = Packed(tuple(
            Member(prompt.input_embeds[window.start:window.end], prompt.positions[:, window.start:window.end],
                   window.of(deepstack), earlier.past(window.end - window.start), _owner(request))
            for (request, prompt, deepstack, _, _), window, earlier in zip(taps, lasts, parts)))
        outputs = self._executor.prefill_packed(packed, tuple(w.start for w in lasts), probe)
        self._forwards += 1
        served = []
        for (_, prompt, _, record, _), window, (part, points), (start, end), mine in zip(
                taps, lasts, outputs, packed.ranges, parts):
            continued = bool(mine.prefills)
            mine.add(window, part, points, int(self._image_rows(prompt)[window.start:window.end].sum()))
            evidence = ServingEvidence(
                chunks=tuple(mine.runs) if continued else (), prompt_tokens=int(prompt.input_ids.shape[0]),
                image_span=self._image_span(prompt),
                batch=BatchRun(self._forwards, part.bucket, len(taps), packed.rows, start, end))
            served.append((prompt, record, mine.served(evidence, probe)))
        return served

    def _prefill_parts(self, request: Request, prompt: PreparedPrompt, deepstack: torch.Tensor | None, windows,
                       probe: bool, parts: _Parts) -> _Parts:
        """Each window of the prompt prefilled after the rows before it, into `parts`."""
        runner = self._executor.runner
        image_ids = self._image_rows(prompt)
        for window in windows:
            rows = window.end - window.start
            past = parts.past(rows)
            # Whether the first part's graph was there before it came (asked before it replays, which may
            # capture it); a first part that ran eagerly found no warm graph.
            warm = (parts.ready is None and runner is not None
                    and runner.warmed_without_deepstack(rows, past is not None))
            part, points = self._executor.prefill(prompt, deepstack, probe=probe, window=window, past=past,
                                                  owner=_owner(request))
            if parts.ready is None and runner is not None:
                parts.ready = warm and part.bucket is not None
            parts.add(window, part, points, int(image_ids[window.start:window.end].sum()))
        return parts

    @staticmethod
    def _image_rows(prompt: PreparedPrompt) -> torch.Tensor:
        return (prompt.input_ids == prompt.visual_token if prompt.visual_token is not None
                else torch.zeros_like(prompt.input_ids, dtype=torch.bool))

    def _serve(self, request: Request, prompt: PreparedPrompt, deepstack: torch.Tensor | None, tap_mode: str,
               encoder: EncoderRun | None, probe: bool = False) -> Served:
        """The prompt's prefill as the request's serving features schedule it (design §10)."""
        if request.serving.chunked or request.serving.prefix_cache:
            return self._serve_in_parts(request, prompt, deepstack, tap_mode, encoder, probe)
        runner = self._executor.runner
        ready = runner.warmed_without_deepstack(prompt.input_ids.shape[0]) if runner is not None else None
        prefill, points = self._executor.prefill(prompt, deepstack, probe=probe, owner=_owner(request))
        evidence = None
        if request.serving.recorded:
            # Once grown, the buffer stays grown: every later request is served past the growth.
            grown = runner.growths if runner is not None else []
            evidence = ServingEvidence(image_span=self._image_span(prompt), prompt_tokens=int(prompt.input_ids.shape[0]),
                                       buffer_growth=(grown[0][0], grown[-1][1]) if grown else None,
                                       graph_ready=ready if prefill.bucket is not None else None, encoder=encoder)
        return Served(prefill, 1, (prefill.bucket,), evidence, points, tuple(c for c in (prefill.check,) if c),
                      prefill.freshness)

    def _serve_in_parts(self, request: Request, prompt: PreparedPrompt, deepstack: torch.Tensor | None,
                        tap_mode: str, encoder: EncoderRun | None, probe: bool) -> Served:
        """After the prefix cache's hit, in chunks: each part after the keys and values before it."""
        serving = request.serving
        total = prompt.input_ids.shape[0]
        cache_key = cached = keys = values = None
        if serving.prefix_cache:
            image = None if request.fixture is None else request.fixture.sha256
            cache_key = token_keys(prompt.input_ids, prompt.visual_token, image)
            if serving.empty_cache:
                self._prefix_cache.empty(tap_mode)
            cached, keys, values = self._prefix_cache.lookup(tap_mode, cache_key)
        windows = schedule(total, cached or 0, self._chunk_size if serving.chunked else None)
        parts = self._prefill_parts(request, prompt, deepstack, windows, probe, _Parts(keys, values))
        if cache_key is not None:
            self._prefix_cache.insert(tap_mode, cache_key, parts.keys, parts.values)
        evidence = ServingEvidence(chunks=tuple(parts.runs), cached_tokens=cached or 0, prompt_tokens=int(total),
                                   image_span=self._image_span(prompt), graph_ready=parts.ready, encoder=encoder)
        return parts.served(evidence, probe)

    def _image_span(self, prompt: PreparedPrompt) -> tuple[int, int] | None:
        return image_span(prompt.input_ids.tolist(), {prompt.visual_token})


def _owner(request: Request) -> str | None:
    """A request's tag on the rows it writes: its image's sha256 (what the freshness witness names)."""
    return None if request.fixture is None else request.fixture.sha256
