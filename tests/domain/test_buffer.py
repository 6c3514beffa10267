"""The buffer's change tracking: a capture hands over what changed since the previous one."""

from __future__ import annotations

from array import array
from dataclasses import replace

from rolloutd.domain.buffer import AckRecord, RolloutBuffer
from rolloutd.domain.group import Group, GroupMeta, Prompt, Sample


def _finalized(buf: RolloutBuffer, group_id: int, lease_id: str, step: int) -> None:
    """One group of one sibling, committed, leased, acked at ``step`` and finalized."""
    buf.add(Group(GroupMeta(group_id, Prompt(f"p{group_id}", "q"), None, 1, 0, 0.0, group_id)))
    sample = Sample(0, array("i", [1]), array("f", [0.0]), "x", "stop", 0, array("i"), 0, 0.0, 0.0)
    buf.stage(group_id, sample)
    buf.finish(group_id)
    buf.commit(group_id, 0.0)
    buf.lease(lease_id, 1, "t", 0.0, 60.0)
    buf.ack(AckRecord(lease_id, (group_id,), step, 0.0))
    buf.finalize(step)


def test_capture_hands_over_only_the_leases_finalized_since_the_last_one():
    buf = RolloutBuffer()
    _finalized(buf, 1, "a", 1)
    first = buf.capture()
    _finalized(buf, 2, "b", 2)
    second = buf.capture()
    assert dict(first.finalized_leases) == {"a": 1}
    assert dict(second.finalized_leases) == {"b": 2}
    assert dict(buf.finalized_leases) == {"a": 1, "b": 2}  # the whole ledger stays here
    assert buf.ack(AckRecord("a", (1,), 1, 0.0)) is None  # acked already (finalized)


def test_a_failed_capture_is_handed_over_again_in_order():
    buf = RolloutBuffer()
    _finalized(buf, 1, "a", 1)
    failed = buf.capture()
    _finalized(buf, 2, "b", 2)
    buf.restore_uncaptured(failed)
    assert list(buf.capture().finalized_leases) == ["a", "b"]
    assert not buf.capture().finalized_leases


def _acked(buf: RolloutBuffer, group_ids: list[int], lease_id: str, step: int) -> None:
    """Groups of one sibling each, committed, leased together and acked at ``step``."""
    for gid in group_ids:
        buf.add(Group(GroupMeta(gid, Prompt(f"p{gid}", "q"), None, 1, 0, 0.0, gid)))
        sample = Sample(
            0, array("i", [1]), array("f", [0.0]), "x", "stop", 0, array("i"), 0, 0.0, 0.0
        )
        buf.stage(gid, sample)
        buf.finish(gid)
        buf.commit(gid, 0.0)
    buf.lease(lease_id, len(group_ids), "t", 0.0, 60.0)
    buf.ack(AckRecord(lease_id, tuple(group_ids), step, 0.0))


def test_acked_groups_follow_acks_finalize_rewind_and_load():
    buf = RolloutBuffer()
    _acked(buf, [1, 2], "a", 1)
    _acked(buf, [3], "b", 2)
    _acked(buf, [4, 5, 6], "c", 3)
    assert buf.acked_groups == 6
    assert buf.ack(AckRecord("a", (1, 2), 1, 0.0)) is None  # a repeated ack counts once
    assert buf.acked_groups == 6
    buf.finalize(1)
    assert buf.acked_groups == 4
    buf.rewind(2)  # lease c's groups are available again
    assert buf.acked_groups == 1
    whole = buf.capture()
    loaded = RolloutBuffer()
    loaded.load(replace(whole, groups={gid: g.meta for gid, g in buf.groups.items()}))
    assert loaded.acked_groups == 1 == sum(len(r.group_ids) for r in loaded.acks.values())
