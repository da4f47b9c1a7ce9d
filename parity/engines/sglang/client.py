"""The native `/generate` API (docs/engines/sglang-0.5.23.md §2): request bodies and response parsing.

Native rather than OpenAI-compatible because only `/generate` returns the exact generated token
ids next to their logprobs (docs/engines/sglang-0.5.23.md §2.4) and scores given tokens (teacher forcing, docs/engines/sglang-0.5.23.md §2.3).
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

from parity.backends.protocol import Generation
from parity.engines.engine import Completion
from parity.engines.http import ServerRejected, count_or_none, finite

TOP_LOGPROBS = 5
# SGLang decodes a multimodal request's input ids to text and splits it at every placeholder token
# (base_processor.submit_data_loading_tasks), so an answer that holds a placeholder of a modality the
# request carries no data for (Qwen3-Omni's `<|audio_pad|>`, a token like any other to the model) is
# refused with this message (docs/engines/sglang-0.5.23.md §2.3).
PLACEHOLDER_REFUSED = "No data iterator found for token:"


def media_data(path: str | None, is_video: bool) -> dict[str, str]:
    """The body field that carries an image or a video: an absolute path (relative paths are
    base64-decoded, docs/engines/sglang-0.5.23.md §2.1); {} for a text-only request."""
    return {} if path is None else {"video_data" if is_video else "image_data": path}


def generate_body(text: str, media: Mapping[str, str], max_new_tokens: int, rid: str) -> dict[str, Any]:
    """Greedy generation with output logprobs; `text` is already chat-templated
    (docs/engines/sglang-0.5.23.md §2.1) and `media` is `media_data`'s. The answer also carries the
    prompt as the server expanded it (visual tokens included), for scoring."""
    body: dict[str, Any] = {
        "text": text,
        "rid": rid,
        "sampling_params": {"temperature": 0, "max_new_tokens": max_new_tokens},
        "return_logprob": True,
        "top_logprobs_num": TOP_LOGPROBS,
        "return_prompt_token_ids": True,
        **media,
    }
    return body


def score_body(prompt_ids: Sequence[int], tokens: Sequence[int], expanded_length: int, media: Mapping[str, str],
               rid: str) -> dict[str, Any]:
    """Teacher forcing (docs/engines/sglang-0.5.23.md §2.3): the logprob of each of `tokens` after the prompt and the tokens before it.

    `prompt_ids` are the prompt as sent (`ChatPrompts.scoring_ids`), whose placeholder the server's
    processor expands as it did for the generation;
    `expanded_length` is the prompt's length after that expansion, which `logprob_start_len`
    indexes. One new token (the doc's safer choice than a prefill-only request).
    """
    body: dict[str, Any] = {
        "input_ids": [*map(int, prompt_ids), *map(int, tokens)],
        "rid": rid,
        "sampling_params": {"temperature": 0, "max_new_tokens": 1},
        "return_logprob": True,
        "logprob_start_len": expanded_length - 1,
        "return_prompt_token_ids": True,  # what the server made of the ids sent: checked by parse_scores
        **media,
    }
    return body


def parse_completion(doc: Mapping[str, Any]) -> Completion:
    """Token ids, text, logprobs and prompt ids from a /generate answer (docs/engines/sglang-0.5.23.md §2.2); malformed → ServerRejected."""
    try:
        meta = doc["meta_info"]
        chosen = meta["output_token_logprobs"]  # [[logprob, token_id, text|null], ...]
        token_ids = tuple(int(t) for t in doc["output_ids"])
        logprobs = tuple(float(step[0]) for step in chosen)
        top = meta.get("output_top_logprobs")
        top_logprobs = None if top is None else tuple(
            tuple((int(tid), float(lp)) for lp, tid, *_ in (step or ())) for step in top
        )
        text = str(doc["text"])
        prompt_ids = tuple(int(t) for t in doc["prompt_token_ids"])
    except (KeyError, TypeError, ValueError, IndexError) as err:
        raise ServerRejected(f"/generate answer lacks or garbles {err}: keys {sorted(doc)}") from None
    if tuple(int(step[1]) for step in chosen) != token_ids:
        raise ServerRejected("/generate answer: output_ids and output_token_logprobs name different tokens")
    finite(logprobs, "output", "/generate")
    generation = Generation(token_ids, text, logprobs, top_logprobs, deepstack_record=None, evidence=None)
    return Completion(generation, prompt_ids)


def cached_tokens(doc: Mapping[str, Any]) -> int | None:
    """The prompt tokens the radix cache supplied (`meta_info.cached_tokens`), when the answer says."""
    return count_or_none((doc.get("meta_info") or {}).get("cached_tokens"))


def parse_scores(doc: Mapping[str, Any], tokens: Sequence[int],
                 expanded: Sequence[int] | None = None) -> tuple[float, ...] | None:
    """The forced tokens' logprobs from a scoring answer (docs/engines/sglang-0.5.23.md §2.2: entry 0 is the position before
    the first forced token and has no logprob; entry k scores token k-1).

    Given the generation's expanded prompt, the answer's own prompt must begin with exactly it
    (else the placeholder was expanded otherwise); after it, the server may hold other tokens
    than `tokens` where it went through text (a video request: `ChatPrompts.scoring_ids`) and
    the answer's text tokenizes otherwise: then there is no score of these tokens (None), as on
    vLLM. Otherwise the ids scored must be exactly `tokens`, or the positions were misaligned."""
    if expanded is not None and doc.get("prompt_token_ids") is not None:
        served = [int(t) for t in doc["prompt_token_ids"]]
        if served[:len(expanded)] != [int(t) for t in expanded]:
            raise ServerRejected("/generate scoring answer: the server expanded the prompt otherwise than for the "
                                 "generation it scores")
        if served[len(expanded):] != [int(t) for t in tokens]:
            return None
    try:
        entries = doc["meta_info"]["input_token_logprobs"]  # [[logprob|null, token_id, text|null], ...]
        scored = entries[1:]
        ids = tuple(int(step[1]) for step in scored)
        values = tuple(float(step[0]) for step in scored)
    except (KeyError, TypeError, ValueError, IndexError) as err:
        raise ServerRejected(f"/generate scoring answer lacks or garbles {err}") from None
    if ids != tuple(int(t) for t in tokens):
        raise ServerRejected(f"/generate scoring answer scored other tokens than the reference's "
                             f"({len(ids)} scored, {len(tokens)} forced): prompt positions misaligned")
    return finite(values, "scored", "/generate")
