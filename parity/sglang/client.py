"""The native `/generate` API (sglang-0.5.23.md §2): request bodies and response parsing.

Native rather than OpenAI-compatible because only `/generate` returns the exact generated token
ids next to their logprobs (§2.4).
"""

from __future__ import annotations

import http.client
import json
import urllib.error
import urllib.request
from typing import Any, Mapping

from parity.backends.base import Generation

TOP_LOGPROBS = 5
REQUEST_TIMEOUT_S = 600.0


class ServerUnreachable(Exception):
    """The connection failed or broke: the server is gone or not listening."""


class ServerRejected(Exception):
    """The server answered with an HTTP error or with a body that is not a generation."""


def generate_body(text: str, image: str | None, max_new_tokens: int, rid: str) -> dict[str, Any]:
    """Greedy generation with output logprobs; `text` is already chat-templated (§2.1)."""
    body: dict[str, Any] = {
        "text": text,
        "rid": rid,
        "sampling_params": {"temperature": 0, "max_new_tokens": max_new_tokens},
        "return_logprob": True,
        "top_logprobs_num": TOP_LOGPROBS,
    }
    if image is not None:
        body["image_data"] = image  # an absolute path or a data URI; relative paths fail (§2.1)
    return body


def post_json(url: str, body: Mapping[str, Any], timeout: float = REQUEST_TIMEOUT_S) -> dict[str, Any]:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
    return _fetch_json(request, url, timeout)


def get_json(url: str, timeout: float = 10.0) -> dict[str, Any]:
    return _fetch_json(url, url, timeout)


def _fetch_json(request: urllib.request.Request | str, url: str, timeout: float) -> dict[str, Any]:
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            payload = response.read()
    except urllib.error.HTTPError as err:
        detail = err.read().decode(errors="replace")[:500]
        raise ServerRejected(f"HTTP {err.code} from {url}: {detail}") from None
    except (urllib.error.URLError, http.client.HTTPException, ConnectionError, TimeoutError, OSError) as err:
        raise ServerUnreachable(f"{url}: {getattr(err, 'reason', err)}") from None
    return _json_object(payload, url)


def _json_object(payload: bytes, url: str) -> dict[str, Any]:
    try:
        doc = json.loads(payload)
    except json.JSONDecodeError:
        raise ServerRejected(f"{url} answered with something that is not JSON: {payload[:200]!r}") from None
    if not isinstance(doc, dict):
        raise ServerRejected(f"{url} answered with JSON that is not an object")
    return doc


def parse_completion(doc: Mapping[str, Any]) -> Generation:
    """Token ids, text and logprobs from a /generate answer (§2.2); malformed → ServerRejected.

    The DeepStack record comes from the tap's channel, not the answer: the session adds it.
    """
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
    except (KeyError, TypeError, ValueError, IndexError) as err:
        raise ServerRejected(f"/generate answer lacks or garbles {err}: keys {sorted(doc)}") from None
    if tuple(int(step[1]) for step in chosen) != token_ids:
        raise ServerRejected("/generate answer: output_ids and output_token_logprobs name different tokens")
    return Generation(token_ids, text, logprobs, top_logprobs, deepstack_record=None)
