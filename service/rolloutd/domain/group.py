"""Groups and samples: the unit a trainer fetches is a group of N sibling samples of one prompt."""

from __future__ import annotations

import enum
from abc import abstractmethod
from array import array
from collections.abc import MutableMapping
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True, order=True)
class Position:
    """Where a dataset prompt sits in the sampler's stream: pass ``epoch``, index ``offset``."""

    epoch: int
    offset: int

    def __str__(self) -> str:
        return f"({self.epoch}, {self.offset})"


@dataclass(frozen=True)
class Prompt:
    """One prompt. ``messages`` (chat) is rendered by the engine's tokenizer; else ``text`` is used."""

    prompt_id: str
    text: str
    metadata: Any = None
    """Any JSON value (None: none given), returned exactly with the group."""
    messages: tuple[dict[str, str], ...] = ()


@dataclass(frozen=True)
class Sample:
    """One finished sibling, shared by reference between the buffer and snapshots: never mutate it.

    Token ids (``array('i')``, int32) and logprobs (``array('f')``, float32, one per generated
    token) are buffers, so snapshot segments are built without touching tokens one by one.
    """

    index: int
    token_ids: array[int]
    logprobs: array[float]
    text: str
    finish_reason: str
    policy_version: int
    prompt_token_ids: array[int]
    seed: int
    started_at: float
    finished_at: float


class KeptSamples(MutableMapping[int, Sample]):
    """A restored group's siblings left in the snapshot's verified buffers: sibling index ->
    :class:`Sample`, each built only when it is read (delivered).

    A restore builds one of these per group instead of one object per row, so restoring 100k
    rows costs what reading their bytes costs. Only finished groups keep their rows this way
    (they are never staged into); writing to one is a bug. ``checkpoint/segments.py`` implements
    it over Arrow record batches.
    """

    @abstractmethod
    def row_ids(self) -> dict[int, int]:
        """Sibling index -> row id of each kept row (what removing the group reports)."""

    def __setitem__(self, index: int, sample: Sample) -> None:
        raise TypeError("the kept rows of a restored group are read-only")

    def __delitem__(self, index: int) -> None:
        raise TypeError("the kept rows of a restored group are read-only")


class GroupState(enum.Enum):
    """Lifecycle of a group; a group is in exactly one state."""

    GENERATING = "generating"
    COMMITTED = "committed"
    LEASED = "leased"
    ACKED = "acked"


@dataclass(frozen=True)
class GroupMeta:
    """Everything about a group but its samples. A group's fields are declared here once: the
    buffer replaces the value on each change (so a snapshot shares it, never copies it), and the
    sidecar's codec is derived from these fields.

    Invariants: state is COMMITTED or later only when every sibling is staged; ``lease_id`` is set
    exactly while LEASED or ACKED; ``ack_step`` only when ACKED.
    """

    group_id: int
    prompt: Prompt
    position: Position | None
    group_size: int
    policy_version: int
    admitted_at: float
    seed: int
    state: GroupState = GroupState.GENERATING
    committed_at: float | None = None
    lease_id: str | None = None
    ack_step: int | None = None

    def sibling_seed(self, index: int) -> int:
        """Each sibling has its own seed, derived so a re-run after a restart is reproducible."""
        return (self.seed * 1_000_003 + index) % (2**31 - 1)

    def evolve(self, **changes: Any) -> GroupMeta:
        """A copy with ``changes``: what every state change of a group makes. Copies the
        instance dict directly (``dataclasses.replace`` goes through ``__init__`` and costs
        five times as much on the mutation path); ``changes`` must name fields."""
        unknown = changes.keys() - self.__dict__.keys()
        if unknown:
            raise TypeError(f"GroupMeta has no field {sorted(unknown)}")
        new = object.__new__(GroupMeta)
        new.__dict__.update(self.__dict__, **changes)
        return new


@dataclass(eq=False)
class Group:
    """A group as it is generated, buffered, leased and acknowledged: its metadata and its N
    siblings. Invariant: ``len(samples) <= meta.group_size``."""

    meta: GroupMeta
    samples: MutableMapping[int, Sample] = field(default_factory=dict)
    """Staged siblings by index: a dict, or after a restore a finished group's
    :class:`KeptSamples`."""

    @property
    def group_id(self) -> int:
        return self.meta.group_id

    @property
    def state(self) -> GroupState:
        return self.meta.state

    @property
    def complete(self) -> bool:
        return len(self.samples) == self.meta.group_size

    @property
    def missing(self) -> list[int]:
        return [i for i in range(self.meta.group_size) if i not in self.samples]

    def ordered_samples(self) -> list[Sample]:
        return [self.samples[i] for i in sorted(self.samples)]

    @property
    def generated_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.samples.values())
