"""Prometheus names of the catalogue's instruments, as the OpenTelemetry Prometheus exporter writes them.

The dashboard, the alerts and the docs query these names, and nothing checks a PromQL string at
run time: a renamed instrument or a changed unit would leave an empty panel or an alert that never
fires. These functions restate the exporter's naming rules (OpenTelemetry's Prometheus
compatibility specification) so tests can tie every query to a catalogue instrument;
``test_prometheus_names.py`` holds them to the exposition of the real exporter.
"""

from __future__ import annotations

import re

from rolloutd.telemetry.catalogue import CATALOGUE, Instrument, Kind

_INVALID_NAME_CHARS = re.compile(r"[^a-zA-Z0-9:]+")
_INVALID_LABEL_CHARS = re.compile(r"[^a-zA-Z0-9]+")
_ANNOTATION = re.compile(r"\{.*\}")

_UNIT_WORDS = {
    "d": "days", "h": "hours", "min": "minutes", "s": "seconds", "ms": "milliseconds",
    "us": "microseconds", "ns": "nanoseconds",
    "By": "bytes", "KiBy": "kibibytes", "MiBy": "mebibytes", "GiBy": "gibibytes",
    "TiBy": "tibibytes", "KBy": "kilobytes", "MBy": "megabytes", "GBy": "gigabytes",
    "TBy": "terabytes",
    "m": "meters", "V": "volts", "A": "amperes", "J": "joules", "W": "watts", "g": "grams",
    "Cel": "celsius", "Hz": "hertz", "%": "percent",
    "1": "",
}  # fmt: skip
"""UCUM units the exporter spells out; "1" (a ratio) adds no suffix."""

_PER_UNIT_WORDS = {
    "s": "second", "m": "minute", "h": "hour", "d": "day", "w": "week", "mo": "month", "y": "year",
}  # fmt: skip

SCOPE_LABELS = frozenset({"otel_scope_name", "otel_scope_version", "otel_scope_schema_url"})
"""Labels the exporter adds to every series (the instrumentation scope)."""

TARGET_LABELS = frozenset({"job", "instance"})
"""Labels Prometheus attaches at scrape time (the collector's exporter sets them from
service.name and service.instance.id)."""


def _sanitize(name: str, invalid: re.Pattern[str]) -> str:
    if name[:1].isdigit():
        name = "_" + name[1:]
    return invalid.sub("_", name)


def unit_suffix(unit: str) -> str:
    """``s`` -> ``seconds``, ``By`` -> ``bytes``, ``{token}`` -> nothing, ``m/s`` ->
    ``meters_per_second``."""
    unit = _ANNOTATION.sub("", unit)
    if unit in _UNIT_WORDS:
        return _UNIT_WORDS[unit]
    top, slash, bottom = unit.partition("/")
    bottom = _INVALID_NAME_CHARS.sub("_", bottom)
    if slash and bottom:
        top = _INVALID_NAME_CHARS.sub("_", top)
        top = _UNIT_WORDS.get(top, top)
        bottom = _PER_UNIT_WORDS.get(bottom, bottom)
        return f"{top}_per_{bottom}" if top else f"per_{bottom}"
    return _INVALID_NAME_CHARS.sub("_", unit).strip("_")


def family_name(instrument: Instrument) -> str:
    """The metric family: the sanitized name (a counter's without ``_total``), then the unit unless
    the name already ends in it."""
    name = _sanitize(instrument.name, _INVALID_NAME_CHARS)
    if _is_counter(instrument):
        name = name.removesuffix("_total")
    suffix = unit_suffix(instrument.unit)
    if suffix and not name.endswith("_" + suffix):
        name = f"{name}_{suffix}"
    return name


def series_names(instrument: Instrument) -> frozenset[str]:
    """Every series name the instrument appears under in an exposition."""
    family = family_name(instrument)
    match instrument.kind:
        case Kind.COUNTER | Kind.OBSERVABLE_COUNTER:
            return frozenset({f"{family}_total"})
        case Kind.HISTOGRAM:
            return frozenset({f"{family}_bucket", f"{family}_count", f"{family}_sum"})
        case Kind.GAUGE | Kind.OBSERVABLE_GAUGE | Kind.OBSERVABLE_UP_DOWN_COUNTER:
            return frozenset({family})  # a non-monotonic sum is a gauge to Prometheus
    raise ValueError(f"{instrument.name}: no Prometheus mapping for kind {instrument.kind}")


def _is_counter(instrument: Instrument) -> bool:
    return instrument.kind in (Kind.COUNTER, Kind.OBSERVABLE_COUNTER)


def label_name(attribute: str) -> str:
    """``mutation.kind`` -> ``mutation_kind``."""
    return _sanitize(attribute, _INVALID_LABEL_CHARS)


def label_names(instrument: Instrument) -> frozenset[str]:
    """Labels a series of the instrument can carry (``le`` only on ``_bucket`` series)."""
    keys = (*instrument.attributes, *instrument.open_attributes)
    return frozenset(label_name(k) for k in keys) | SCOPE_LABELS | TARGET_LABELS


def by_series_name() -> dict[str, Instrument]:
    """Series name -> the catalogue instrument it comes from."""
    return {series: i for i in CATALOGUE for series in series_names(i)}
