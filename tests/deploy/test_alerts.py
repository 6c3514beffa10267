"""Prometheus alerting rules (otel/alerts.yaml): catalogue names, structure, and promtool tests."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from .promql import parse
from .tools import REPO, tool

ALERTS = REPO / "otel" / "alerts.yaml"
UNIT_TESTS = Path(__file__).with_name("alerts_test.yaml")
PROMETHEUS_CONFIG = REPO / "otel" / "prometheus.yml"


def _rules() -> list[dict[str, Any]]:
    return [
        rule for group in yaml.safe_load(ALERTS.read_text())["groups"] for rule in group["rules"]
    ]


@pytest.fixture(scope="module")
def promtool() -> str:
    return tool("promtool", "apt-get install prometheus")


@pytest.mark.parametrize("rule", _rules(), ids=lambda r: r["alert"])
def test_rule_reads_catalogue_series(rule: dict[str, Any]) -> None:
    query = parse(rule["expr"])
    assert not query.problems(), query.problems()


@pytest.mark.parametrize("rule", _rules(), ids=lambda r: r["alert"])
def test_rule_is_actionable(rule: dict[str, Any]) -> None:
    assert rule["alert"].startswith("Rolloutd")
    assert rule["labels"]["severity"] in {"warning", "critical"}
    assert rule["annotations"]["summary"] and rule["annotations"]["description"]
    # Alerts name the pod: every rule keeps job and instance.
    grouping = parse(rule["expr"]).grouping
    assert {"job", "instance"} <= grouping, f"{rule['alert']} aggregates the pod away"


def test_the_alerts_the_runbook_promises_exist() -> None:
    names = {rule["alert"] for rule in _rules()}
    assert {
        "RolloutdCheckpointsFailing",
        "RolloutdCheckpointStale",
        "RolloutdBlockedMutationWaitHigh",
    } <= names


def test_every_rule_has_a_unit_test() -> None:
    tested = {
        case["alertname"]
        for test in yaml.safe_load(UNIT_TESTS.read_text())["tests"]
        for case in test["alert_rule_test"]
        if case["exp_alerts"]
    }
    assert tested == {rule["alert"] for rule in _rules()}


def test_promtool_checks_the_rules(promtool: str) -> None:
    subprocess.run([promtool, "check", "rules", str(ALERTS)], check=True, capture_output=True)


def test_promtool_unit_tests_pass(promtool: str) -> None:
    result = subprocess.run(
        [promtool, "test", "rules", str(UNIT_TESTS)], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_promtool_checks_the_prometheus_config(promtool: str) -> None:
    result = subprocess.run(
        [promtool, "check", "config", str(PROMETHEUS_CONFIG)], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stdout + result.stderr
