"""The real service with its checkpoints in S3 (moto's server mode over HTTP): killed with
SIGKILL at random instants and inside the commit, it restores from the bucket each time and every
prompt is acknowledged exactly once."""

from __future__ import annotations

import json
import random
import time
import urllib.request
import uuid
from typing import Any

import fsspec
import pytest

from rolloutd.checkpoint.backends import MANIFESTS, sequence_of
from rolloutd.telemetry.history import HISTORY_OBJECTS
from tests.conftest import BUCKET
from tests.integration.crash_scenario import Scenario
from tests.integration.proc import ServeProcess
from tests.integration.trainer_harness import Trainer

pytestmark = [pytest.mark.s3, pytest.mark.process]


def test_checkpoints_in_s3_survive_sigkill(tmp_path, s3_options):
    url = f"s3://{BUCKET}/{uuid.uuid4().hex}"
    scenario = Scenario(
        tmp_path, url, {"ROLLOUTD_CHECKPOINT__STORAGE_OPTIONS": json.dumps(s3_options)}
    )
    rng = random.Random(3)
    trainer = Trainer()
    fs = fsspec.filesystem("s3", **s3_options, skip_instance_cache=True, use_listings_cache=False)
    manifests = f"{url.removeprefix('s3://')}/{MANIFESTS}"

    def snapshots() -> int:
        """The newest published sequence (retention keeps only the latest few manifests)."""
        names = fs.ls(manifests, refresh=True) if fs.exists(manifests) else []
        return max((sequence_of(n.rsplit("/", 1)[-1]) or 0 for n in names), default=0)

    for _ in range(3):
        scenario.crash_round(trainer, rng, snapshots=snapshots)
    died = scenario.crash_round(trainer, rng, "commit.after_rename:0.5")
    assert died == -9
    scenario.finish(trainer)
    assert scenario.log.count("restored snapshot") >= 3


def _history(service: ServeProcess) -> list[dict[str, Any]]:
    with urllib.request.urlopen(f"http://{service.http}/v1/dashboard/history", timeout=10) as r:
        return json.load(r)["points"]


def _wait_for_points(service: ServeProcess, enough, timeout: float = 30.0) -> list[dict[str, Any]]:
    deadline = time.monotonic() + timeout
    while not enough(points := _history(service)):
        assert service.proc.poll() is None, service.output
        runs = sorted({p["run"] for p in points})
        assert time.monotonic() < deadline, f"history holds {len(points)} points of runs {runs}"
        time.sleep(0.05)
    return points


def _stored_points(url: str, s3_options: dict[str, Any]) -> int:
    """Points the service has written to the bucket (a point is served before it is written)."""
    fs = fsspec.filesystem("s3", **s3_options, skip_instance_cache=True)
    path = f"{url.removeprefix('s3://')}/{HISTORY_OBJECTS}"
    names = [n for n in fs.ls(path) if n.endswith(".jsonl")] if fs.exists(path) else []
    return sum(len(fs.cat_file(n).splitlines()) for n in names)


def test_the_dashboard_history_is_kept_in_the_bucket_across_a_sigkill(tmp_path, s3_options):
    url = f"s3://{BUCKET}/{uuid.uuid4().hex}"
    env = {
        "ROLLOUTD_CHECKPOINT__STORAGE_OPTIONS": json.dumps(s3_options),
        "ROLLOUTD_HTTP__DASHBOARD_INTERVAL_S": "0.1",
    }
    first = ServeProcess.synthetic(url, "--checkpoint-interval", "0", env=env, cwd=tmp_path)
    try:
        first.wait_listening()
        before = _wait_for_points(first, lambda points: len(points) >= 5)
        deadline = time.monotonic() + 30
        while _stored_points(url, s3_options) < len(before):  # written, not only served
            assert time.monotonic() < deadline, "the served points never reached the bucket"
            time.sleep(0.05)
    finally:
        first.kill()

    second = ServeProcess.synthetic(url, "--checkpoint-interval", "0", env=env, cwd=tmp_path)
    try:
        second.wait_listening()
        after = _wait_for_points(second, lambda points: len({p["run"] for p in points}) == 2)
    finally:
        second.kill()
    kept = [p for p in after if p["run"] == before[0]["run"]]
    assert kept[: len(before)] == before  # every point written before the kill, unchanged
