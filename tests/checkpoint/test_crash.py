"""SIGKILL inside every step of a checkpoint leaves the previous snapshot restorable."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rolloutd.checkpoint.backends import MANIFESTS, sequence_of
from rolloutd.checkpoint.faults import ENV, FaultPoint, parse, parse_stalls
from tests.checkpoint.crash_worker import checkpoint_once, expected_rows
from tests.checkpoint.helpers import Location, verify

ROOT = Path(__file__).resolve().parents[2]

BEFORE_PUBLICATION = [
    FaultPoint.JOURNAL_APPEND,
    FaultPoint.BUFFER_SAVE_MID,
    FaultPoint.SIDECAR_WRITE_MID,
    FaultPoint.COMPACT_MID,
    FaultPoint.COMMIT_BEFORE_RENAME,
]
AFTER_PUBLICATION = [FaultPoint.COMMIT_AFTER_RENAME, FaultPoint.RETIRE_MID]


def _worker(location: Location, count: int, fault: str | None = None) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k != ENV}
    if fault:
        env[ENV] = fault
    args = [location.url, json.dumps(location.options), str(count)]
    return subprocess.Popen(
        [sys.executable, "-m", "tests.checkpoint.crash_worker", *args], cwd=ROOT, env=env
    )


def _assert_consistent(location: Location, newest: int) -> None:
    """The newest snapshot verifies and holds exactly its rows; every kept one verifies."""
    store = location.open()
    resolution = store.resolve()
    assert resolution.skipped == []
    assert resolution.snapshot is not None
    assert resolution.snapshot.manifest.sequence == newest
    assert resolution.snapshot.rows() == expected_rows(newest)
    for manifest in store.list():
        assert verify(store, manifest) == []
    # every kept snapshot finds the acks journaled after it, none missing
    oldest = min(m.acks_through for m in store.list())
    acks = store.journal.read(oldest)
    assert [e.position for e in acks] == list(range(oldest + 1, store.journal.position + 1))
    assert store.journal.position >= newest


def _assert_no_garbage(location: Location) -> None:
    store = location.open()
    referenced = {e.path for m in store.list() for e in m.files()}
    stored = {
        f"{d}/{n}" for d in ("segments", "sidecars", "submissions") for n in location.listdir(d)
    }
    assert stored == referenced
    assert location.listdir("trash") == []
    assert location.listdir("tmp") == []


@pytest.mark.parametrize("point", BEFORE_PUBLICATION + AFTER_PUBLICATION, ids=lambda p: p.value)
def test_crash_at_each_point_keeps_a_restorable_snapshot(location: Location, point: FaultPoint):
    store = location.open()
    checkpoint_once(store)
    checkpoint_once(store)

    worker = _worker(location, 1, point.value)
    assert worker.wait(timeout=120) == -signal.SIGKILL

    newest = 2 if point in BEFORE_PUBLICATION else 3
    _assert_consistent(location, newest)
    # the next checkpoint after a restart succeeds and its retention clears the leftovers
    manifest = checkpoint_once(location.open())
    assert manifest.sequence == newest + 1
    _assert_consistent(location, newest + 1)
    _assert_no_garbage(location)


def _wait_for_snapshot_after(location: Location, newest: int, worker: subprocess.Popen) -> None:
    """Returns once the worker has published a snapshot newer than ``newest``, so that the kill
    lands among checkpoints rather than in the interpreter's start-up."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        assert worker.poll() is None, "the checkpoint worker exited on its own"
        names = location.listdir(MANIFESTS)  # a listing only: the worker holds the store
        if any((sequence_of(n) or 0) > newest for n in names if n.endswith(".json")):
            return
        time.sleep(0.05)
    raise AssertionError(f"no snapshot after {newest} within 120 s")


def test_sigkill_at_random_instants(location: Location):
    rng = random.Random(7)
    newest = 0
    for _ in range(4):
        worker = _worker(location, 0)
        _wait_for_snapshot_after(location, newest, worker)  # start-up time follows the load
        time.sleep(rng.uniform(0.0, 2.5))
        worker.send_signal(signal.SIGKILL)
        assert worker.wait(timeout=60) == -signal.SIGKILL
        sequences = location.open().sequences()
        assert sequences and sequences[0] > newest
        newest = sequences[0]
        _assert_consistent(location, newest)
    assert newest >= 2


def test_fault_spec_is_validated():
    assert parse("commit.before_rename, retire.mid:0.5") == {
        FaultPoint.COMMIT_BEFORE_RENAME: 1.0,
        FaultPoint.RETIRE_MID: 0.5,
    }
    with pytest.raises(ValueError, match=r"unknown fault point 'commit\.befor'"):
        parse("commit.befor")
    with pytest.raises(ValueError, match="within"):
        parse("retire.mid:2")


def test_stall_spec_is_validated():
    assert parse_stalls("claim.renew:1.5, commit.before_rename:0") == {
        FaultPoint.CLAIM_RENEW: 1.5,
        FaultPoint.COMMIT_BEFORE_RENAME: 0.0,
    }
    with pytest.raises(ValueError, match=r"ROLLOUTD_STALL: unknown fault point 'claim\.renw'"):
        parse_stalls("claim.renw:1")
    with pytest.raises(ValueError, match="needs the seconds"):
        parse_stalls("claim.renew")
