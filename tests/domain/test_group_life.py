"""A group's life cycle is one declared table: every allowed transition can be taken through the
buffer, and every other one raises an invariant error."""

from __future__ import annotations

from array import array
from itertools import product

import pytest

from rolloutd.domain.buffer import RolloutBuffer
from rolloutd.domain.errors import InvariantError
from rolloutd.domain.group import (
    BUFFERED,
    TERMINAL,
    TRANSITIONS,
    Group,
    GroupMeta,
    GroupState,
    Prompt,
    Sample,
    check_transition,
)

S = GroupState


def _sample(index: int) -> Sample:
    return Sample(index, array("i", [1, 2]), array("f", [-0.1, -0.2]), "ab", "stop", 0,
                  array("i", [7]), index, 0.0, 1.0)  # fmt: skip


class Walk:
    """A buffer and the transitions its groups took, read from their states before and after
    each operation (a group that left the buffer left as ``fate``)."""

    def __init__(self) -> None:
        self.buffer = RolloutBuffer()
        self.taken: set[tuple[GroupState, GroupState]] = set()
        self.next_gid = 1

    def admit(self) -> int:
        gid, self.next_gid = self.next_gid, self.next_gid + 1
        self.buffer.add(Group(GroupMeta(gid, Prompt(f"p{gid}", "q"), None, 2, 0, 0.0, gid)))
        return gid

    def do(self, gids, op, *args, fate=None):  # type: ignore[no-untyped-def]
        groups = self.buffer.groups
        before = {gid: groups[gid].state for gid in gids}
        result = op(*args)
        self.taken |= {(before[g], groups[g].state if g in groups else fate) for g in gids}
        return result

    def finished(self) -> int:
        gid = self.admit()
        for i in range(2):
            self.buffer.stage(gid, _sample(i))
        self.do([gid], self.buffer.finish, gid)
        return gid

    def committed(self) -> int:
        gid = self.finished()
        self.do([gid], self.buffer.commit, gid, 1.0)
        return gid

    def remove(self, gid: int, fate: GroupState) -> None:
        self.do([gid], self.buffer.remove, gid, fate, fate=fate)


def test_every_allowed_transition_is_taken_by_a_buffer_operation():
    w = Walk()
    b = w.buffer
    # generating -> finishing -> committed -> leased -> committed (requeue) -> leased -> acked
    # -> committed (rewind) -> leased -> acked -> finalized
    gid = w.committed()
    leased = w.do([gid], b.lease, "l1", 1)
    w.do([gid], b.requeue, leased)
    w.do([gid], b.lease, "l2", 1)
    w.do([gid], b.ack, "l2", (gid,), 5)
    w.do([gid], b.recommit, [gid])  # a rewind
    w.do([gid], b.lease, "l3", 1)
    w.do([gid], b.ack, "l3", (gid,), 6)
    w.do([gid], b.remove, gid, S.FINALIZED, fate=S.FINALIZED)
    # committed -> acked: journal replay of a lease granted and acked after the snapshot
    gid = w.committed()
    w.do([gid], b.ack, "l4", (gid,), 7)
    # generating and finishing -> lost: replay of an ack of groups the snapshot held unfinished
    for gid in [w.admit(), w.finished()]:
        w.remove(gid, S.LOST)
    # evictions and drops
    for fate in (S.EVICTED, S.DROPPED):
        w.remove(w.admit(), fate)
        w.remove(w.finished(), fate)
    w.remove(w.committed(), S.EVICTED)
    w.remove(w.committed(), S.DROPPED)  # undeliverable, or its leases expired too often

    assert w.taken == TRANSITIONS


@pytest.mark.parametrize(
    ("before", "after"),
    [pair for pair in product(GroupState, GroupState) if pair not in TRANSITIONS],
    ids=lambda s: s.value,
)
def test_a_transition_outside_the_table_is_an_invariant_error(before, after):
    with pytest.raises(InvariantError, match=f"from {before.value} to {after.value}"):
        check_transition(7, before, after)


def test_the_buffer_refuses_a_disallowed_change():
    w = Walk()
    b = w.buffer
    generating = w.admit()
    b.stage(generating, _sample(0))
    b.stage(generating, _sample(1))
    with pytest.raises(InvariantError, match="from generating to committed"):
        b.commit(generating, 1.0)  # the finishing stage comes first
    committed = w.committed()
    with pytest.raises(InvariantError, match="from committed to lost"):
        b.remove(committed, S.LOST)  # only replay of a record loses a group, never a ready one
    with pytest.raises(InvariantError, match="not a terminal state"):
        b.remove(committed, S.COMMITTED)
    with pytest.raises(InvariantError, match="1/2 siblings"):
        partial = w.admit()
        b.stage(partial, _sample(0))
        b.finish(partial)
    assert b.groups[committed].state is S.COMMITTED  # a refused change changes nothing


def test_only_the_states_between_admission_and_leaving_are_buffered():
    assert set(BUFFERED) | TERMINAL == set(GroupState)
    assert {a for a, _ in TRANSITIONS} == set(BUFFERED)
    assert not {a for a, _ in TRANSITIONS} & TERMINAL
