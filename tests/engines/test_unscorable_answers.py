"""An answer the engine refuses to take back as input is unscored, not a failed arm; and a scoring
whose score is discarded proves nothing by how it ran.

SGLang decodes a multimodal request's input ids to text and splits it at every placeholder token, so
a Qwen3-Omni answer holding `<|audio_pad|>` (id 459 in the tiny preset, a token like any other to the
model) is refused with HTTP 400 when parity sends it back to be scored, although the same prompt and
image were just served. Those tokens get no score (None, as where an engine re-tokenizes an answer
otherwise); any other rejection still fails the arm.

An answer the server re-tokenizes into other tokens (vLLM scores the chat text) keeps no score, and
its scoring prompt can be longer than any captured size: its eager prefill must not make the arm
INCONCLUSIVE_NOT_REPLAYED, while stale DeepStack rows it read are still the engine's leak.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from types import SimpleNamespace

import pytest

from parity.backends.protocol import Answer, Generation
from parity.engines.channel import TapEntry
from parity.engines.evidence import TaggedRequest, arm_evidence
from parity.engines.session import EngineSession, _Served
from parity.engines.sglang.backend import SglangBackend
from parity.errors import ArmFailure

REFUSED = ArmFailure('bcg server: HTTP 400 from http://127.0.0.1:1/generate: '
                     '{"error":{"message":"No data iterator found for token: <|audio_pad|>"}}')
AUDIO_PAD = 459


@dataclass(frozen=True)
class Evidence:
    requests: int
    serving: object = None


class Engine:
    """The calls `EngineSession.score` makes of a backend; a scoring request whose tokens hold the
    placeholder is rejected with `rejection`."""

    refuses_to_score = SglangBackend.refuses_to_score

    def __init__(self, rejection: ArmFailure) -> None:
        self.rejection, self.scored = rejection, []

    def score_body(self, request, media, prompt_ids, tokens, tag):
        return {"tokens": tuple(tokens)}

    def post_tagged(self, server, tap, request, body_for):
        body = body_for("tag")
        if AUDIO_PAD in body["tokens"]:
            raise self.rejection
        self.scored.append(body["tokens"])
        return {"tokens": body["tokens"]}, ()

    def parse_scores(self, doc, prompt_ids, tokens):
        return tuple(-1.0 for _ in tokens)

    def scored_length(self, doc, prompt_ids, tokens):
        return len(prompt_ids) + len(tokens)

    def computes_visual_rows(self, request, doc, prompt_ids):
        return True

    def check_tap(self, server, request, what):
        pass

    def evidence(self, requests, unscored=()):
        return Evidence(len(requests))


def _scored(engine: Engine, own: tuple[int, ...], force: tuple[tuple[int, ...], ...]) -> Generation:
    generation = Generation(own, "", tuple(-1.0 for _ in own), None, None, Evidence(1))
    session = EngineSession("bcg", engine)
    state = _Served(SimpleNamespace(process=None), "record", None, None, (1, 2, 3), "first")
    return session.score(Answer(generation, state), force)


def test_an_answer_holding_a_placeholder_token_is_unscored_and_the_others_are_scored() -> None:
    engine = Engine(REFUSED)
    scored = _scored(engine, (AUDIO_PAD, 269, 383), ((12, 278, 12),))
    assert scored.forced == ((-1.0, -1.0, -1.0),) and scored.self_forced is None
    assert engine.scored == [(12, 278, 12)]
    assert scored.evidence == replace(Evidence(2), serving=None)  # the generation and the one scoring served


def test_any_other_rejection_still_fails_the_arm() -> None:
    """The negative control: a server error that is not the placeholder refusal is the arm's failure."""
    other = ArmFailure('bcg server: HTTP 400 from http://127.0.0.1:1/generate: {"error":{"message":"bad"}}')
    with pytest.raises(ArmFailure, match="bad"):
        _scored(Engine(other), (AUDIO_PAD, 269), ())


class RetokenizingEngine(Engine):
    """vLLM-like: a scoring whose answer the server re-tokenizes into more tokens keeps no score, and
    its longer prompt runs past the largest captured size (eagerly), reading `stale` left rows."""

    def __init__(self, retokenized: tuple[int, ...], stale: int = 0) -> None:
        super().__init__(REFUSED)
        self.retokenized, self.stale = retokenized, stale

    def post_tagged(self, server, tap, request, body_for):
        tokens = body_for("tag")["tokens"]
        odd = tokens == self.retokenized
        entry = TapEntry("tag", 1, "vllm", True, 97 if odd else 48, 97 if odd else 45, not odd, None,
                         stale_rows=self.stale if odd else 0, stale_source="earlier" if odd and self.stale else None)
        return {"tokens": tokens}, (entry,)

    def parse_scores(self, doc, prompt_ids, tokens):
        return None if tuple(tokens) == self.retokenized else tuple(-1.0 for _ in tokens)

    def scored_length(self, doc, prompt_ids, tokens):
        return 97 if tuple(tokens) == self.retokenized else 45

    def evidence(self, requests, unscored=()):
        return arm_evidence(requests, 96, {}, unscored)


def _first() -> TaggedRequest:
    return TaggedRequest(40, True, (TapEntry("tag", 1, "vllm", True, 40, 40, True, None),))


def _scored_from(engine: Engine, own: tuple[int, ...], force: tuple[tuple[int, ...], ...]) -> Generation:
    generation = Generation(own, "", tuple(-1.0 for _ in own), None, None, engine.evidence([_first()]))
    state = _Served(SimpleNamespace(process=None), "record", None, None, (1, 2, 3), _first())
    return EngineSession("bcg", engine).score(Answer(generation, state), force)


def test_a_discarded_score_does_not_make_the_arm_not_replayed() -> None:
    scored = _scored_from(RetokenizingEngine(retokenized=(12, 278, 12)), (5, 6, 7), ((12, 278, 12),))
    assert scored.forced == (None,) and scored.self_forced == (-1.0, -1.0, -1.0)
    assert scored.evidence.prefill_replayed is True and scored.evidence.prompt_tokens == 40
    assert scored.evidence.leak is None


def test_a_kept_score_whose_prefill_ran_eagerly_still_makes_it_not_replayed() -> None:
    """The negative control: the same eager prefill, its score kept, is what the verdict reads."""
    engine = RetokenizingEngine(retokenized=(12, 278, 12))
    engine.parse_scores = lambda doc, prompt_ids, tokens: tuple(-1.0 for _ in tokens)
    scored = _scored_from(engine, (5, 6, 7), ((12, 278, 12),))
    assert scored.evidence.prefill_replayed is False and scored.evidence.prompt_tokens == 97


def test_stale_rows_read_by_a_discarded_scoring_are_still_the_engine_s_leak() -> None:
    scored = _scored_from(RetokenizingEngine(retokenized=(12, 278, 12), stale=12), (5, 6, 7), ((12, 278, 12),))
    assert scored.evidence.prefill_replayed is True
    assert scored.evidence.leak is not None and scored.evidence.leak.rows == 12
