"""Everything that persists, as one frozen value, one part for each room that owns state.

:class:`ControllerState` is all a snapshot keeps: the buffer's groups and rows by reference, the
delivery ledger (leases, acks, trainer steps), the sampler's cursors and queues, the counters and
partial tokens, the id high-water mark, the policy (version, weights, the staleness gate's pace)
and the adaptive in-flight limit. Each room captures its part and restores from it;
``Controller.capture()`` and ``Controller.recover()`` are the only ways out of and into the
controller, and ``checkpoint/sidecar.py`` encodes and decodes the value.

A captured state holds the changes since the previous capture (see :class:`BufferState`); a state
to restore from is whole.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from rolloutd.domain.accounting import Counters
from rolloutd.domain.buffer import BufferState
from rolloutd.domain.concurrency import ConcurrencyState
from rolloutd.domain.ledger import LedgerState
from rolloutd.domain.partial import PartialSibling
from rolloutd.domain.policy import PolicyState
from rolloutd.domain.sampler import SamplerState


@dataclass(frozen=True)
class ControllerState:
    """A consistent cut of everything a snapshot holds, one part a room (see the module
    docstring)."""

    buffer: BufferState
    ledger: LedgerState
    sampler: SamplerState
    counters: Counters
    next_group_id: int
    """The next id a restore may issue: past every id that may have been handed out."""
    policy: PolicyState
    partials: tuple[PartialSibling, ...] = ()
    """Tokens of generating siblings so far (``ControllerConfig.capture_partials``). Written in
    a snapshot file of their own (``checkpoint/partials.py``), not in rows or the sidecar."""
    concurrency: ConcurrencyState = field(default_factory=ConcurrencyState)
    """The adaptive limit on groups in flight."""
