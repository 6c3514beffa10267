"""The naming rules of prometheus_names.py against the real OpenTelemetry Prometheus exporter."""

from __future__ import annotations

from collections.abc import Iterable

import pytest
from opentelemetry.exporter.prometheus import PrometheusMetricReader
from opentelemetry.metrics import CallbackOptions, Meter, Observation
from opentelemetry.sdk.metrics import MeterProvider
from prometheus_client import CollectorRegistry

from rolloutd.telemetry.catalogue import CATALOGUE, Area, Instrument, Kind

from .prometheus_names import label_names, series_names

EDGE_CASES = (
    Instrument("demo.latency", Kind.HISTOGRAM, "ms", "", Area.LATENCY),
    Instrument("demo.speed", Kind.GAUGE, "m/s", "", Area.DRILL_DOWN),
    Instrument("demo.rate", Kind.OBSERVABLE_GAUGE, "{request}/s", "", Area.DRILL_DOWN),
    Instrument("demo.share", Kind.GAUGE, "%", "", Area.DRILL_DOWN),
    Instrument("demo.fraction", Kind.OBSERVABLE_GAUGE, "1", "", Area.DRILL_DOWN),
    Instrument("demo.held", Kind.OBSERVABLE_UP_DOWN_COUNTER, "{token}", "", Area.EFFICIENCY),
    Instrument("demo.size_bytes", Kind.GAUGE, "By", "", Area.SNAPSHOT_SIZE),
    Instrument("demo.requests.total", Kind.COUNTER, "{request}", "", Area.DRILL_DOWN),
    Instrument("demo.wait_total", Kind.COUNTER, "s", "", Area.DRILL_DOWN),
    Instrument("demo.odd-name/x", Kind.OBSERVABLE_COUNTER, "", "", Area.DRILL_DOWN),
    Instrument(
        "demo.labelled", Kind.COUNTER, "{x}", "", Area.DRILL_DOWN,
        attributes={"mutation.kind": ("a",), "http-method": ("GET",)},
    ),
)  # fmt: skip


def _attributes(instrument: Instrument) -> dict[str, str]:
    return {k: v[0] for k, v in instrument.attributes.items()} | {
        k: "x" for k in instrument.open_attributes
    }


def _observe(attrs: dict[str, str]):
    def callback(_: CallbackOptions) -> Iterable[Observation]:
        return [Observation(1.0, attrs)]

    return callback


def _record(meter: Meter, i: Instrument) -> None:
    attrs = _attributes(i)
    match i.kind:
        case Kind.COUNTER:
            meter.create_counter(i.name, i.unit, i.description).add(1, attrs)
        case Kind.HISTOGRAM:
            meter.create_histogram(i.name, i.unit, i.description).record(0.5, attrs)
        case Kind.GAUGE:
            meter.create_gauge(i.name, i.unit, i.description).set(1, attrs)
        case Kind.OBSERVABLE_COUNTER:
            meter.create_observable_counter(i.name, [_observe(attrs)], i.unit, i.description)
        case Kind.OBSERVABLE_UP_DOWN_COUNTER:
            meter.create_observable_up_down_counter(
                i.name, [_observe(attrs)], i.unit, i.description
            )
        case Kind.OBSERVABLE_GAUGE:
            meter.create_observable_gauge(i.name, [_observe(attrs)], i.unit, i.description)
        case _:
            raise AssertionError(f"{i.name}: the test does not know how to record kind {i.kind}")


@pytest.fixture(autouse=True)
def _sdk_enabled(monkeypatch: pytest.MonkeyPatch) -> None:
    """The suite disables the SDK globally; these tests need a working local MeterProvider."""
    monkeypatch.delenv("OTEL_SDK_DISABLED", raising=False)


def _exposition(instruments: Iterable[Instrument]) -> dict[str, frozenset[str]]:
    """Series name -> its label names, as the real exporter exposes them."""
    registry = CollectorRegistry()
    provider = MeterProvider(metric_readers=[PrometheusMetricReader(registry=registry)])
    try:
        meter = provider.get_meter("rolloutd")
        for instrument in instruments:
            _record(meter, instrument)
        return {
            sample.name: frozenset(sample.labels)
            for family in registry.collect()
            if family.name != "target"
            for sample in family.samples
        }
    finally:
        provider.shutdown()


@pytest.mark.parametrize("instruments", [CATALOGUE, EDGE_CASES], ids=["catalogue", "edge-cases"])
def test_series_names_match_the_exporter(instruments: tuple[Instrument, ...]) -> None:
    exposed = _exposition(instruments)
    derived = {name: i for i in instruments for name in series_names(i)}
    assert set(exposed) == set(derived)


@pytest.mark.parametrize("instruments", [CATALOGUE, EDGE_CASES], ids=["catalogue", "edge-cases"])
def test_label_names_match_the_exporter(instruments: tuple[Instrument, ...]) -> None:
    exposed = _exposition(instruments)
    for instrument in instruments:
        for name in series_names(instrument):
            # job and instance come from the scrape, le only on buckets.
            expected = label_names(instrument) - {"job", "instance"}
            if name.endswith("_bucket"):
                expected |= {"le"}
            assert exposed[name] == expected, name
