"""Bounded logging for telemetry failures: a collector that is down must not flood the service log.

The OTLP exporters log every failed export and every retry; with the collector unreachable that is
a few lines a second for as long as the outage lasts. :class:`LogThrottle` lets one record per
(logger, level, message template) through per interval and reports how many it held back.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from rolloutd.telemetry.otel_adapter import PRIVATE_EXPORT_LOGGERS

EXPORT_LOGGERS: tuple[str, ...] = (
    "opentelemetry.exporter.otlp.proto.grpc.exporter",
    "opentelemetry.exporter.otlp.common.http",
    "opentelemetry.exporter.otlp.proto.http.trace_exporter",
    "opentelemetry.exporter.otlp.proto.http.metric_exporter",
    "opentelemetry.sdk.trace.export",
    *PRIVATE_EXPORT_LOGGERS,
    "rolloutd.telemetry.observer",
)
"""Loggers on the export and callback paths. A logger filter sees only its own logger's records
(not its children's), so each emitting module is named here (those of the SDK's private modules
in :mod:`rolloutd.telemetry.otel_adapter`); modules of the same families that are already imported
are found by prefix as well."""

_PREFIXES = ("opentelemetry.exporter.", "opentelemetry.sdk.")
_MAX_KEYS = 1024


class LogThrottle(logging.Filter):
    """Passes the first record of a kind, then at most one per ``interval_s``.

    A record let through after others were held back says how many, so nothing is silently lost.
    Thread-safe: exporters log from their own threads.
    """

    def __init__(self, interval_s: float = 60.0, clock: Callable[[], float] = time.monotonic):
        super().__init__()
        self.interval_s = interval_s
        self._clock = clock
        self._lock = threading.Lock()
        self._seen: dict[tuple[str, int, str], tuple[float, int]] = {}

    def filter(self, record: logging.LogRecord) -> bool:
        key = (record.name, record.levelno, str(record.msg))
        now = self._clock()
        with self._lock:
            last, held = self._seen.get(key, (None, 0))
            if last is not None and now - last < self.interval_s:
                self._seen[key] = (last, held + 1)
                return False
            if len(self._seen) >= _MAX_KEYS:
                self._seen.clear()
            self._seen[key] = (now, 0)
        if held:
            record.msg = f"{record.getMessage()} ({held} similar messages suppressed)"
            record.args = ()
        return True

    def reset(self) -> None:
        """Forgets what was seen (tests)."""
        with self._lock:
            self._seen.clear()


SHARED = LogThrottle()
"""The process-wide throttle: one filter instance, so repeated set-ups never stack filters."""


def install(interval_s: float) -> LogThrottle:
    """Attaches :data:`SHARED` to the export loggers; idempotent, the last interval wins."""
    SHARED.interval_s = interval_s
    names = set(EXPORT_LOGGERS)
    names.update(
        name
        for name, logger in logging.root.manager.loggerDict.items()
        if isinstance(logger, logging.Logger) and name.startswith(_PREFIXES)
    )
    for name in sorted(names):
        logger = logging.getLogger(name)
        if SHARED not in logger.filters:
            logger.addFilter(SHARED)
    return SHARED
