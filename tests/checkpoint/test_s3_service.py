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

import pytest

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
    for _ in range(3):
        scenario.crash_round(trainer, rng)
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
    finally:
        first.kill()

    second = ServeProcess.synthetic(url, "--checkpoint-interval", "0", env=env, cwd=tmp_path)
    try:
        second.wait_listening()
        after = _wait_for_points(second, lambda points: len({p["run"] for p in points}) == 2)
    finally:
        second.kill()
    kept = [p for p in after if p["run"] == before[0]["run"]]
    assert kept[: len(before)] == before  # every point served before the kill, unchanged
