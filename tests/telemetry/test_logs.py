"""JSON log lines (``--log-format json``): one object a line, trace and span ids inside a span."""

from __future__ import annotations

import io
import json
import logging
import subprocess
import sys

import pytest
from opentelemetry.sdk.trace import TracerProvider

from rolloutd.telemetry.logs import JsonFormatter


def _logger(stream: io.StringIO) -> logging.Logger:
    handler = logging.StreamHandler(stream)
    handler.setFormatter(JsonFormatter())
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
