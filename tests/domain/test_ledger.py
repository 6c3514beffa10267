"""The delivery ledger on its own: leases, acks, finalization, rewinds, what the journal named for
groups no snapshot held, and its part of a snapshot."""

from __future__ import annotations

import asyncio
from collections import OrderedDict

import pytest

from rolloutd.domain import ledger as ledger_module
from rolloutd.domain.errors import FailedPrecondition
from rolloutd.domain.group import Position, Prompt
from rolloutd.domain.journal import AckRecord, JournaledAck, Lease
from rolloutd.domain.ledger import (
    DeliveryLedger,
    LedgerState,
    LostAck,
    PendingAck,
    check_same_step,
    remember_finalized,
)
from rolloutd.domain.sampler import Admission


def lease(lease_id: str, *groups: int, at: float = 0.0, timeout: float = 10.0) -> Lease:
    return Lease(lease_id, groups, "trainer", at, at + timeout)


def ack(lease_id: str, *groups: int, step: int, at: float = 0.0) -> AckRecord:
    return AckRecord(lease_id, groups, step, at)


def admission(n: int) -> Admission:
    return Admission(Prompt(f"p{n}", "q"), Position(0, n))


def state_of(ledger: DeliveryLedger) -> tuple:
    """Everything a reader of the ledger can see."""
    return (
        dict(ledger.leases),
        dict(ledger.acks),
        list(ledger.finalized_leases.items()),
        ledger.max_acked_step,
        ledger.finalized_through,
        {lid: dict(ledger.lost_of(lid)) for lid in ledger.leases},
    )


def test_a_fresh_ledger_has_seen_no_step():
    ledger = DeliveryLedger()
    assert ledger.max_acked_step == -1 and ledger.finalized_through == -1
    assert ledger.highest_step == 0
    assert ledger.acked_at("nope") is None


def test_a_granted_lease_names_its_groups_in_lease_order():
    ledger = DeliveryLedger()
    ledger.grant(lease("a", 3, 1))
    ledger.grant(lease("b", 2))
    assert ledger.group_ids(["b", "a"]) == [2, 3, 1]
    assert ledger.leases["a"].group_ids == (3, 1)


def test_ending_a_lease_hands_back_its_lost_groups_admissions():
    ledger = DeliveryLedger()
    ledger.grant(lease("a", 1))
    ledger.keep_lost("a", {9: admission(9)})
    assert ledger.lost_of("a") == {9: admission(9)}
    ended, lost = ledger.end_lease("a")
    assert ended.lease_id == "a" and lost == {9: admission(9)}
    assert "a" not in ledger.leases and ledger.lost_of("a") == {}
    with pytest.raises(KeyError):
        ledger.end_lease("a")


def test_a_lease_expires_at_its_deadline_moved_on_by_the_pauses_since_its_grant():
    ledger = DeliveryLedger()
    ledger.grant(lease("early", 1, at=0.0, timeout=10.0))
    ledger.grant(lease("late", 2, at=5.0, timeout=10.0))
    assert ledger.expired(9.9) == []
    assert [x.lease_id for x in ledger.expired(10.0)] == ["early"]
    # a pause of 3 s noticed after t=2 does not count against the lease granted at 0
    paused = {0.0: 3.0, 5.0: 0.0}
    assert ledger.expired(12.0, lambda t: paused[t]) == []
    assert [x.lease_id for x in ledger.expired(13.0, lambda t: paused[t])] == ["early"]


def test_an_ack_ends_its_lease_and_waits_for_finalization():
    ledger = DeliveryLedger()
    ledger.grant(lease("a", 1, 2))
    ledger.keep_lost("a", {9: admission(9)})
    ledger.record_ack(ack("a", 1, 2, step=4))
    assert "a" not in ledger.leases and ledger.lost_of("a") == {}
    assert ledger.acks["a"].trainer_step == 4
    assert ledger.acked_at("a") == 4
    assert ledger.max_acked_step == 4 and ledger.highest_step == 4


def test_a_lower_ack_does_not_lower_the_highest_step_acked():
    ledger = DeliveryLedger()
    ledger.record_ack(ack("a", 1, step=7))
    ledger.record_ack(ack("b", 2, step=3))
    assert ledger.max_acked_step == 7


def test_finalize_ends_the_acks_through_its_step_and_remembers_their_leases():
    ledger = DeliveryLedger()
    for lid, step in (("a", 1), ("b", 2), ("c", 3)):
        ledger.record_ack(ack(lid, ord(lid), step=step))
    done = ledger.finalize(2)
    assert sorted(r.lease_id for r in done) == ["a", "b"]
    assert list(ledger.acks) == ["c"]
    assert ledger.finalized_through == 2
    # a late retry of a finalized lease's ack still finds its step
    assert ledger.acked_at("a") == 1 and ledger.acked_at("b") == 2
    assert dict(ledger.finalized_leases) == {"a": 1, "b": 2}


def test_finalize_never_moves_the_finalized_step_back():
    ledger = DeliveryLedger()
    ledger.finalize(5)
    ledger.finalize(2)
    assert ledger.finalized_through == 5 and ledger.highest_step == 5


