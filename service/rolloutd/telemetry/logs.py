"""How ``rolloutd`` writes its log lines: text (the default) or JSON objects
(``rolloutd --log-format json``), for log pipelines that parse them.

Both keep one record to one line whatever a client sent (a consumer, a tag, a weights URL end up
in messages): text lines escape every control, format and line-separating character of the
message and of an exception's message (``rolloutd.domain.printable``), so a newline cannot forge
a line of its own; JSON lines write those characters as ``\\u`` escapes, U+2028 and U+0085
included, which JSON itself would leave raw.

JSON: one object a line: ``time`` (UTC, ISO 8601), ``level``, ``logger``, ``message``,
``exception`` when there is one, and the current span's ``trace_id``/``span_id`` (W3C hex) when
the line is logged inside a recording span, so a line leads to its trace in Jaeger.
"""

from __future__ import annotations

import json
import logging
import time
import traceback
from types import TracebackType
from typing import Any

from opentelemetry import trace

from rolloutd.domain.printable import needs_escape, printable

_ExcInfo = tuple[type[BaseException], BaseException, TracebackType | None] | tuple[None, None, None]


class TextFormatter(logging.Formatter):
    """``time level logger: message``; see the module docstring."""

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s: %(message)s")

    def formatMessage(self, record: logging.LogRecord) -> str:
        record.message = printable(record.message)
        return super().formatMessage(record)

    def formatException(self, ei: _ExcInfo) -> str:
        """The traceback's lines as Python prints them, with each exception's message (the part
        a client may have written) escaped onto its one line."""
        out = []
        for chunk in traceback.format_exception(*ei):
            if chunk.startswith("  ") or chunk.startswith(_CHAIN_HEADS):
                out.append(chunk)  # frames (paths and source lines), chaining headers
            else:
                out.append(printable(chunk.removesuffix("\n")) + "\n")
        return "".join(out).removesuffix("\n")


_CHAIN_HEADS = (
    "Traceback (most recent call last):",
    "\nThe above exception was the direct cause",
    "\nDuring handling of the above exception",
)


def _json_escaped(line: str) -> str:
    """A JSON text with the characters JSON leaves raw but readers split lines at (U+2028,
    U+0085, ...) written as ``\\u`` escapes; it decodes to the same value."""
    if line.isprintable():
        return line
    return "".join(_json_escape(ch) if needs_escape(ch) else ch for ch in line)


def _json_escape(ch: str) -> str:
    code = ord(ch)
    if code <= 0xFFFF:
        return f"\\u{code:04x}"
    code -= 0x10000  # a UTF-16 surrogate pair, as JSON writes characters beyond the BMP
    return f"\\u{0xD800 + (code >> 10):04x}\\u{0xDC00 + (code & 0x3FF):04x}"


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, Any] = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        context = trace.get_current_span().get_span_context()
        if context.is_valid:
            line["trace_id"] = format(context.trace_id, "032x")
            line["span_id"] = format(context.span_id, "016x")
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        return _json_escaped(json.dumps(line, ensure_ascii=False))
