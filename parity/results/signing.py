"""Signed results files, for what travels (design §4d): shards moved between CI machines, artifacts
reviewed later.

With a key in the environment (`PARITY_SIGNING_KEY`, the key itself, or `PARITY_SIGNING_KEY_FILE`,
a file holding it), every results file parity writes carries `signature`: an HMAC-SHA256 over the
document's canonical JSON (keys sorted, no whitespace, the signature itself left out), stdlib only.
Every command that reads one verifies it whenever a key is set; with `--require-signed` an unsigned
file is refused too. A signature proves which key holder wrote the file, not that parity's writer was
right: the loader's rules still hold every signed file.

Canonical JSON, not the file's bytes: re-indenting a file or changing its line endings is not an
edit of what it says, and the reader verifies the document it parsed, the one it then judges.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
from collections.abc import Iterable, Mapping
from typing import Any

from parity.errors import ResultsFileError, UsageError

ENV_KEY = "PARITY_SIGNING_KEY"
ENV_KEY_FILE = "PARITY_SIGNING_KEY_FILE"
FIELD = "signature"
ALGORITHM = "hmac-sha256"
MIN_KEY_BYTES = 16  # a key shorter than this is a typo or a placeholder, not a secret
MAX_KEY_BYTES = 4096
_CANONICAL = json.JSONEncoder(sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False)


def signing_key(environ: Mapping[str, str] = os.environ) -> bytes | None:
    """The key the environment gives, or None; a key that cannot be used is a UsageError (exit 2)."""
    text, path = environ.get(ENV_KEY), environ.get(ENV_KEY_FILE)
    if text and path:
        raise UsageError(f"{ENV_KEY} and {ENV_KEY_FILE} are both set: give the key one way")
    if path:
        try:
            with open(path, "rb") as handle:
                key = handle.read(MAX_KEY_BYTES + 1)
        except OSError as err:
            raise UsageError(f"{ENV_KEY_FILE} {path}: cannot be read ({err.strerror or err})") from None
        if len(key) > MAX_KEY_BYTES:
            raise UsageError(f"{ENV_KEY_FILE} {path}: longer than {MAX_KEY_BYTES} bytes; not a key file")
        key = key.strip()
        where = f"{ENV_KEY_FILE} {path}"
    elif text:
        key, where = text.encode(), ENV_KEY
    else:
        return None
    if len(key) < MIN_KEY_BYTES:
        raise UsageError(f"{where}: the key is {len(key)} bytes; a signing key needs at least {MIN_KEY_BYTES}")
    return key


def key_id(key: bytes) -> str:
    """Names the key without revealing it: which key signed a file, for the refusal's message."""
    return hashlib.sha256(b"parity-signing-key-id\0" + key).hexdigest()[:16]


def document_mac(head: Mapping[str, Any], cases: Iterable[Any] | None, key: bytes) -> str:
    """HMAC of the canonical JSON of `{**head, "cases": [*cases]}` (of `head` alone when `cases` is
    None), computed a case at a time: a sweep's cases are never all encoded at once."""
    mac = hmac.new(key, digestmod=hashlib.sha256)
    names = sorted([*head, *(["cases"] if cases is not None else [])])
    mac.update(b"{")
    for i, name in enumerate(names):
        mac.update(((b"," if i else b"") + f"{_CANONICAL.encode(name)}:".encode()))
        if name == "cases":
            mac.update(b"[")
            for j, case in enumerate(cases):
                mac.update((b"," if j else b"") + _CANONICAL.encode(case).encode())
            mac.update(b"]")
        else:
            mac.update(_CANONICAL.encode(head[name]).encode())
    mac.update(b"}")
    return mac.hexdigest()


def signature(head: Mapping[str, Any], cases: Iterable[Any] | None, key: bytes) -> dict[str, str]:
    return {"algorithm": ALGORITHM, "key_id": key_id(key), "mac": document_mac(head, cases, key)}


def check(doc: Any, source: str, require: bool, key: bytes | None) -> None:
    """Verify `doc`'s signature with `key`, and take it out of `doc` (what is judged is what was
    signed). Refused (ResultsFileError): a mismatch, another key's signature, a malformed one, and
    under `require` an unsigned file. `require` without a key is a UsageError."""
    if require and key is None:
        raise UsageError(f"--require-signed needs the key: set {ENV_KEY} or {ENV_KEY_FILE}")
    if not isinstance(doc, dict):
        return  # not a results document: the loader says what it is
    found = doc.pop(FIELD, None)
    if found is None:
        if require:
            raise ResultsFileError(source, "is not signed; --require-signed refuses it")
        return
    if key is None:
        return  # nothing to verify with; the loader's rules still hold it
    if not (isinstance(found, dict) and set(found) == {"algorithm", "key_id", "mac"}
            and found["algorithm"] == ALGORITHM and all(isinstance(v, str) for v in found.values())):
        raise ResultsFileError(source, f"its signature is not a {ALGORITHM} signature parity writes; refused")
    if not hmac.compare_digest(found["key_id"], key_id(key)):
        raise ResultsFileError(source, f"was signed with another key (key id {found['key_id']}, this key's is "
                                       f"{key_id(key)}); refused")
    cases = doc.get("cases") if "cases" in doc else None
    head = {k: v for k, v in doc.items() if k != "cases"}
    if not hmac.compare_digest(found["mac"], document_mac(head, cases, key)):
        raise ResultsFileError(source, "its signature does not match its content: it was edited after it was "
                                       "signed; refused")


def signed_head(head: dict[str, Any], cases: Iterable[Any] | None, key: bytes | None) -> dict[str, Any]:
    """`head` with the signature of the document it heads, when there is a key."""
    return head if key is None else {**head, FIELD: signature(head, cases, key)}