def test_rewind_undoes_the_later_acks_oldest_first_and_their_lost_acks():
    ledger = DeliveryLedger()
    ledger.record_ack(ack("s1", 1, step=1, at=1.0))
    ledger.record_ack(ack("late", 3, step=5, at=3.0))
    ledger.record_ack(ack("early", 2, step=4, at=2.0))
    kept, gone = LostAck(1, (admission(7),)), LostAck(4, (admission(8),))
    ledger.lost_ack(kept)
    ledger.lost_ack(gone)
    undone, lost = ledger.rewind(2)
    assert [r.lease_id for r in undone] == ["early", "late"]  # by when they were acked
    assert lost == [gone]
    assert list(ledger.acks) == ["s1"]
    assert ledger.max_acked_step == 2
    # what stays is undone by a later rewind to before it
    undone, lost = ledger.rewind(0)
    assert [r.lease_id for r in undone] == ["s1"] and lost == [kept]
    assert ledger.max_acked_step == 0


def test_an_ack_is_idempotent_only_at_its_own_step():
    check_same_step("a", 3, 3)
    with pytest.raises(FailedPrecondition, match="trainer_step 3, not 4"):
        check_same_step("a", 3, 4)


async def test_a_queued_ack_is_applicable_once_its_record_is_durable():
    ledger = DeliveryLedger()
    loop = asyncio.get_running_loop()
    durable, failed, waiting = loop.create_future(), loop.create_future(), loop.create_future()
    pendings = [
        PendingAck(JournaledAck(ack(lid, 1, step=1)), fut)
        for lid, fut in (("ok", durable), ("failed", failed), ("waiting", waiting))
    ]
    for p in pendings:
        ledger.queue(p)
    durable.set_result(1)
    failed.set_exception(OSError("disk full"))
    assert ledger.applicable() == [pendings[0]]
    assert ledger.pending("waiting") is pendings[2]
    waiting.set_result(2)
    assert ledger.applicable() == [pendings[0], pendings[2]]


async def test_a_queued_ack_is_taken_out_once_whoever_comes_first():
    ledger = DeliveryLedger()
    pending = PendingAck(
        JournaledAck(ack("a", 1, step=1)), asyncio.get_running_loop().create_future()
    )
    ledger.queue(pending)
    assert ledger.unqueue(pending)
    assert not ledger.unqueue(pending)
    assert ledger.pending("a") is None


def test_capture_then_load_into_a_fresh_ledger_gives_the_same_ledger():
    ledger = DeliveryLedger()
    ledger.grant(lease("live", 1, 2, at=5.0))
    ledger.grant(lease("restored", 3))
    ledger.keep_lost("restored", {9: admission(9)})
    ledger.record_ack(ack("old", 4, step=1))
    ledger.record_ack(ack("new", 5, step=6))
    ledger.finalize(1)
    ledger.lost_ack(LostAck(6, (admission(8),)))

    fresh = DeliveryLedger()
    fresh.load(ledger.capture())
    assert state_of(fresh) == state_of(ledger)
    assert fresh.acked_at("old") == 1
    # the lost ack came along: a rewind before it gives it back
    assert fresh.rewind(5)[1] == [LostAck(6, (admission(8),))]


def test_a_capture_holds_only_the_leases_finalized_since_the_previous_one():
    ledger = DeliveryLedger()
    ledger.record_ack(ack("a", 1, step=1))
    ledger.finalize(1)
    assert dict(ledger.capture().finalized_leases) == {"a": 1}
    ledger.record_ack(ack("b", 2, step=2))
    ledger.finalize(2)
    assert dict(ledger.capture().finalized_leases) == {"b": 2}
    assert ledger.capture().finalized_leases == {}
    assert dict(ledger.finalized_leases) == {"a": 1, "b": 2}  # remembered all the same


def test_a_failed_capture_put_back_is_in_the_next_capture_oldest_first():
    ledger = DeliveryLedger()
    ledger.record_ack(ack("a", 1, step=1))
    ledger.finalize(1)
    failed = ledger.capture()
    ledger.record_ack(ack("b", 2, step=2))
    ledger.finalize(2)
    ledger.restore_uncaptured(failed)
    assert list(ledger.capture().finalized_leases.items()) == [("a", 1), ("b", 2)]


def test_loading_a_state_marks_nothing_as_finalized_since_a_capture():
    ledger = DeliveryLedger()
    ledger.load(LedgerState(finalized_leases={"a": 1}, finalized_through=1))
    assert ledger.acked_at("a") == 1
    assert ledger.capture().finalized_leases == {}


def test_the_finalized_leases_remembered_are_bounded_oldest_forgotten(monkeypatch):
    monkeypatch.setattr(ledger_module, "ACKED_LEASES_REMEMBERED", 3)
    remembered = remember_finalized(OrderedDict(), {"a": 1, "b": 1})
    remember_finalized(remembered, {"c": 2, "d": 2})
    assert list(remembered) == ["b", "c", "d"]
