"""Group ids, and the engine request ids of their siblings.

A group id is unique across a fleet: its low :data:`ID_BITS` bits count within a replica, the bits
above are the replica's index. The journal reserves ids :data:`ID_BLOCK` at a time, before any of
a block is handed out. A sibling's request id is built from its group id and index, so it is
stable across restarts and unique per sibling.
"""

from __future__ import annotations

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
