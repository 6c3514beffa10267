"""Log lines as JSON objects (``rolloutd --log-format json``), for log pipelines that parse them.

One object a line: ``time`` (UTC, ISO 8601), ``level``, ``logger``, ``message``, ``exception``
when there is one, and the current span's ``trace_id``/``span_id`` (W3C hex) when the line is
logged inside a recording span, so a line leads to its trace in Jaeger.
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any

from opentelemetry import trace


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
        return json.dumps(line, ensure_ascii=False)
