"""A server engine's session in one mode (design §6, §10): each request goes, under its own tag
with the tap set, to the mode's server for its serving profile; what the tap recorded for the tag is
its evidence, and its answer is scored teacher-forced in the same server.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Sequence

from parity.backends.protocol import Answer, Generates, Generation, Request
from parity.engines import launcher
from parity.engines.channel import tap_mode
from parity.engines.evidence import TaggedRequest, request_record
from parity.engines.pool import Server, parsed
from parity.errors import ArmFailure

if TYPE_CHECKING:
    from parity.engines.engine import EngineBackend


@dataclass(frozen=True)
class _Served:
    """What scoring an answer needs of its request: the same server, tap, image or video and prompt."""

    server: Server
    tap: str
    request: Request
    media: Any
    prompt_ids: tuple[int, ...]
    first: TaggedRequest


@dataclass(frozen=True)
class EngineSession(Generates):
    """A mode's servers; requests go one at a time, each tagged, the tap set before each, each to
    the server of the mode whose flags give the request's serving features (`design.Serving.server_profile`)."""

    mode: str
    backend: "EngineBackend"

    @property
    def process(self) -> launcher.ServerProcess:
        """The mode's running server's process (the one that served the last request)."""
        keys = [k for k in self.backend.pool.running if self.backend.mode_of(k) == self.mode]
        if not keys:
            raise ArmFailure(f"{self.mode}: no server of this mode is running")
        return self.backend.pool.acquire(keys[0]).process

    def answer(self, request: Request, deepstack: str) -> Answer:
        tap = tap_mode(deepstack)
        engine = self.backend
        server = engine.server_for(self.mode, request.serving.server_profile)
        if not server.process.alive():
            raise server.process.exited_failure()
        media = engine.media_input(request.fixture)
        doc, entries = engine.post_tagged(server, tap, request, lambda tag: engine.generate_body(
            request, media, engine.settings.max_new_tokens, tag))
        completion = parsed(server.process, engine.parse_completion, doc)
        visual_rows = engine.computes_visual_rows(request, doc, completion.prompt_ids)
        first = TaggedRequest(len(completion.prompt_ids), visual_rows, entries)
        engine.check_tap(server, first, "request")  # before scoring: a silent tap fails the arm at once
        evidence = engine.evidence([first])
        if request.serving.recorded:
            evidence = replace(evidence, serving=engine.serving_evidence(server, doc, first,
                                                                             completion.prompt_ids))
        generation = replace(completion.generation, deepstack_record=request_record(first), evidence=evidence)
        return Answer(generation, _Served(server, tap, request, media, completion.prompt_ids, first))

    def score(self, answer: Answer, force: Sequence[Sequence[int]] = ()) -> Generation:
        served: _Served = answer.state
        engine = self.backend
        requests, unscored, scores, start = [served.first], [], [], time.perf_counter()
        # Its own tokens last: scores from a prefill are compared with scores from a prefill.
        for tokens in (*force, answer.generation.token_ids):
            try:
                doc, entries = engine.post_tagged(served.server, served.tap, served.request, lambda tag: engine.score_body(
                    served.request, served.media, served.prompt_ids, tokens, tag))
            except ArmFailure as failure:
                if not engine.refuses_to_score(failure):
                    raise
                scores.append(None)  # refused before any forward: no score, and no step to check
                continue
            scores.append(parsed(served.server.process,
                                 lambda d: engine.parse_scores(d, served.prompt_ids, tokens), doc))
            length = engine.scored_length(doc, served.prompt_ids, tokens)
            tagged = TaggedRequest(length, engine.computes_visual_rows(served.request, doc, served.prompt_ids), entries)
            engine.check_tap(served.server, tagged, f"teacher-forced scoring request {len(scores)}")
            (requests if scores[-1] is not None else unscored).append(tagged)
        evidence = replace(engine.evidence(requests, unscored), serving=answer.generation.evidence.serving)
        return replace(answer.generation, evidence=evidence, forced=tuple(scores[:-1]),
                       self_forced=scores[-1], forced_seconds=time.perf_counter() - start)
