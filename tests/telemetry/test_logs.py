"""Log lines: JSON (``--log-format json``), one object a line, trace and span ids inside a span;
text and JSON alike, one record to one line whatever a client put in the message."""

from __future__ import annotations

import io
import json
import logging
import subprocess
import sys

import pytest
from opentelemetry.sdk.trace import TracerProvider

from rolloutd.telemetry.logs import JsonFormatter, TextFormatter


def _logger(stream: io.StringIO, formatter: logging.Formatter | None = None) -> logging.Logger:
    handler = logging.StreamHandler(stream)
    handler.setFormatter(formatter or JsonFormatter())
    logger = logging.getLogger("rolloutd.test.json")
    logger.handlers[:] = [handler]
    logger.propagate = False
    logger.setLevel(logging.INFO)
    return logger


def test_lines_inside_a_span_carry_its_trace_and_span_ids(clean_env):
    stream = io.StringIO()
    logger = _logger(stream)
    tracer = TracerProvider(shutdown_on_exit=False).get_tracer("test")
    logger.info("outside %d", 1)
    with tracer.start_as_current_span("rpc") as span:
        logger.warning("inside %s", "the span")
    outside, inside = (json.loads(line) for line in stream.getvalue().splitlines())
    assert outside["message"] == "outside 1" and outside["level"] == "INFO"
    assert outside["logger"] == "rolloutd.test.json"
    assert "trace_id" not in outside and "span_id" not in outside
    context = span.get_span_context()
    assert inside["message"] == "inside the span" and inside["level"] == "WARNING"
    assert inside["trace_id"] == format(context.trace_id, "032x")
    assert inside["span_id"] == format(context.span_id, "016x")


def test_an_exception_is_one_field_not_extra_lines():
    stream = io.StringIO()
    logger = _logger(stream)
    try:
        raise ValueError("boom")
    except ValueError:
        logger.exception("failed")
    (line,) = stream.getvalue().splitlines()
    record = json.loads(line)
    assert record["message"] == "failed" and "ValueError: boom" in record["exception"]


@pytest.mark.process
@pytest.mark.parametrize("where", ["before", "after"])
def test_the_cli_logs_json(tmp_path, where):
    flag = ["--log-format", "json"]
    argv = [*flag, "serve"] if where == "before" else ["serve", *flag]
    result = subprocess.run(
        [sys.executable, "-m", "rolloutd.cli", *argv, "--engine", "synthetic", "--grpc-port", "0",
         "--http-port", "0", "--checkpoint-dir", str(tmp_path / "ck"), "--restore", "step-9"],
        capture_output=True, text=True, timeout=60, cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode == 1
    *logged, last = result.stderr.rstrip("\n").splitlines()
    assert logged and all(json.loads(line)["logger"] for line in logged)
    assert last.startswith("rolloutd: no snapshot tagged 'step-9'")


FORGED = (
    "t-1\n2026-01-01 00:00:00,000 CRITICAL rolloutd: forged"
    "\r\x1b[2J\x85next\u2028line\u2029para\u202eevil\x00\U000e0041"
)
"""A consumer name as a hostile trainer would send it: a newline and a whole forged line, a
carriage return, an ANSI escape, NEL, the Unicode line and paragraph separators, a bidi override,
a NUL and a tag character."""


def test_text_lines_escape_what_a_client_sent():
    stream = io.StringIO()
    logger = _logger(stream, TextFormatter())
    logger.warning("lease expired for consumer %s", FORGED)
    try:
        raise ValueError(f"bad consumer {FORGED}")
    except ValueError:
        logger.exception("fetch failed")
    text = stream.getvalue()
    lines = text.rstrip("\n").split("\n")
    assert lines[0].endswith(
        "rolloutd.test.json: lease expired for consumer t-1\\n2026-01-01 00:00:00,000 "
        "CRITICAL rolloutd: forged\\r\\x1b[2J\\x85next\\u2028line\\u2029para\\u202eevil"
        "\\x00\\U000e0041"
    )
    assert not any(line.startswith("2026-01-01") for line in lines)
    # the traceback keeps its lines; the exception's message is one of them, escaped
    assert "Traceback (most recent call last):" in lines
    assert any(line.startswith('  File "') for line in lines)
    assert lines[-1].startswith("ValueError: bad consumer t-1\\n2026")
    for line in lines:
        assert line.isprintable(), line


def test_json_lines_escape_the_separators_json_leaves_raw():
    stream = io.StringIO()
    logger = _logger(stream)
    logger.warning("consumer %s", FORGED)
    try:
        raise ValueError(FORGED)
    except ValueError:
        logger.exception("failed")
    text = stream.getvalue()
    assert text.isascii() or all(ch.isprintable() for ch in text.replace("\n", ""))
    first, second = text.splitlines()  # str.splitlines splits at U+2028, U+0085 too
    assert json.loads(first)["message"] == f"consumer {FORGED}"
    assert json.loads(second)["exception"].endswith(f"ValueError: {FORGED}")
    assert "\\u2028" in first and "\\u0085" in first and "\\u202e" in first
