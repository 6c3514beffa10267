"""Prometheus names and labels of the catalogue's instruments, through the exporter's mapping
(which :mod:`rolloutd.telemetry.otel_adapter` imports; ``test_otel_adapter.py`` checks it)."""

from __future__ import annotations

from rolloutd.telemetry.catalogue import Area, Instrument, Kind
from rolloutd.telemetry.prometheus import prometheus_label, prometheus_name


def test_names_and_labels_come_through_the_mapping():
    counter = Instrument("demo.wait", Kind.COUNTER, "s", "", Area.DRILL_DOWN)
    histogram = Instrument("demo.size_bytes", Kind.HISTOGRAM, "By", "", Area.SNAPSHOT_SIZE)
    assert prometheus_name(counter) == "demo_wait_seconds_total"
    assert prometheus_name(histogram) == "demo_size_bytes"
    assert prometheus_label("mutation.kind") == "mutation_kind"
