"""One writer per store, on a local directory and on S3 (moto's server, conditional puts): a live
holder is refused with its name, a silent one taken over, and a holder that comes back fenced."""

from __future__ import annotations

import json
import time

import pytest

from rolloutd.checkpoint.claim import LOCK, Fenced, StoreHeld
from rolloutd.checkpoint.store import SnapshotStore
from tests.checkpoint.helpers import Location, journal_write


def open_store(location: Location, timeout_s: float) -> SnapshotStore:
    return SnapshotStore(location.url, location.options, lock_timeout_s=timeout_s)


def test_a_live_holder_is_refused_with_its_name(location: Location):
    first = open_store(location, 30)
    assert first.claim.acquire() is None
    second = open_store(location, 30)
    with pytest.raises(StoreHeld, match=r"held by host \S+ pid \d+ since \d{4}-\d\d-\d\dT"):
        second.claim.acquire()
    first.claim.renew()  # the refused attempt changed nothing
    first.claim.release()
    assert second.claim.acquire() is None  # released at shutdown: no wait


def test_a_silent_holder_is_taken_over_and_fenced_when_it_comes_back(location: Location):
    old = open_store(location, 0.5)
    old.claim.acquire()
    journal_write(old.journal, {"n": 1})
    time.sleep(0.7)  # stopped renewing for longer than the timeout (a SIGSTOP, a frozen VM)
    new = open_store(location, 0.5)
    taken = new.claim.acquire()
    assert taken is not None and taken.epoch == 0
    with pytest.raises(Fenced, match="another process took over"):
        journal_write(old.journal, {"n": 2})  # its first write finds out, and writes nothing
    with pytest.raises(Fenced):
        old.publish(None)  # type: ignore[arg-type]  (refused before the manifest is looked at)
    assert old.claim.fenced is not None and not old.claim.held
    assert journal_write(new.journal, {"n": 3}) == 2
    assert [e.record["n"] for e in new.journal.read(0)] == [1, 3]
    held = json.loads(bytes(new.backend.read(LOCK)))
    assert held["epoch"] == 1 and held["token"] != taken.token


def test_a_dead_holder_on_this_host_is_taken_over_at_once(location: Location):
    first = open_store(location, 30)
    first.claim.acquire()
    record = json.loads(bytes(first.backend.read(LOCK)))
    # the holder's process is gone (a SIGKILL): its pid now names another process, or none
    record["process_start"] = "1"
    first.backend.put(LOCK, json.dumps(record).encode())
    second = open_store(location, 30)
    assert second.claim.acquire() is not None
