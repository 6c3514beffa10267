"""SIGKILL the real service at random instants, also inside each checkpoint phase, many times in a
row; restart with ``--restore latest`` each time. Over one epoch every prompt must be acknowledged
exactly once."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from rolloutd.checkpoint.backends import MANIFESTS, sequence_of
from rolloutd.checkpoint.faults import FaultPoint
from tests.integration.crash_scenario import Scenario
from tests.integration.trainer_harness import Trainer

pytestmark = pytest.mark.process

PHASE_FAULTS = [
    FaultPoint.BARRIER_WAIT,
    FaultPoint.EXCLUSIVE_HOLD,
    FaultPoint.BUFFER_SAVE_MID,
    FaultPoint.SIDECAR_WRITE_MID,
    FaultPoint.COMMIT_BEFORE_RENAME,
    FaultPoint.COMMIT_AFTER_RENAME,
    FaultPoint.RETIRE_MID,
    FaultPoint.JOURNAL_APPEND,
]


@pytest.fixture
def scenario(tmp_path):
    return Scenario(tmp_path, str(tmp_path / "ckpt"))


def test_sigkill_at_random_instants_loses_nothing_and_duplicates_nothing(scenario):
    rng = random.Random(7)
    trainer = Trainer()
    manifests = Path(scenario.checkpoint_dir) / MANIFESTS

    def snapshots() -> int:
        """The newest published sequence."""
        names = [p.name for p in manifests.iterdir()] if manifests.exists() else []
        return max((sequence_of(n) or 0 for n in names), default=0)

    for life in range(8):
        # the first lives are killed only once they published a snapshot (on loaded cores a
        # kill could come first); later ones may find the epoch done, with nothing to publish
        scenario.crash_round(trainer, rng, snapshots=snapshots if life < 3 else None)
    scenario.finish(trainer)
    assert scenario.log.count("restored snapshot") >= 3  # restarts really restored something


@pytest.mark.parametrize("fault", PHASE_FAULTS, ids=lambda f: f.value)
def test_a_crash_inside_each_phase_leaves_the_previous_snapshot_restorable(scenario, fault):
    rng = random.Random(hash(fault.value) & 0xFFFF)
    trainer = Trainer()
    scenario.crash_round(trainer, rng)  # a few snapshots first
    died = scenario.crash_round(trainer, rng, f"{fault.value}:0.5")
    assert died == -9, f"the fault point {fault.value} never fired"
    scenario.finish(trainer)
