"""The group id allocator on its own: ids issued only from journaled blocks, unique across a
fleet, never issued twice across a restart (capture/restore, journal replay)."""

from __future__ import annotations

import pytest

from rolloutd.domain.errors import InvariantError
from rolloutd.domain.ids import ID_BITS, ID_BLOCK, GroupIds, local_id, request_id


class Reservations:
    """The journal's ``reserve_ids``: the blocks reserved, failing with ``fail`` when set."""

    def __init__(self) -> None:
        self.through: list[int] = []
        self.fail: OSError | None = None

    async def __call__(self, through: int) -> None:
        if self.fail is not None:
            raise self.fail
        self.through.append(through)


async def test_no_id_is_issued_before_its_block_is_journaled():
    ids = GroupIds(0, Reservations())
    assert not ids.reserved
    with pytest.raises(InvariantError, match="before it was reserved"):
        ids.issue()


async def test_ids_are_issued_in_order_from_the_block_reserved_and_no_further():
    journal = Reservations()
    ids = GroupIds(0, journal)
    await ids.reserve()
    assert journal.through == [ID_BLOCK]
    issued = [ids.issue() for _ in range(ID_BLOCK)]
    assert issued == list(range(1, ID_BLOCK + 1))
    assert not ids.reserved
    await ids.reserve()
    assert journal.through == [ID_BLOCK, 2 * ID_BLOCK]
    assert ids.issue() == ID_BLOCK + 1


async def test_a_reservation_that_cannot_be_journaled_issues_nothing():
    journal = Reservations()
    journal.fail = OSError("disk full")
    ids = GroupIds(0, journal)
    with pytest.raises(OSError):
        await ids.reserve()
    assert not ids.reserved


async def test_a_replicas_ids_carry_its_index_in_the_high_bits():
    ids = GroupIds(3, Reservations())
    await ids.reserve()
    first, second = ids.issue(), ids.issue()
    assert first >> ID_BITS == 3 and second >> ID_BITS == 3
    assert (local_id(first), local_id(second)) == (1, 2)
    assert ids.next_local == 3


async def test_ids_seen_in_the_journal_are_never_issued_again_but_another_replicas_are_ignored():
    ids = GroupIds(1, Reservations())
    mine, theirs = (1 << ID_BITS) | 40, (2 << ID_BITS) | 900
    ids.seen([mine, theirs])
    assert ids.next_local == 41
    ids.seen([(1 << ID_BITS) | 5])  # older than the counter: no step back
    assert ids.next_local == 41


def test_a_journaled_reservation_moves_the_counter_past_its_block():
    ids = GroupIds(0, Reservations())
    ids.seen_reservation(2048)
    assert ids.next_local == 2049
    ids.seen_reservation(10)
    assert ids.next_local == 2049


async def test_a_restore_from_a_capture_issues_past_every_id_that_may_have_been_handed_out():
    ids = GroupIds(0, Reservations())
    await ids.reserve()
    issued = {ids.issue() for _ in range(3)}
    state = ids.capture()
    assert state == ID_BLOCK + 1  # the rest of the reserved block may have gone out meanwhile

    restored = GroupIds(0, Reservations())
    restored.restore(state)
    assert not restored.reserved  # a new block is journaled before anything is issued
    await restored.reserve()
    again = restored.issue()
    assert again not in issued and again > max(issued)
    assert restored.capture() == ids.capture() + ID_BLOCK


async def test_the_capture_of_an_allocator_past_its_reservation_is_its_counter():
    ids = GroupIds(0, Reservations())
    ids.seen([70])
    assert ids.capture() == 71


def test_a_siblings_request_id_names_its_group_and_index():
    assert request_id(12, 3) == "g12-s3"
    assert request_id(12, 3) == request_id(12, 3) != request_id(12, 4)
