"""Everything that persists, as one frozen value, and the port that makes acks durable.

:class:`ControllerState` is all a snapshot keeps: group metadata, rows by reference, leases, the
ack ledger, the sampler's cursor and queues, counters and id high-water marks.
``Controller.capture()`` and ``Controller.restore(state)`` are the only ways out of and into the
controller; ``checkpoint/sidecar.py`` encodes and decodes it, and nothing else reads its parts.

A captured state holds the changes since the previous capture (see :class:`BufferState`); a state
to restore from is whole. Acks journaled after a snapshot come back as :class:`JournaledAck` and
go through the same ack path as live ones.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Protocol

from rolloutd.domain.buffer import AckRecord, BufferState, remember_finalized
from rolloutd.domain.group import Group
from rolloutd.domain.partial import PartialSibling
from rolloutd.domain.sampler import Admission, SamplerState


@dataclass
class Counters:
    """Cumulative over the life of the store (they survive restarts)."""

    admitted_groups: int = 0
    committed_groups: int = 0
    acked_groups: int = 0
    finalized_groups: int = 0
    evicted_groups: int = 0
    requeued_groups: int = 0
    dropped_groups: int = 0
    committed_tokens: int = 0
    expired_leases: int = 0


@dataclass(frozen=True)
class LostAck:
    """An ack journaled for groups no snapshot held: their prompts are never admitted again,
    unless a ``Rewind`` to before ``trainer_step`` re-admits them."""

    trainer_step: int
    admissions: tuple[Admission, ...]


@dataclass(frozen=True)
class ControllerState:
    """A consistent cut of everything a snapshot holds (see the module docstring)."""

    buffer: BufferState
    sampler: SamplerState
    counters: Counters
    next_group_id: int
    policy_version: int
    weights_path: str | None
    max_acked_step: int
    finalized_through: int
    lost_acks: tuple[LostAck, ...] = ()
    partials: tuple[PartialSibling, ...] = ()
    """Tokens of generating siblings so far (``ControllerConfig.capture_partials``). Written in
    a snapshot file of their own (``checkpoint/partials.py``), not in rows or the sidecar."""

    def with_ledger(self, previous: Mapping[str, int]) -> ControllerState:
        """This capture with the whole ledger of finalized leases: ``previous`` (the ledger as
        of the last snapshot) plus what was finalized since. Outside the hold."""
        ledger = remember_finalized(OrderedDict(previous), self.buffer.finalized_leases)
        return replace(self, buffer=replace(self.buffer, finalized_leases=ledger))


@dataclass(frozen=True)
class JournaledAck:
    """An ack read back from the journal: its record and the admission of each of its groups
    (so that a group no snapshot held can be kept from being admitted again)."""

    record: AckRecord
    admissions: Mapping[int, Admission] = field(default_factory=dict)


class AckJournal(Protocol):
    """Makes an ack durable before the RPC returns (checkpoint/journal.py implements it)."""

    async def append(self, record: AckRecord, groups: Sequence[Group]) -> None: ...


class NullJournal:
    """Keeps nothing: for a controller without a store."""

    async def append(self, record: AckRecord, groups: Sequence[Group]) -> None:
        return None
