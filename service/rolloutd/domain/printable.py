"""Text from clients made safe to print on one line: in a log line, a CLI table, a terminal.

A client names things the service later prints (a consumer, a tag, a weights URL, a prompt id).
A newline in one would forge a whole log line of its own; an ANSI escape would repaint the
operator's terminal; U+2028 and U+0085 end a line for many log viewers and JSON readers. Every
character that is not printable is written as its Python escape instead, so the text still says
exactly what was sent.
"""

from __future__ import annotations

import unicodedata

_NAMED = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}

_ESCAPED = frozenset({"Cc", "Cf", "Cs", "Zl", "Zp"})
"""Unicode categories escaped: control and format characters (ANSI escapes, U+0085, the bidi
overrides), lone surrogates, and the line and paragraph separators U+2028 and U+2029."""


def needs_escape(ch: str) -> bool:
    """Whether ``printable`` writes this character as an escape."""
    return unicodedata.category(ch) in _ESCAPED


def printable(text: str) -> str:
    """``text`` with every control, format or line-separating character escaped (``\\n``,
    ``\\x1b``, ``\\u2028``); anything else, non-ASCII letters included, is kept."""
    if text.isprintable():  # the common case: nothing to do
        return text
    return "".join(_escape(ch) if needs_escape(ch) else ch for ch in text)


def _escape(ch: str) -> str:
    if ch in _NAMED:
        return _NAMED[ch]
    code = ord(ch)
    if code <= 0xFF:
        return f"\\x{code:02x}"
    if code <= 0xFFFF:
        return f"\\u{code:04x}"
    return f"\\U{code:08x}"
