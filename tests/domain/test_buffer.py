"""The buffer's change tracking and the delivery ledger's: a capture hands over what changed since
the previous one."""

from __future__ import annotations

from array import array
from dataclasses import replace

from rolloutd.domain.buffer import RolloutBuffer
from rolloutd.domain.group import Group, GroupMeta, GroupState, Prompt, Sample
from rolloutd.domain.journal import AckRecord, Lease
from rolloutd.domain.ledger import DeliveryLedger


def _committed(buf: RolloutBuffer, group_id: int) -> None:
    """One group of one sibling, committed."""
    buf.add(Group(GroupMeta(group_id, Prompt(f"p{group_id}", "q"), None, 1, 0, 0.0, group_id)))
    sample = Sample(0, array("i", [1]), array("f", [0.0]), "x", "stop", 0, array("i"), 0, 0.0, 0.0)
    buf.stage(group_id, sample)
    buf.finish(group_id)
    buf.commit(group_id, 0.0)


def _acked(
    buf: RolloutBuffer, ledger: DeliveryLedger, group_ids: list[int], lease_id: str, step: int
) -> None:
    """Groups of one sibling each, committed, leased together and acked at ``step``."""
    for gid in group_ids:
        _committed(buf, gid)
    taken = buf.lease(lease_id, len(group_ids))
    ledger.grant(Lease(lease_id, taken, "t", 0.0, 60.0))
    present = buf.ack(lease_id, taken, step)
    ledger.record_ack(AckRecord(lease_id, present, step, 0.0))


def _finalize(buf: RolloutBuffer, ledger: DeliveryLedger, step: int) -> None:
    for record in ledger.finalize(step):
        for gid in record.group_ids:
            buf.remove(gid, GroupState.FINALIZED)


def _finalized(buf: RolloutBuffer, ledger: DeliveryLedger, group_id: int, lease_id: str, step: int):
    """One group of one sibling, committed, leased, acked at ``step`` and finalized."""
    _acked(buf, ledger, [group_id], lease_id, step)
    _finalize(buf, ledger, step)


def test_capture_hands_over_only_the_leases_finalized_since_the_last_one():
    buf, ledger = RolloutBuffer(), DeliveryLedger()
    _finalized(buf, ledger, 1, "a", 1)
    first = ledger.capture()
    _finalized(buf, ledger, 2, "b", 2)
    second = ledger.capture()
    assert dict(first.finalized_leases) == {"a": 1}
    assert dict(second.finalized_leases) == {"b": 2}
    assert dict(ledger.finalized_leases) == {"a": 1, "b": 2}  # the whole ledger stays here
    assert ledger.acked_at("a") == 1  # acked already (finalized)


def test_a_failed_capture_is_handed_over_again_in_order():
    buf, ledger = RolloutBuffer(), DeliveryLedger()
    _finalized(buf, ledger, 1, "a", 1)
    failed = ledger.capture()
    _finalized(buf, ledger, 2, "b", 2)
    ledger.restore_uncaptured(failed)
    assert list(ledger.capture().finalized_leases) == ["a", "b"]
    assert not ledger.capture().finalized_leases


def test_acked_groups_follow_acks_finalize_rewind_and_load():
    buf, ledger = RolloutBuffer(), DeliveryLedger()
    _acked(buf, ledger, [1, 2], "a", 1)
    _acked(buf, ledger, [3], "b", 2)
    _acked(buf, ledger, [4, 5, 6], "c", 3)
    assert buf.acked_groups == 6
    assert ledger.acked_at("a") == 1  # a repeated ack is recognised, and counts once
    assert buf.acked_groups == 6
    _finalize(buf, ledger, 1)
    assert buf.acked_groups == 4
    undone, _ = ledger.rewind(2)  # lease c's groups are available again
    buf.recommit([gid for r in undone for gid in r.group_ids])
    assert buf.acked_groups == 1
    whole = buf.capture()
    loaded = RolloutBuffer()
    loaded.load(replace(whole, groups={gid: g.meta for gid, g in buf.groups.items()}))
    assert loaded.acked_groups == 1 == sum(len(r.group_ids) for r in ledger.acks.values())
