"""The collector, Jaeger and Prometheus configurations under otel/ and their Kubernetes copies.

No collector binary is available to the tests, so these check the structure a collector checks at
start-up (every pipeline component defined, every defined one used) and the addresses that must
agree across files.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from rolloutd.config import load_config

from .tools import REPO

OTEL = REPO / "otel"
K8S_CONFIG = REPO / "k8s" / "base" / "config"

_ENV_DEFAULT = re.compile(r"\$\{env:\w+:-([^}]*)\}")


def resolve(value: str) -> str:
    """``${env:VAR:-default}`` -> ``default``, as the collector expands it with VAR unset."""
    return _ENV_DEFAULT.sub(lambda m: m.group(1), value)


def port(endpoint: str) -> int:
    return int(resolve(endpoint).rsplit(":", 1)[1])


def load(path: Path) -> dict[str, Any]:
    return yaml.safe_load(path.read_text())


@pytest.mark.parametrize("name", ["collector.yaml", "jaeger.yaml"])
def test_kubernetes_runs_the_same_file(name: str) -> None:
    assert (K8S_CONFIG / name).read_text() == (OTEL / name).read_text(), (
        f"k8s/base/config/{name} must be a copy of otel/{name}: cp otel/{name} k8s/base/config/"
    )


@pytest.mark.parametrize("name", ["collector.yaml", "jaeger.yaml"])
def test_pipelines_use_exactly_the_defined_components(name: str) -> None:
    config = load(OTEL / name)
    service = config["service"]
    for kind in ("receivers", "processors", "exporters"):
        used = {c for p in service["pipelines"].values() for c in p.get(kind, [])}
        assert used == set(config.get(kind) or {}), (
            f"{name}: {kind} defined {set(config[kind])}, used {used}"
        )
    assert set(service.get("extensions", [])) == set(config.get("extensions") or {})


def test_collector_receives_otlp_on_the_standard_ports() -> None:
    protocols = load(OTEL / "collector.yaml")["receivers"]["otlp"]["protocols"]
    assert port(protocols["grpc"]["endpoint"]) == 4317
    assert port(protocols["http"]["endpoint"]) == 4318


def test_collector_sends_traces_to_jaeger_over_otlp() -> None:
    collector = load(OTEL / "collector.yaml")
    jaeger = load(OTEL / "jaeger.yaml")
    (exporter,) = collector["service"]["pipelines"]["traces"]["exporters"]
    assert exporter.split("/")[0] == "otlp"
    host, _, p = resolve(collector["exporters"][exporter]["endpoint"]).rpartition(":")
    assert host == "jaeger"
    assert int(p) == port(jaeger["receivers"]["otlp"]["protocols"]["grpc"]["endpoint"])
    assert collector["exporters"][exporter]["tls"]["insecure"] is True


def test_collector_serves_metrics_for_prometheus_on_8889() -> None:
    collector = load(OTEL / "collector.yaml")
    assert collector["service"]["pipelines"]["metrics"]["exporters"] == ["prometheus"]
    assert port(collector["exporters"]["prometheus"]["endpoint"]) == 8889


def test_memory_limiter_first_and_batch_last_in_every_pipeline() -> None:
    for pipeline in load(OTEL / "collector.yaml")["service"]["pipelines"].values():
        processors = pipeline["processors"]
        assert processors[0] == "memory_limiter"
        assert processors[-1] == "batch"


def test_jaeger_queries_the_storage_it_writes() -> None:
    jaeger = load(OTEL / "jaeger.yaml")
    backends = set(jaeger["extensions"]["jaeger_storage"]["backends"])
    assert jaeger["exporters"]["jaeger_storage_exporter"]["trace_storage"] in backends
    assert jaeger["extensions"]["jaeger_query"]["storage"]["traces"] in backends
    assert port(jaeger["extensions"]["jaeger_query"]["http"]["endpoint"]) == 16686


def test_prometheus_scrapes_the_collector_and_rolloutd() -> None:
    prometheus = load(OTEL / "prometheus.yml")
    jobs = {job["job_name"]: job for job in prometheus["scrape_configs"]}
    collector_port = port(load(OTEL / "collector.yaml")["exporters"]["prometheus"]["endpoint"])
    admin_port = load_config(K8S_CONFIG / "rolloutd.yaml", environ={}).http.port

    (collector_target,) = jobs["otel-collector"]["static_configs"][0]["targets"]
    assert port(collector_target) == collector_port
    assert jobs["otel-collector"]["honor_labels"] is True
    (admin_target,) = jobs["rolloutd-admin"]["static_configs"][0]["targets"]
    assert port(admin_target) == admin_port
    assert jobs["rolloutd-admin"]["metrics_path"] == "/metrics"
    for rule_file in prometheus["rule_files"]:
        assert (OTEL / rule_file).exists()
