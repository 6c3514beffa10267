"""docs/operations.md names metrics, spans, config variables, alerts and images: all of them exist."""

from __future__ import annotations

import re
from typing import Any

import promql_parser
import pytest
import yaml
from pydantic import BaseModel

from rolloutd.config import ENV_PREFIX, SERVICE_LINK, Config, load_config
from rolloutd.domain.report import CheckpointPhase, RestorePhase
from rolloutd.telemetry import spans

from .prometheus_names import by_series_name
from .tools import REPO

DOC = (REPO / "docs" / "operations.md").read_text()


def _config_key_exists(dotted: str) -> bool:
    model: type[BaseModel] = Config
    *sections, key = dotted.split(".")
    for section in sections:
        model = model.model_fields[section].annotation  # type: ignore[assignment]
    return key in model.model_fields


@pytest.mark.parametrize("name", sorted(set(re.findall(r"\brolloutd_[a-z_]+", DOC))))
def test_prometheus_names_are_catalogue_series(name: str) -> None:
    assert name in by_series_name()


@pytest.mark.parametrize("variable", sorted(set(re.findall(rf"\b{ENV_PREFIX}[A-Z0-9_]+", DOC))))
def test_environment_overrides_name_config_keys(variable: str) -> None:
    """Or, for the examples of what kubelet injects, a name the configuration ignores."""
    dotted = variable.removeprefix(ENV_PREFIX).lower().replace("__", ".")
    if SERVICE_LINK.match(variable) and "__" not in variable:
        assert load_config(environ={variable: "8080"}) == load_config(environ={})
        return
    assert _config_key_exists(dotted), f"{variable}: no config key {dotted}"


def test_span_names_are_the_ones_rolloutd_records() -> None:
    names = set(re.findall(r"\brolloutd\.(?:checkpoint|restore)[a-z_.]*[a-z_]", DOC))
    attributes = {
        v
        for cls in (spans.CheckpointAttr, spans.RestoreAttr)
        for k, v in vars(cls).items()
        if k.isupper()
    }
    recorded = (
        {spans.CHECKPOINT_SPAN, spans.RESTORE_SPAN}
        | {f"{spans.CHECKPOINT_SPAN}.{p.value}" for p in CheckpointPhase}
        | {f"{spans.RESTORE_SPAN}.{p.value}" for p in RestorePhase}
        | attributes
    )
    assert names <= recorded, sorted(names - recorded)
    # Every phase is explained.
    assert {f"{spans.CHECKPOINT_SPAN}.{p.value}" for p in CheckpointPhase} <= names
    assert {f"{spans.RESTORE_SPAN}.{p.value}" for p in RestorePhase} <= names


def _rules() -> dict[str, dict[str, Any]]:
    groups = yaml.safe_load((REPO / "otel" / "alerts.yaml").read_text())["groups"]
    return {rule["alert"]: rule for group in groups for rule in group["rules"]}


def _canonical(expr: str) -> str:
    return str(promql_parser.parse(expr))


def test_alert_table_matches_the_rules() -> None:
    rows = re.findall(r"^\| (Rolloutd\w+) \| `(.+?)` \| (\w+) \| (\w+) \|$", DOC, re.M)
    assert {name for name, *_ in rows} == set(_rules())
    for name, expr, for_, severity in rows:
        rule = _rules()[name]
        assert _canonical(expr) == _canonical(rule["expr"]), name
        assert (for_, severity) == (rule["for"], rule["labels"]["severity"]), name


@pytest.mark.parametrize(
    "manifest", ["k8s/base/otel-collector.yaml", "k8s/base/jaeger.yaml", "Dockerfile"]
)
def test_images_in_the_doc_are_the_deployed_ones(manifest: str) -> None:
    text = (REPO / manifest).read_text()
    deployed = set(re.findall(r"(?:image: |FROM )(\S+:\S+)", text))
    for image in deployed:
        repository = image.split(":")[0]
        in_doc = set(re.findall(rf"{re.escape(repository)}:[\w.\-]+", DOC))
        assert in_doc <= {image}, f"the doc names {in_doc - {image}}, {manifest} runs {image}"
