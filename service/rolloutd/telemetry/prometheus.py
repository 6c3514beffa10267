"""The names the Prometheus exporter gives the catalogue's instruments.

Derived with the exporter's own mapping (the OpenTelemetry-to-Prometheus compatibility rules: dots
to underscores, unit suffix, ``_total`` for counters); a test checks every name against a real
``/metrics`` scrape, so a change in the exporter shows up as a failing test, not a stale document.
The exporter keeps that mapping in a private module, which only
:mod:`rolloutd.telemetry.otel_adapter` imports.
"""

from __future__ import annotations

from rolloutd.telemetry.catalogue import Instrument, Kind
from rolloutd.telemetry.otel_adapter import map_unit, sanitize_attribute, sanitize_full_name

_MONOTONIC = (Kind.COUNTER, Kind.OBSERVABLE_COUNTER)


def prometheus_name(instrument: Instrument) -> str:
    """The series name to query; a histogram's series are this plus ``_bucket/_sum/_count``."""
    name = sanitize_full_name(instrument.name)
    unit = map_unit(instrument.unit)
    if unit and not name.endswith(f"_{unit}"):
        name = f"{name}_{unit}"
    if instrument.kind in _MONOTONIC:
        name = f"{name}_total"
    return name


def prometheus_label(attribute: str) -> str:
    """The label an attribute key becomes (``mutation.kind`` -> ``mutation_kind``)."""
    return sanitize_attribute(attribute)
