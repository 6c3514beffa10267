"""Group ids, and the engine request ids of their siblings.

A group id is unique across a fleet: its low :data:`ID_BITS` bits count within a replica, the bits
above are the replica's index. :class:`GroupIds` issues them, and journals each block of
:data:`ID_BLOCK` ids as reserved before any of it is handed out, so ids are unique for the life of
a store. A sibling's request id is built from its group id and index, so it is stable across
restarts and unique per sibling.
"""

from __future__ import annotations

from collections.abc import Callable, Coroutine, Iterable
from typing import Any

from rolloutd.domain.errors import InvariantError

ID_BITS = 40
"""Low bits of a group id count within a replica; the bits above are the replica's index, so ids
are unique across a fleet (replica 0's ids are the plain counter)."""
ID_BLOCK = 1024
"""Group ids reserved in the journal at a time: one durable write per this many admissions."""


def local_id(group_id: int) -> int:
    """The replica-local counter of a group id."""
    return group_id & ((1 << ID_BITS) - 1)


def request_id(group_id: int, index: int) -> str:
    return f"g{group_id}-s{index}"


class GroupIds:
    """The id allocator of one replica (see the module docstring)."""

    def __init__(self, replica: int, reserve: Callable[[int], Coroutine[Any, Any, None]]) -> None:
        """``reserve(through)`` journals local ids up to ``through`` as reserved (durable on
        return, ``OSError`` when it cannot be)."""
        self._replica = replica
        self._reserve = reserve
        self._next = 1
        """The replica-local counter of the next group id."""
        self._reserved_through = 0
        """Local ids up to this one are journaled as reserved and may be issued."""

    @property
    def next_local(self) -> int:
        """The replica-local counter of the next id to issue."""
        return self._next

    @property
    def reserved(self) -> bool:
        """The next id may be issued (its block is journaled)."""
        return self._next <= self._reserved_through

    async def reserve(self) -> None:
        """Journals the next block of ids before any of it is handed out."""
        through = self._next + ID_BLOCK - 1
        await self._reserve(through)
        self._reserved_through = through

    def issue(self) -> int:
        """The next group id (inside the ADMIT mutation)."""
        if not self.reserved:
            raise InvariantError(f"group id {self._next} issued before it was reserved")
        gid = (self._replica << ID_BITS) | self._next
        self._next += 1
        return gid

    def seen(self, group_ids: Iterable[int]) -> None:
        """Journal replay found these ids issued: none of them is issued again."""
        mine = [local_id(g) for g in group_ids if g >> ID_BITS == self._replica]
        if mine:
            self._next = max(self._next, max(mine) + 1)

    def seen_reservation(self, through: int) -> None:
        """Journal replay found local ids up to ``through`` reserved: they may have been
        handed out."""
        self._next = max(self._next, through + 1)

    def capture(self) -> int:
        """The next id a restore may issue: past every id that may have been handed out."""
        return max(self._next, self._reserved_through + 1)

    def restore(self, next_local: int) -> None:
        self._next = next_local
