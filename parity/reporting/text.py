"""Text from outside parity (case ids, prompts, image names, answers, server errors, and reasons
built from them) made safe for where it is shown.

A case id is a file name and a prompt is whatever a user typed: either may hold a newline, an ANSI
escape, a lone surrogate (valid JSON, not encodable UTF-8), rich markup or markdown. Shown raw, it
could recolour a terminal, crash the output stream, start a heading in report.md or split a table
row. Here it is made visible instead: control characters and lone surrogates as escapes (`\\n`,
`\\x1b`, `\\ud800`), markup escaped for rich, markdown metacharacters escaped for the report.
"""

from __future__ import annotations

import re

from rich.markup import escape as rich_escape

_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f\ud800-\udfff]")
_NAMED = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}
# Inline markdown a string could open; `_` only where it could start or end emphasis (not in bcg_normal).
_MD_INLINE = re.compile(r"[\\`*\[\]<>|~&#!]|(?<![A-Za-z0-9])_|_(?![A-Za-z0-9])")
_BACKTICKS = re.compile(r"`+")


def _escaped(char: str) -> str:
    code = ord(char)
    return _NAMED.get(char) or (f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}")


def visible(text: str, keep: str = "") -> str:
    """`text` with control characters (but those in `keep`) and lone surrogates shown as escapes."""
    return _CONTROL.sub(lambda m: m.group() if m.group() in keep else _escaped(m.group()), str(text))


def terminal(text: str, keep: str = "") -> str:
    """For rich: visible, and no `[...]` taken as markup."""
    return rich_escape(visible(text, keep))


def encodable(text: str) -> str:
    """Lone surrogates as their escape (`\\ud800`, also JSON's), so any UTF-8 stream can take the text."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def md_text(text: str) -> str:
    """One line of markdown prose showing `text` literally: no heading, link, HTML or table cell break."""
    return _MD_INLINE.sub(lambda m: "\\" + m.group(), visible(text))


def md_code(text: str, in_table: bool = False) -> str:
    """`text` as one inline code span; in a table cell, `|` gets the backslash GFM needs there."""
    body = visible(text)
    if in_table:
        body = body.replace("|", "\\|")
    longest = max((len(m) for m in _BACKTICKS.findall(body)), default=0)
    fence = "`" * (longest + 1)
    pad = " " if body.startswith("`") or body.endswith("`") or not body.strip() else ""
    return f"{fence}{pad}{body}{pad}{fence}"
