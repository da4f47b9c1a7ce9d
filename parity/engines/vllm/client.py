"""vLLM's OpenAI chat API (docs/engines/vllm-0.33.md §7.1): request bodies and response parsing.

Generation is greedy with `logprobs` and `top_logprobs`; `return_token_ids` gives the prompt and
generated ids, and `return_tokens_as_token_ids` names every logprob entry by id ("token_id:N"),
so no token is matched by its text. Teacher forcing sends the prompt with the tokens to score as
the final assistant message (`continue_final_message`) and reads `prompt_logprobs`: the server
re-tokenizes that text, so scores are kept only where it gave back exactly the tokens asked for.
"""

from __future__ import annotations

import base64
from typing import Any, Mapping, Sequence

from parity.backends.protocol import Generation
from parity.engines.engine import Completion
from parity.engines.http import ServerRejected, count_or_none, finite

TOP_LOGPROBS = 5
CHAT_PATH = "/v1/chat/completions"
TOKEN_PREFIX = "token_id:"


def media_part(data: bytes, is_video: bool) -> dict[str, Any]:
    """A message part carrying an image (PNG) or a video (FFV1 in Matroska) as a data URL."""
    kind, mime = ("video_url", "video/x-matroska") if is_video else ("image_url", "image/png")
    return {"type": kind, kind: {"url": f"data:{mime};base64," + base64.b64encode(data).decode()}}


def user_message(prompt: str, media: Mapping[str, Any] | None) -> dict[str, Any]:
    """One user turn: the image or video first, then the prompt (as `chat_text` orders them for every backend)."""
    content: list[dict[str, Any]] = [dict(media)] if media else []
    content.append({"type": "text", "text": prompt})
    return {"role": "user", "content": content}


def _common(messages: list, max_tokens: int, request_id: str) -> dict[str, Any]:
    # No "model": the server's one model answers whatever --served-model-name says. Neutral
    # penalties sent explicitly: greedy must not inherit the checkpoint's generation config.
    return {
        "messages": messages,
        "temperature": 0,
        "seed": 0,
        "repetition_penalty": 1.0,
        "presence_penalty": 0.0,
        "frequency_penalty": 0.0,
        "max_completion_tokens": max_tokens,
        "request_id": request_id,  # the engine's id becomes chatcmpl-<it>-<random>: the tap sees it
        "return_token_ids": True,
        "return_tokens_as_token_ids": True,
    }


def generate_body(prompt: str, media: Mapping[str, Any] | None, max_new_tokens: int, request_id: str) -> dict[str, Any]:
    """Greedy generation with the chosen and top-k logprobs of every step; `media` is `media_part`'s."""
    body = _common([user_message(prompt, media)], max_new_tokens, request_id)
    body.update({"logprobs": True, "top_logprobs": TOP_LOGPROBS})
    return body


def score_body(prompt: str, media: Mapping[str, Any] | None, reference: str, request_id: str) -> dict[str, Any]:
    """Teacher forcing: the prompt, then `reference` (decoded tokens to score) as the assistant's
    unfinished answer; one new token, and the logprob of every prompt token."""
    messages = [user_message(prompt, media), {"role": "assistant", "content": reference}]
    body = _common(messages, 1, request_id)
    body.update({"add_generation_prompt": False, "continue_final_message": True, "prompt_logprobs": 0})
    return body


def _token_id(name: Any) -> int:
    text = str(name)
    if not text.startswith(TOKEN_PREFIX):
        raise ValueError(f"token {text!r} is not named by id")
    return int(text[len(TOKEN_PREFIX):])


def parse_completion(doc: Mapping[str, Any]) -> Completion:
    """Ids, text, logprobs and prompt ids from a chat answer; a malformed one → ServerRejected."""
    try:
        choice = doc["choices"][0]
        token_ids = tuple(int(t) for t in choice["token_ids"])
        steps = (choice.get("logprobs") or {}).get("content") or []
        chosen = tuple(_token_id(step["token"]) for step in steps)
        logprobs = tuple(float(step["logprob"]) for step in steps)
        top = tuple(tuple((_token_id(t["token"]), float(t["logprob"])) for t in step.get("top_logprobs") or ())
                    for step in steps)
        text = str(choice["message"].get("content") or "")
        prompt_ids = tuple(int(t) for t in doc["prompt_token_ids"])
    except (KeyError, TypeError, ValueError, IndexError) as err:
        raise ServerRejected(f"{CHAT_PATH} answer lacks or garbles {err}: keys {sorted(doc)}") from None
    if chosen != token_ids:
        raise ServerRejected(f"{CHAT_PATH} answer: token_ids and the logprobs name different tokens "
                             f"({len(token_ids)} ids, {len(chosen)} logprob steps)")
    finite(logprobs, "output", CHAT_PATH)
    generation = Generation(token_ids, text, logprobs, top, deepstack_record=None, evidence=None)
    return Completion(generation, prompt_ids)


def cached_tokens(doc: Mapping[str, Any]) -> int | None:
    """The prompt tokens the prefix cache supplied (`usage.prompt_tokens_details.cached_tokens`, given
    by a server started with --enable-prompt-tokens-details), when the answer says."""
    details = ((doc.get("usage") or {}).get("prompt_tokens_details") or {})
    return count_or_none(details.get("cached_tokens"))


def parse_scores(doc: Mapping[str, Any], tokens: Sequence[int]) -> tuple[float, ...] | None:
    """The logprobs of `tokens`, the last prompt tokens of a scoring answer; None where the server
    tokenized the answer text into other tokens (the scores would not be of these tokens)."""
    try:
        prompt_ids = [int(t) for t in doc["prompt_token_ids"]]
        entries = doc["prompt_logprobs"]  # [null, {"<id>": {"logprob": ..}, ...}, ...], one per prompt token
        if len(entries) != len(prompt_ids):
            raise ValueError(f"{len(entries)} prompt logprobs for {len(prompt_ids)} prompt tokens")
    except (KeyError, TypeError, ValueError) as err:
        raise ServerRejected(f"{CHAT_PATH} scoring answer lacks or garbles {err}") from None
    n = len(tokens)
    if n == 0:
        return ()
    if n >= len(prompt_ids) or prompt_ids[-n:] != [int(t) for t in tokens]:
        return None
    try:
        values = tuple(float(entries[i][str(prompt_ids[i])]["logprob"]) for i in range(len(prompt_ids) - n, len(prompt_ids)))
    except (KeyError, TypeError, ValueError) as err:
        raise ServerRejected(f"{CHAT_PATH} scoring answer: no logprob for a scored token ({err})") from None
    return finite(values, "scored", CHAT_PATH)
