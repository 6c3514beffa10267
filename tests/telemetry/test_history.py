"""The dashboard history: readings of a real registry, counters that run on across restarts, the
file next to the checkpoints."""

from __future__ import annotations

import json
import uuid

import pytest
from opentelemetry.exporter.prometheus import PrometheusMetricReader
from opentelemetry.sdk.metrics import MeterProvider
from prometheus_client import CollectorRegistry

from rolloutd.checkpoint.store import SnapshotStore
from rolloutd.domain.mutation import MutationKind
from rolloutd.domain.observer import GroupCommitted, GroupDropped
from rolloutd.domain.report import CheckpointPhase
from rolloutd.telemetry.history import (
    COUNTER_KEYS,
    HISTORY_BATCH,
    HISTORY_OBJECTS,
    SERIES,
    HistoryFile,
    HistoryObjects,
    MetricHistory,
    Point,
    history_log,
    history_path,
)
from rolloutd.telemetry.metrics import MetricsObserver
from tests.conftest import BUCKET
from tests.telemetry.reports import checkpoint_report, finished_groups

pytestmark = pytest.mark.usefixtures("clean_env")


def observed() -> tuple[MetricsObserver, CollectorRegistry]:
    """A catalogue observer exported to its own Prometheus registry, as the service has one."""
    registry = CollectorRegistry()
    reader = PrometheusMetricReader(registry=registry)
    provider = MeterProvider(metric_readers=[reader], shutdown_on_exit=False)
    return MetricsObserver(provider), registry


def clock(start: float = 1_000.0):
    now = [start]

    def tick() -> float:
        now[0] += 1.0
        return now[0]

    return tick


def test_a_reading_holds_the_dashboard_series_of_the_catalogue(tmp_path):
    observer, registry = observed()
    observer.group_committed(GroupCommitted(1, 40, True, 0.5, prompt_tokens=3, group_size=4))
    observer.mutation_blocked(MutationKind.STAGE_SAMPLE, 0.002)
    observer.checkpoint_attempted(checkpoint_report())
    point = MetricHistory(registry, run="a", capacity=10, clock=clock()).sample()
    v = point.values
    assert v["committed_tokens"] == 40 and v["committed_groups"] == 1
    assert v["blocked/stage_sample"] == 1 and "blocked/admit" not in v  # zero counters left out
    assert v["blocked_wait_count"] == 1 and v["blocked_wait_sum"] > 0
    assert v["attempts/completed/completed"] == 1
    for phase in [*(p.value for p in CheckpointPhase), "total"]:
        assert v[f"checkpoint_seconds_count/{phase}"] == 1
    assert {k.split("/")[0] for k in v} <= {s.key for s in SERIES}


def test_a_reading_holds_the_rewards_area_series():
    """Rewards and scoring times summed over outcomes; drops and failures split by their label."""
    observer, registry = observed()
    for event in finished_groups():
        observer.group_finished(event)
    observer.group_dropped(GroupDropped(4, "zero_variance", 10))
    observer.group_dropped(GroupDropped(6, "engine_error", 3))
    v = MetricHistory(registry, run="a", capacity=10, clock=clock()).sample().values
    assert (v["reward_count"], v["reward_sum"]) == (5, 3.0)
    assert v["score_seconds_count"] == 3 and v["score_seconds_sum"] == pytest.approx(30.05)
    assert v["scoring_failures/timeout"] == 1 and "scoring_failures/raised" not in v
    assert v["dropped_groups/zero_variance"] == 1 and v["dropped_groups/engine_error"] == 1
    assert v["dropped_tokens/zero_variance"] == 10 and v["dropped_tokens/engine_error"] == 3
    assert {"reward_sum", "dropped_groups", "scoring_failures"} <= COUNTER_KEYS


def test_counters_run_on_across_a_restart_and_gauges_do_not(tmp_path):
    path = history_path(str(tmp_path / "ckpt"))
    assert path is not None
    observer, registry = observed()
    observer.group_committed(GroupCommitted(1, 40, True, 0.5, prompt_tokens=3, group_size=4))
    observer.checkpoint_attempted(checkpoint_report())
    first = MetricHistory(registry, run="a", capacity=10, log=HistoryFile(path, 10), clock=clock())
    before = first.sample()

    observer, registry = observed()  # a new process: counters start at zero again
    observer.group_committed(GroupCommitted(2, 2, True, 0.5, prompt_tokens=3, group_size=4))
    second = MetricHistory(
        registry, run="b", capacity=10, log=HistoryFile(path, 10), clock=clock(2_000.0)
    )
    after = second.sample()
    assert [p.run for p in second.points()] == ["a", "b"]
    assert after.values["committed_tokens"] == 42
    assert after.values["attempts/completed/completed"] == 1  # carried over, not reset
    assert "rows/live" in before.values and "rows/live" not in after.values  # no snapshot yet
    assert second.points(since=before.t) == [after]


def test_the_ring_buffer_and_the_file_keep_the_newest_points(tmp_path):
    path = tmp_path / "dashboard" / "history.jsonl"
    _, registry = observed()
    history = MetricHistory(registry, run="a", capacity=3, log=HistoryFile(path, 3), clock=clock())
    taken = [history.sample() for _ in range(8)]
    assert history.points() == taken[-3:]
    lines = path.read_text().splitlines()
    assert len(lines) <= 2 * 3 and json.loads(lines[-1])["t"] == taken[-1].t
    assert HistoryFile(path, 3).load() == taken[-3:]


def test_a_torn_last_line_is_skipped(tmp_path):
    path = tmp_path / "history.jsonl"
    whole = Point(5.0, "a", {"committed_tokens": 3.0})
    path.write_text(json.dumps(whole.to_json()) + "\n" + '{"t": 6.0, "run": "a", "v": {"comm')
    assert HistoryFile(path, 10).load() == [whole]


def test_only_a_local_checkpoint_dir_gets_a_file(tmp_path):
    assert history_path("s3://bucket/pod-0") is None
    assert history_path(f"file://{tmp_path}") == tmp_path / "dashboard" / "history.jsonl"
    assert history_path("ckpt") is not None


@pytest.mark.s3
def test_on_an_object_store_the_points_are_objects_next_to_the_checkpoints(s3_options):
    url = f"s3://{BUCKET}/{uuid.uuid4().hex}"
    store = SnapshotStore(url, s3_options)
    observer, registry = observed()
    observer.group_committed(GroupCommitted(1, 40, True, 0.5, prompt_tokens=3, group_size=4))
    log = history_log(url, store.backend, 5)
    assert isinstance(log, HistoryObjects)
    first = MetricHistory(registry, run="a", capacity=5, log=log, clock=clock())
    taken = [first.sample() for _ in range(3 * HISTORY_BATCH)]

    objects = store.backend.listdir(HISTORY_OBJECTS)
    assert 1 < len(objects) <= 5 // HISTORY_BATCH + 2  # the oldest ones deleted
    observer, registry = observed()  # a new process, on the same prefix
    second = MetricHistory(
        registry, run="b", capacity=5, log=history_log(url, store.backend, 5), clock=clock(9e3)
    )
    assert second.points() == taken[-5:]
    assert second.sample().values["committed_tokens"] == 40  # counters run on


def test_counter_keys_are_the_cumulative_instruments():
    assert "committed_tokens" in COUNTER_KEYS and "checkpoint_seconds_sum" in COUNTER_KEYS
    assert "rows" not in COUNTER_KEYS and "since_success" not in COUNTER_KEYS
