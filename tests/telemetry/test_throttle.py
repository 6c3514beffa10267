from __future__ import annotations

import logging

from rolloutd.telemetry import throttle
from rolloutd.telemetry.throttle import LogThrottle


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def record(msg: str, *args: object, name: str = "x", level: int = logging.ERROR):
    return logging.LogRecord(name, level, __file__, 1, msg, args, None)


def test_one_record_per_kind_per_interval_then_a_count_of_the_held_back():
    clock = FakeClock()
    gate = LogThrottle(interval_s=30.0, clock=clock)
    assert gate.filter(record("Failed to export %s to %s", "spans", "a:1"))
    for _ in range(5):
        clock.now += 1
        assert not gate.filter(record("Failed to export %s to %s", "metrics", "a:1"))
    assert gate.filter(record("Transient error %s", "UNAVAILABLE"))  # another kind
    assert gate.filter(record("Failed to export %s to %s", "spans", "a:1", level=logging.WARNING))

    clock.now += 30
    passed = record("Failed to export %s to %s", "spans", "a:1")
    assert gate.filter(passed)
    assert passed.getMessage() == "Failed to export spans to a:1 (5 similar messages suppressed)"


def test_install_attaches_one_shared_filter_to_each_export_logger():
    before = throttle.SHARED.interval_s
    try:
        throttle.install(5.0)
        throttle.install(7.0)
        for name in throttle.EXPORT_LOGGERS:
            assert logging.getLogger(name).filters.count(throttle.SHARED) == 1
        assert throttle.SHARED.interval_s == 7.0
    finally:
        throttle.SHARED.interval_s = before
