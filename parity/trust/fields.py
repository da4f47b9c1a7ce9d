"""Typed readers for the values of a results document, each naming the JSON path of a bad value.

Counts, ids and sizes are bounded: a real run never gets near `MAX_COUNT`, and a number beyond it
is an edit or corruption that would make later arithmetic (a graph capture, a loop) hang.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

from parity.plan.entries import SHA256_HEX  # noqa: F401 (the readers of sha256 fields take it from here)

# Token ids, sizes, counts, buckets: a vocabulary, an image side, a context and the LM entries of a
# run all stay far below ten million.
MAX_COUNT = 10**7
# A log-probability is <= 0. An engine that computes logit - logsumexp in separate kernels can land a
# few float32 ulps above 0 for a near-certain token (an ulp is ~2e-6 at logits of ~30); anything
# above this is no rounding but an impossible score.
MAX_LOGPROB = 1e-5
# Every other number a run writes (tolerances, norms, seconds, errors, log-probabilities) stays far
# inside this; beyond it a value is an edit, and sums over a sweep's millions of steps could overflow.
MAX_MAGNITUDE = 1e12
# An integer literal of more digits than 2**64 - 1 has is no count, id or seed parity writes; json
# would parse thousands of digits into an int that later arithmetic cannot turn into a float.
MAX_INT_DIGITS = 20


class Invalid(Exception):
    """A problem in the document, reported with the JSON path where it was found."""


def get(obj: Any, key: str, kind: type | tuple[type, ...], where: str, optional: bool = False) -> Any:
    if not isinstance(obj, dict):
        raise Invalid(f"{where} must be an object")
    if key not in obj:
        if optional:
            return None
        raise Invalid(f"{where} lacks {key!r}")
    value = obj[key]
    if optional and value is None:
        return None
    kinds = kind if isinstance(kind, tuple) else (kind,)
    # bool is an int in Python; a JSON true where a number belongs is still an error.
    if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
        raise Invalid(f"{where}.{key} must be {'/'.join(k.__name__ for k in kinds)}, got {type(value).__name__}")
    return value


def number(value: Any, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise Invalid(f"{where} must be a number")
    if not math.isfinite(value):
        raise Invalid(f"{where} is {value}: numbers in a results file must be finite")
    if abs(value) > MAX_MAGNITUDE:
        raise Invalid(f"{where} is {value:g}, beyond ±{MAX_MAGNITUDE:g}: no run writes such a number")
    return float(value)


def positive(value: Any, where: str) -> float:
    result = number(value, where)
    if result <= 0:
        raise Invalid(f"{where} must be > 0, got {result}")
    return result


def integer(value: Any, where: str, minimum: int, maximum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise Invalid(f"{where} must be an integer, got {type(value).__name__}")
    if value < minimum:
        raise Invalid(f"{where} must be >= {minimum}, got {value}")
    if value > maximum:
        raise Invalid(f"{where} is {value}, above {maximum}: no run gets near it")
    return value


def non_negative_int(value: Any, where: str, minimum: int = 0) -> int:
    return integer(value, where, minimum, MAX_COUNT)



# One object per distinct token id: a merged sweep holds millions of ids (answers and top-k) from a
# vocabulary of thousands, and json makes a new int object for each (design §4b: sweeps must load).
_SHARED_INTS: dict[int, int] = {}
shared_int = _SHARED_INTS.setdefault  # shared_int(v, v): the one object for v


def ints(values: Any, where: str, minimum: int = 0) -> tuple[int, ...]:
    if not isinstance(values, list):
        raise Invalid(f"{where} must be a list of integers")
    if all(type(v) is int and minimum <= v <= MAX_COUNT for v in values):  # every valid file: no messages built
        return tuple(shared_int(v, v) for v in values)
    return tuple(non_negative_int(v, f"{where}[{i}]", minimum) for i, v in enumerate(values))


def is_logprob(value: Any) -> bool:
    """A number in [-MAX_MAGNITUDE, MAX_LOGPROB] (not a bool): what every valid logprob is."""
    return (type(value) is float or type(value) is int) and -MAX_MAGNITUDE <= value <= MAX_LOGPROB


def logprobs(values: Any, where: str) -> tuple[float, ...]:
    if not isinstance(values, list):
        raise Invalid(f"{where} must be a list of numbers")
    if all(map(is_logprob, values)):  # every valid file: no messages built
        return tuple(map(float, values))
    out = tuple(number(v, f"{where}[{i}]") for i, v in enumerate(values))
    for i, lp in enumerate(out):
        if lp > MAX_LOGPROB:
            raise Invalid(f"{where}[{i}] is {lp}: a log-probability cannot be positive")
    return out


# Only a literal with a three-digit exponent, or a run of more digits than any value parity writes,
# can overflow a float or be an unbounded integer: the document is parsed literal by literal (slow on
# a large sweep) only then. A long digit run inside a string only costs that slower parse.
_UNBOUNDED_LITERAL = re.compile(rf"[eE][+-]?0*[1-9][0-9]{{2,}}|[0-9]{{{MAX_INT_DIGITS + 1},}}")


class _Unbounded(float):
    """Where an integer literal of more than MAX_INT_DIGITS digits stood (found after parsing)."""

    def __new__(cls, literal: str) -> "_Unbounded":
        value = super().__new__(cls, math.inf)
        value.digits = len(literal.lstrip("-"))
        return value


def parse_unique_keys(text: str) -> Any:
    """The JSON document; a key given twice in one object is an error naming where (json keeps the
    last silently, so an edit could hide an arm behind its own name)."""
    twice: dict[int, str] = {}

    def pairs(items: list[tuple[str, Any]]) -> dict:
        obj: dict = {}
        for key, value in items:
            if key in obj:
                twice.setdefault(id(obj), key)
            obj[key] = value
        return obj

    unbounded: list[str] = []  # NaN, Infinity, or a literal that overflows: where is found after

    def constant(name: str) -> float:
        unbounded.append(name)
        return float(name)

    def finite(literal: str) -> float:
        value = float(literal)
        if not math.isfinite(value):
            unbounded.append(literal)
        return value

    def bounded(literal: str) -> int | float:
        if len(literal.lstrip("-")) > MAX_INT_DIGITS:
            unbounded.append(literal)
            return _Unbounded(literal)
        return int(literal)

    hooks = {"parse_float": finite, "parse_int": bounded} if _UNBOUNDED_LITERAL.search(text) else {}
    doc = json.loads(text, object_pairs_hook=pairs, parse_constant=constant, **hooks)
    if unbounded:
        where, value = _find_unbounded(doc)
        if isinstance(value, _Unbounded):
            raise Invalid(f"{where} is an integer of {value.digits} digits, more than any value in a results file")
        raise Invalid(f"{where} is {value}: numbers in a results file must be finite")
    if twice:
        where, key = _find_object(doc, twice, "document")
        raise Invalid(f"{where} has the key {key!r} twice")
    return doc


def _find_unbounded(node: Any) -> tuple[str, float]:
    stack = [(node, "document")]
    while stack:
        node, where = stack.pop()
        if isinstance(node, float) and not math.isfinite(node):
            return where, node
        if isinstance(node, dict):
            stack.extend((v, f"{where}.{k}" if where != "document" else k) for k, v in reversed(node.items()))
        elif isinstance(node, list):
            stack.extend((v, f"{where}[{i}]") for i, v in reversed(list(enumerate(node))))
    return "document", math.nan


def _find_object(node: Any, twice: dict[int, str], where: str) -> tuple[str, str]:
    stack = [(node, where)]
    while stack:  # iterative: the document may be nested as deeply as json allows
        node, where = stack.pop()
        if isinstance(node, dict):
            if id(node) in twice:
                return where, twice[id(node)]
            stack.extend((v, f"{where}.{k}" if where != "document" else k) for k, v in node.items())
        elif isinstance(node, list):
            stack.extend((v, f"{where}[{i}]") for i, v in enumerate(node))
    return where, next(iter(twice.values()))
