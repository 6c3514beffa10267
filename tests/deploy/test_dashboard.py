"""The Grafana dashboard: every query parses and reads only series the catalogue exports."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from rolloutd.telemetry.catalogue import CATALOGUE, Area

from .prometheus_names import series_names
from .promql import parse, substitute
from .tools import REPO, tool

DASHBOARD = REPO / "otel" / "dashboards" / "rolloutd.json"

PRIMARY_ROWS = (
    ("Generation throughput", {Area.GENERATION}),
    ("Usable output", {Area.USABLE_OUTPUT}),
    ("Checkpoint latency", {Area.CHECKPOINT_LATENCY}),
    ("Backpressure", {Area.BACKPRESSURE}),
    ("Reliability", {Area.RELIABILITY, Area.CADENCE}),
    ("Restore", {Area.RESTORE}),
    ("Recovery efficiency", {Area.RECOVERY}),
    ("Snapshot size", {Area.SNAPSHOT_SIZE}),
    ("Rewards", {Area.REWARDS}),
    ("Efficiency", {Area.EFFICIENCY}),
    ("Engine", {Area.ENGINE}),
    ("Admission", {Area.ADMISSION}),
)
"""The primary dashboard, in order, and the catalogue areas each row shows in full."""

DRILL_DOWN_AREAS = {Area.DRILL_DOWN, Area.LATENCY, Area.EPISODES}


@pytest.fixture(scope="module")
def dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())


def _variables(dashboard: dict[str, Any]) -> set[str]:
    return {v["name"] for v in dashboard["templating"]["list"]}


def _rows(dashboard: dict[str, Any]) -> Iterator[tuple[dict[str, Any], list[dict[str, Any]]]]:
    """Each row with its panels: nested in a collapsed row, following an expanded one."""
    row: dict[str, Any] | None = None
    following: list[dict[str, Any]] = []
    for panel in dashboard["panels"]:
        if panel["type"] == "row":
            if row is not None:
                yield row, following
            row, following = panel, list(panel["panels"])
        else:
            assert row is not None, f"panel {panel['title']!r} sits above the first row"
            following.append(panel)
    if row is not None:
        yield row, following


def _exprs(panels: list[dict[str, Any]]) -> Iterator[tuple[str, str]]:
    for panel in panels:
        for target in panel["targets"]:
            yield panel["title"], target["expr"]


def _all_exprs(dashboard: dict[str, Any]) -> list[tuple[str, str]]:
    return [e for _, panels in _rows(dashboard) for e in _exprs(panels)]


def test_every_query_reads_catalogue_series(dashboard: dict[str, Any]) -> None:
    variables = _variables(dashboard)
    problems = [
        f"{title}: {problem}"
        for title, expr in _all_exprs(dashboard)
        for problem in parse(expr, variables).problems()
    ]
    assert not problems, "\n".join(problems)


def test_prometheus_parses_every_query(dashboard: dict[str, Any], tmp_path: Path) -> None:
    """promtool checks each query, as a recording rule, with Prometheus's own parser."""
    promtool = tool("promtool", "apt-get install prometheus")
    variables = _variables(dashboard)
    rules = [
        {"record": f"dashboard:query{i}", "expr": substitute(expr, variables)}
        for i, (_, expr) in enumerate(_all_exprs(dashboard))
    ]
    path = tmp_path / "dashboard-rules.yaml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    result = subprocess.run([promtool, "check", "rules", str(path)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_variable_queries_read_catalogue_series(dashboard: dict[str, Any]) -> None:
    variables = _variables(dashboard)
    for var in dashboard["templating"]["list"]:
        if var["type"] != "query":
            continue
        definition = var["query"]["query"]
        assert definition.startswith("label_values(") and definition.endswith(")")
        selector, _, label = definition.removeprefix("label_values(")[:-1].rpartition(",")
        query = parse(selector, variables - {var["name"]})
        assert not query.problems(), query.problems()
        assert label.strip() in {"job", "instance"}


