"""The generated reference docs match their sources, and the Prometheus names they give are the
ones the real exporter serves."""

from __future__ import annotations

import importlib.util
import subprocess
from pathlib import Path
from types import ModuleType

from opentelemetry.exporter.prometheus import PrometheusMetricReader
from opentelemetry.sdk.metrics import MeterProvider
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from rolloutd.telemetry.catalogue import CATALOGUE, Kind
from rolloutd.telemetry.metrics import MetricsObserver
from rolloutd.telemetry.prometheus import prometheus_label, prometheus_name
from rolloutd.telemetry.providers import histogram_views
from tests.deploy.tools import tool
from tests.telemetry.reports import CHECKPOINT_STATE, ENGINE, STATUS, scripted_run

ROOT = Path(__file__).resolve().parents[2]


def gen_docs() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gen_docs", ROOT / "scripts" / "gen_docs.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_metrics_doc_is_generated_from_the_catalogue():
    docs = gen_docs()
    assert (ROOT / "docs/metrics.md").read_text() == docs.render_metrics(), (
        "docs/metrics.md is stale: run `python scripts/gen_docs.py`"
    )


def test_configuration_doc_is_generated_from_the_config_model():
    docs = gen_docs()
    assert (ROOT / "docs/configuration.md").read_text() == docs.render_configuration(), (
        "docs/configuration.md is stale: run `python scripts/gen_docs.py`"
    )


def test_check_mode_reports_nothing_stale():
    assert gen_docs().main(["--check"]) == 0


def scripted_exposition() -> str:
    """``/metrics`` after a scripted run of every observer call (every instrument has data)."""
    registry = CollectorRegistry()
    provider = MeterProvider(
        metric_readers=[PrometheusMetricReader(registry=registry)],
        views=histogram_views(),
        shutdown_on_exit=False,
    )
    observer = MetricsObserver(provider)
    observer.register_sources(
        lambda: ENGINE, "synthetic", lambda: STATUS, lambda: CHECKPOINT_STATE, model="tiny"
    )
    scripted_run(observer)
    exposition = generate_latest(registry).decode()
    provider.shutdown()
    return exposition


def test_documented_prometheus_names_and_labels_are_what_the_exporter_serves(clean_env):
    exposition = scripted_exposition()
    labels_by_sample: dict[str, set[str]] = {}
    for family in text_string_to_metric_families(exposition):
        for sample in family.samples:
            labels_by_sample.setdefault(sample.name, set()).update(sample.labels)
    for instrument in CATALOGUE:
        name = prometheus_name(instrument)
        series = f"{name}_bucket" if instrument.kind is Kind.HISTOGRAM else name
        assert series in labels_by_sample, (instrument.name, series)
        expected = {
            prometheus_label(k) for k in (*instrument.attributes, *instrument.open_attributes)
        }
        assert expected <= labels_by_sample[series], (instrument.name, labels_by_sample[series])


def test_promtool_finds_nothing_to_lint_in_the_exposition(clean_env):
    """Prometheus's own linter (naming, units, counters ending in _total, help text)."""
    promtool = tool("promtool", "apt-get install prometheus")
    result = subprocess.run(
        [promtool, "check", "metrics"],
        input=scripted_exposition(),
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0 and not result.stdout.strip(), result.stdout + result.stderr
