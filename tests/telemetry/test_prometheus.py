"""The exporter's private naming functions that :mod:`rolloutd.telemetry.prometheus` imports are
still there, still take and return one string, and are still the ones the exporter names its
series with; an upgrade of opentelemetry-exporter-prometheus that moves them fails here first."""

from __future__ import annotations

import inspect

import opentelemetry.exporter.prometheus as exporter
from opentelemetry.exporter.prometheus import _mapping

from rolloutd.telemetry.catalogue import Area, Instrument, Kind
from rolloutd.telemetry.prometheus import prometheus_label, prometheus_name

FUNCTIONS = ("sanitize_full_name", "sanitize_attribute", "map_unit")


def test_the_private_functions_keep_their_signature():
    for name in FUNCTIONS:
        parameters = list(inspect.signature(getattr(_mapping, name)).parameters.values())
        assert len(parameters) == 1, name
        assert parameters[0].kind is inspect.Parameter.POSITIONAL_OR_KEYWORD, name


def test_the_exporter_names_series_with_the_same_functions():
    """Were the exporter to switch to other rules, ours would drift from its series."""
    for name in FUNCTIONS:
        assert getattr(exporter, name) is getattr(_mapping, name), name


def test_names_and_labels_come_through_the_mapping():
    counter = Instrument("demo.wait", Kind.COUNTER, "s", "", Area.DRILL_DOWN)
    histogram = Instrument("demo.size_bytes", Kind.HISTOGRAM, "By", "", Area.SNAPSHOT_SIZE)
    assert prometheus_name(counter) == "demo_wait_seconds_total"
    assert prometheus_name(histogram) == "demo_size_bytes"
    assert prometheus_label("mutation.kind") == "mutation_kind"
