"""SIGKILL the real service at random instants, also inside each checkpoint phase, many times in a
row; restart with ``--restore latest`` each time. Over one epoch every prompt must be acknowledged
exactly once."""

from __future__ import annotations

import json
import random
import threading
import time

import grpc
import pytest

from rolloutd.checkpoint.faults import FaultPoint
from tests.integration.proc import ServeProcess
from tests.integration.trainer_harness import Trainer

pytestmark = pytest.mark.process

PROMPTS = 36
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
def dataset(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text(
        "".join(
            json.dumps({"id": f"q{i}", "prompt": f"what is {i} + {i}?"}) + "\n"
            for i in range(PROMPTS)
        )
    )
    return path


def serve(tmp_path, dataset, fault: str | None = None, **extra_env) -> ServeProcess:
    env = {
        "ROLLOUTD_ENGINE__SYNTHETIC__TOKENS_PER_S": "150",
        "ROLLOUTD_ENGINE__MAX_TOKENS": "48",
        "ROLLOUTD_LIMITS__MAX_IN_FLIGHT": "2",
        "ROLLOUTD_LIMITS__BUFFER_CAPACITY": "8",
        "ROLLOUTD_LIMITS__REWIND_WINDOW": "2",
        "ROLLOUTD_CHECKPOINT__KEEP_LATEST": "2",
        "ROLLOUTD_CHECKPOINT__COMPACT_SEGMENTS": "3",
        **extra_env,
    }
    if fault:
        env["ROLLOUTD_FAULT"] = fault
    p = ServeProcess(
        [
            "--engine",
            "synthetic",
            "--dataset",
            str(dataset),
            "--epochs",
            "1",
            "--group-size",
            "2",
            "--grpc-port",
            "0",
            "--http-port",
            "0",
            "--checkpoint-dir",
            str(tmp_path / "ckpt"),
            "--checkpoint-interval",
            "0.15",
            "--restore",
            "latest",
        ],
        env=env,
        cwd=tmp_path,
        log_path=tmp_path / "serve.log",
    )
    return p


def finish(tmp_path, dataset, trainer: Trainer) -> None:
    """A last, undisturbed run to the end of the epoch; then the contract is checked."""
    p = serve(tmp_path, dataset)
    address = p.wait_listening()
    try:
        deadline = time.monotonic() + 120
        while len(trainer.acked) < PROMPTS and time.monotonic() < deadline:
            trainer.run(address, 2.0)
        status = trainer.status(address)
    finally:
        p.terminate()
    assert status.dataset_exhausted
    twice = {k: n for k, n in trainer.acked.items() if n != 1}
    assert not twice, f"acknowledged more than once: {twice}"
    assert len(trainer.acked) == PROMPTS, (
        f"never acknowledged: {PROMPTS - len(trainer.acked)} prompts"
    )


def crash_round(
    tmp_path, dataset, trainer: Trainer, rng: random.Random, fault: str | None
) -> int | None:
    """Trains against one service life; returns its exit status if it died by itself (a fault
    point fired) rather than by the test's SIGKILL timer or the end of the round."""
    p = serve(tmp_path, dataset, fault)
    address = p.wait_listening()
    if fault is None:
        threading.Timer(rng.uniform(0.2, 1.2), p.kill).start()
    deadline = time.monotonic() + 8.0
    while p.proc.poll() is None and time.monotonic() < deadline:
        try:
            trainer.run(address, deadline - time.monotonic())
        except grpc.RpcError as exc:
            if exc.code() not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED):  # type: ignore[attr-defined]
                raise
            time.sleep(0.05)
    died = p.proc.poll()
    p.kill()
    return died


def test_sigkill_at_random_instants_loses_nothing_and_duplicates_nothing(tmp_path, dataset):
    rng = random.Random(7)
    trainer = Trainer()
    for _ in range(8):
        crash_round(tmp_path, dataset, trainer, rng, None)
    assert 0 < len(trainer.acked) < PROMPTS or len(trainer.acked) == PROMPTS
    finish(tmp_path, dataset, trainer)
    log = (tmp_path / "serve.log").read_text()
    assert log.count("restored snapshot") >= 3  # restarts really restored something


@pytest.mark.parametrize("fault", PHASE_FAULTS, ids=lambda f: f.value)
def test_a_crash_inside_each_phase_leaves_the_previous_snapshot_restorable(
    tmp_path, dataset, fault
):
    rng = random.Random(hash(fault.value) & 0xFFFF)
    trainer = Trainer()
    crash_round(tmp_path, dataset, trainer, rng, None)  # a few snapshots first
    died = crash_round(tmp_path, dataset, trainer, rng, f"{fault.value}:0.5")
    assert died == -9, f"the fault point {fault.value} never fired"
    finish(tmp_path, dataset, trainer)
