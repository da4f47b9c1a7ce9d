"""JSON over HTTP to an engine server on the loopback, and the two ways it can go wrong."""

from __future__ import annotations

import http.client
import json
import math
import urllib.error
import urllib.request
from typing import Any, Mapping

REQUEST_TIMEOUT_S = 600.0


class ServerUnreachable(Exception):
    """The connection failed or broke: the server is gone or not listening."""


class ServerRejected(Exception):
    """The server answered with an HTTP error or with a body that is not a generation."""


def post_json(url: str, body: Mapping[str, Any], timeout: float = REQUEST_TIMEOUT_S) -> dict[str, Any]:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
    return _fetch_json(request, url, timeout)


def post_admin(url: str, timeout: float = REQUEST_TIMEOUT_S) -> bytes:
    """POST with no body to an admin endpoint whose answer is not JSON (a cache flush): its raw
    answer, or ServerRejected / ServerUnreachable."""
    return _fetch(urllib.request.Request(url, data=b"", method="POST"), url, timeout)


def get_json(url: str, timeout: float = 10.0) -> dict[str, Any]:
    return _fetch_json(url, url, timeout)


def _fetch_json(request: urllib.request.Request | str, url: str, timeout: float) -> dict[str, Any]:
    return _json_object(_fetch(request, url, timeout), url)


def _fetch(request: urllib.request.Request | str, url: str, timeout: float) -> bytes:
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.read()
    except urllib.error.HTTPError as err:
        detail = err.read().decode(errors="replace")[:500]
        raise ServerRejected(f"HTTP {err.code} from {url}: {detail}") from None
    except (urllib.error.URLError, http.client.HTTPException, ConnectionError, TimeoutError, OSError) as err:
        raise ServerUnreachable(f"{url}: {getattr(err, 'reason', err)}") from None


def _json_object(payload: bytes, url: str) -> dict[str, Any]:
    try:
        doc = json.loads(payload)
    except json.JSONDecodeError:
        raise ServerRejected(f"{url} answered with something that is not JSON: {payload[:200]!r}") from None
    if not isinstance(doc, dict):
        raise ServerRejected(f"{url} answered with JSON that is not an object")
    return doc


def count_or_none(value: Any) -> int | None:
    """A count an answer gives (a non-negative integer), or None for anything else."""
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


def finite(values: tuple[float, ...], what: str, endpoint: str) -> tuple[float, ...]:
    """`values` when every one is finite; a results file never holds NaN or infinity, so such an
    answer fails its arm instead (ServerRejected)."""
    bad = next((i for i, v in enumerate(values) if not math.isfinite(v)), None)
    if bad is not None:
        raise ServerRejected(f"{endpoint} answer: non-finite {what} logprob {values[bad]} at step {bad}")
    return values
