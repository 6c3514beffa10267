"""The ready line that ends a start: where to connect, and what the service started from."""

from __future__ import annotations

from rolloutd.domain.report import RestoreReport, SkippedSnapshot
from rolloutd.startup import ready_line
from tests.integration.proc import LISTENING


def report(**fields: object) -> RestoreReport:
    return RestoreReport(started_ns=0, ended_ns=1, **fields)  # type: ignore[arg-type]


def test_wildcard_addresses_read_as_localhost_and_scripts_find_them():
    line = ready_line("0.0.0.0:50051", "0.0.0.0:8080", "ck", None)
    assert line.startswith("ready: gRPC localhost:50051, dashboard http://localhost:8080/; ")
    m = LISTENING.search(line)
    assert m is not None and (m["grpc"], m["http"]) == ("localhost:50051", "localhost:8080")
    off = LISTENING.search(ready_line("10.0.0.7:50051", None, "ck", None))
    assert off is not None and (off["grpc"], off["http"]) == ("10.0.0.7:50051", None)


def test_each_way_of_starting_says_how_to_start_fresh():
    restored = ready_line("h:1", "h:2", "ck", report(sequence=7, tag="step-10"))
    assert "restored snapshot 7 (tag step-10) from ck; --restore none starts fresh" in restored
    fresh = ready_line("h:1", "h:2", "ck", report())
    assert "started fresh: no snapshot in ck yet" in fresh and "--restore none" in fresh
    journal = ready_line("h:1", "h:2", "ck", report(replayed=3))
    assert "replayed 3 journal records" in journal and "--restore none" in journal
    corrupt = ready_line("h:1", "h:2", "ck", report(skipped=[SkippedSnapshot(2, "bad")]))
    assert "no snapshot in ck verifies (1 skipped" in corrupt
    assert ready_line("h:1", "h:2", "ck", None).endswith("started fresh (--restore none)")


def test_a_service_that_is_not_ready_does_not_say_ready():
    line = ready_line("h:1", "h:2", "ck", None, not_ready="not ready: cannot claim the store")
    assert line.startswith("started but not ready: cannot claim the store: gRPC h:1,")
