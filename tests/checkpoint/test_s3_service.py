"""The real service with its checkpoints in S3 (moto's server mode over HTTP): killed with
SIGKILL at random instants and inside the commit, it restores from the bucket each time and every
prompt is acknowledged exactly once."""

from __future__ import annotations

import json
import random
import uuid

import pytest

from tests.conftest import BUCKET
from tests.integration.crash_scenario import Scenario
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
