"""One writer per store, on a local directory and on S3 (moto's server, conditional puts): a live
holder is refused with its name, a silent one taken over, and a holder that comes back fenced."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time

import pytest

from rolloutd.checkpoint.claim import Fenced, StoreHeld
from rolloutd.checkpoint.faults import STALL_ENV
from rolloutd.checkpoint.store import SnapshotStore
from tests.checkpoint.helpers import Location, journal_write, make_rows, publish
from tests.waiting import until


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


def held_since(store: SnapshotStore) -> float:
    """When the store's claim record was last renewed."""
    holder = store.claim.current()
    assert holder is not None
    return holder.renewed_at


def test_a_silent_holder_is_taken_over_and_fenced_when_it_comes_back(location: Location):
    old = open_store(location, 0.5)
    old.claim.acquire()
    journal_write(old.journal, {"n": 1})
    # stops renewing for longer than the timeout (a SIGSTOP, a frozen VM)
    until("the claim lapsed", lambda: time.time() - held_since(old) > 0.5, every_s=0.05)
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
    held = new.claim.current()
    assert held is not None and held.epoch == 1 and held.token != taken.token


HOLD = """
import json, sys, time
from rolloutd.checkpoint.store import SnapshotStore
store = SnapshotStore(sys.argv[1], json.loads(sys.argv[2]), lock_timeout_s=30)
store.claim.acquire()
print("held", flush=True)
time.sleep(600)
"""


def test_a_dead_holder_on_this_host_is_taken_over_at_once(location: Location):
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD, location.url, json.dumps(location.options)],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert holder.stdout is not None and holder.stdout.readline() == "held\n"
    holder.kill()  # SIGKILL: the claim stays fresh, its process is gone
    holder.wait()
    second = open_store(location, 30)
    taken = second.claim.acquire()
    assert taken is not None and taken.pid == holder.pid


def take_over(store: SnapshotStore) -> float:
    """Claims ``store`` as a replacement that keeps trying would; returns when it took over."""
    while True:
        try:
            store.claim.acquire()
        except StoreHeld:
            time.sleep(0.05)
            continue
        return time.time()


def test_a_holder_whose_renewal_stalled_past_the_timeout_writes_nothing_after_a_takeover(
    tmp_path, monkeypatch
):
    """The renewal's write stalls (the disk stops answering) for longer than the lock timeout,
    then goes through, nobody having tried to take over meanwhile, with a record that has lapsed
    already: a replacement takes over at once. The holder counted its claim from before the
    stalled write, so it knows it lapsed and writes nothing more (its next write renews first,
    and finds the takeover)."""
    url = str(tmp_path / "store")
    holder = SnapshotStore(url, lock_timeout_s=1.0)
    holder.claim.acquire()
    journal_write(holder.journal, {"n": 1})
    monkeypatch.setenv(STALL_ENV, "claim.renew:1.5")
    holder.claim.renew()
    monkeypatch.delenv(STALL_ENV)  # the disk answers again
    taker = SnapshotStore(url, lock_timeout_s=1.0)
    assert taker.claim.acquire() is not None
    with pytest.raises(Fenced, match="another process took over"):
        journal_write(holder.journal, {"n": 2})
    assert journal_write(taker.journal, {"n": 3}) == 2
    assert [e.record["n"] for e in taker.journal.read(0)] == [1, 3]


def test_a_publish_stalled_past_the_timeout_is_fenced_before_its_manifest_appears(
    tmp_path, monkeypatch
):
    """The manifest is durable under its temporary name when the disk stalls for longer than the
    lock timeout (the renewals stall with it, so none comes), and a replacement takes over: the
    rename that would publish it must not happen."""
    url = str(tmp_path / "store")
    holder = SnapshotStore(url, lock_timeout_s=1.0)
    holder.claim.acquire()
    monkeypatch.setenv(STALL_ENV, "commit.before_rename:2")
    raised: list[BaseException] = []

    def publish_one() -> None:
        try:
            publish(holder, None, make_rows(0, 4))
        except BaseException as exc:
            raised.append(exc)

    publishing = threading.Thread(target=publish_one)
    publishing.start()
    taker = SnapshotStore(url, lock_timeout_s=1.0)
    take_over(taker)
    publishing.join()
    assert taker.sequences() == [], "a holder published after another process took over"
    assert [type(e) for e in raised] == [Fenced]