def test_datasource_is_a_variable(dashboard: dict[str, Any]) -> None:
    (datasource,) = [v for v in dashboard["templating"]["list"] if v["type"] == "datasource"]
    assert datasource["query"] == "prometheus"
    for _, panels in _rows(dashboard):
        for panel in panels:
            assert panel["datasource"]["uid"] == f"${{{datasource['name']}}}", panel["title"]
            for target in panel["targets"]:
                assert target["datasource"] == panel["datasource"], panel["title"]


def _instruments_read(panels: list[dict[str, Any]], variables: set[str]) -> set[str]:
    return {
        s.instrument.name
        for _, expr in _exprs(panels)
        for s in parse(expr, variables).selectors
        if s.instrument is not None
    }


def test_job_defaults_to_the_service_name_kubernetes_sets(dashboard: dict[str, Any]) -> None:
    """The collector's exporter labels series job=<service.name>."""
    (job,) = [v for v in dashboard["templating"]["list"] if v["name"] == "job"]
    env = dict(
        line.split("=", 1)
        for line in (REPO / "k8s" / "base" / "config" / "otel.env").read_text().splitlines()
        if line.strip()
    )
    assert job["current"]["value"] == env["OTEL_SERVICE_NAME"]


def test_primary_rows_come_first_and_show_their_areas(dashboard: dict[str, Any]) -> None:
    rows = list(_rows(dashboard))
    titles = [row["title"] for row, _ in rows]
    assert titles[: len(PRIMARY_ROWS)] == [title for title, _ in PRIMARY_ROWS]
    for (row, panels), (_, areas) in zip(rows, PRIMARY_ROWS, strict=False):
        assert not row["collapsed"], row["title"]
        read = _instruments_read(panels, _variables(dashboard))
        wanted = {i.name for i in CATALOGUE if i.area in areas}
        assert wanted <= read, f"row {row['title']!r} lacks {sorted(wanted - read)}"


def test_drill_down_rows_follow_and_show_the_rest(dashboard: dict[str, Any]) -> None:
    rows = list(_rows(dashboard))[len(PRIMARY_ROWS) :]
    assert rows, "no drill-down rows"
    read = set().union(*(_instruments_read(panels, _variables(dashboard)) for _, panels in rows))
    wanted = {i.name for i in CATALOGUE if i.area in DRILL_DOWN_AREAS}
    assert wanted <= read, f"drill-down rows lack {sorted(wanted - read)}"


def test_histogram_quantiles_group_by_le(dashboard: dict[str, Any]) -> None:
    for title, expr in _all_exprs(dashboard):
        if "histogram_quantile" in expr:
            query = parse(expr, _variables(dashboard))
            assert "le" in query.grouping, title
            assert all(s.name.endswith("_bucket") for s in query.selectors), title


def test_panel_ids_are_unique_and_panels_do_not_overlap(dashboard: dict[str, Any]) -> None:
    ids = [p["id"] for row, panels in _rows(dashboard) for p in (row, *panels)]
    assert len(ids) == len(set(ids))
    for _, panels in _rows(dashboard):
        cells = set()
        for panel in panels:
            g = panel["gridPos"]
            assert g["x"] + g["w"] <= 24, panel["title"]
            xs, ys = range(g["x"], g["x"] + g["w"]), range(g["y"], g["y"] + g["h"])
            area = {(x, y) for x in xs for y in ys}
            assert not cells & area, f"{panel['title']!r} overlaps another panel"
            cells |= area


def test_a_wrong_name_is_caught() -> None:
    """The check itself: a misspelt series, label or value is reported."""
    assert parse("rate(rolloutd_checkpoint_attempts[5m])").problems()
    assert parse('sum by (kind) (rolloutd_buffer_mutation_blocked_total{job="x"})').problems()
    assert parse('rolloutd_checkpoint_duration_seconds_count{phase="hold"}').problems()
    every = [n for i in CATALOGUE for n in series_names(i)]
    assert all(not parse(n).problems() for n in every)
