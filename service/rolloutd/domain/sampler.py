"""The sampler: which prompt is admitted next.

Dataset prompts come from one or more weighted :class:`Source` s. Each source visits its prompts
in a seeded permutation per epoch, addressed by its own cursor ``Position(epoch, offset,
source)``; the order is a pure function of (seed, source, epoch), so a restored cursor continues
exactly where the snapshot left off. With several sources, the n-th dataset admission draws its
source by weight from a generator seeded with (seed, n): deterministic, and after a restore it
continues from the draw count the snapshot holds (under the weights configured then). Prompts
submitted by trainers and prompts to re-admit (their groups were lost or rewound) go first.
"""

from __future__ import annotations

import json
import random
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from rolloutd.domain.errors import FailedPrecondition, ResourceExhausted
from rolloutd.domain.group import Position, Prompt
from rolloutd.domain.spec import EMPTY, GenerationSpec


def fleet_share(prompts: Sequence[Prompt], replica: int, replicas: int) -> Sequence[Prompt]:
    """The dataset prompts replica ``replica`` of ``replicas`` owns: those whose row index is
    ``replica`` modulo ``replicas``. Every prompt has exactly one owner, the same in every epoch,
    so the fleet delivers each prompt once an epoch; each replica permutes its own share."""
    if not 0 <= replica < replicas:
        raise ValueError(f"replica {replica} is not within a fleet of {replicas}")
    return prompts[replica::replicas]


_JSON = json.JSONEncoder(ensure_ascii=False).encode


def prompt_bytes(prompt: Prompt) -> int:
    """What a prompt weighs against the submission budgets: its text, its messages' contents, and
    its metadata and tools as JSON, in UTF-8 bytes."""
    size = len(prompt.text.encode()) + sum(len(m["content"].encode()) for m in prompt.messages)
    if prompt.tools:
        size += len(_JSON([dict(t) for t in prompt.tools]).encode())
    return size if prompt.metadata is None else size + len(_JSON(prompt.metadata).encode())


@dataclass(frozen=True)
class Source:
    """A stream of dataset prompts, drawn from by ``weight`` (relative to the other sources'),
    whose groups are generated with ``generation`` unless a prompt sets its own."""

    name: str
    prompts: Sequence[Prompt]
    weight: float = 1.0
    generation: GenerationSpec = EMPTY


DATASET = "dataset"
"""The name of the one source of a sampler built from a plain list of prompts."""
SUBMITTED = "submitted"
"""What the groups of submitted prompts count under where sources are named."""


@dataclass(frozen=True)
class Admission:
    """The next prompt to admit; ``position`` is None for submitted prompts."""

    prompt: Prompt
    position: Position | None


@dataclass(frozen=True)
class SourceStatus:
    name: str
    weight: float
    cursor: Position
    prompts: int
    exhausted: bool


class Sampler:
    def __init__(
        self,
        sources: Sequence[Source] | Sequence[Prompt],
        *,
        seed: int,
        shuffle: bool = True,
        epochs: int | None = None,
        max_pending: int = 100_000,
        max_pending_bytes: int = 256 << 20,
    ) -> None:
        """``sources``: the dataset's sources, or the prompts of its only one."""
        given = list(sources)
        if given and all(isinstance(s, Source) for s in given):
            self._sources: tuple[Source, ...] = tuple(given)  # type: ignore[arg-type]
        elif any(isinstance(s, Source) for s in given):
            raise TypeError("a sampler takes sources or prompts, not both")
        else:
            self._sources = (Source(DATASET, sources),)  # type: ignore[arg-type]
        self._seed = seed
        self._shuffle = shuffle
        self._epochs = epochs
        self._max_pending = max_pending
        self._max_pending_bytes = max_pending_bytes
        self._pending_bytes = 0
        """:func:`prompt_bytes` of the submitted prompts not admitted yet."""
        self._cursors = [Position(0, 0, i) for i in range(len(self.sources))]
        self._draws = 0
        """Weighted draws of a source made so far (with more than one source to draw from)."""
        self._orders: dict[int, tuple[int, list[int]]] = {}
        """Source -> (epoch, that epoch's permutation of its prompts)."""
        self._submitted: list[Prompt] = []
        """Every prompt ever submitted, append-only: a captured prefix never changes."""
        self._submitted_head = 0
        """Prompts before this index have been admitted."""
        self._submitted_ids: dict[str, Prompt] = {}
        """Every submitted prompt by id: a resubmission must be the same prompt."""
        self._readmit: deque[Admission] = deque()
        self._skip: set[Position] = set()
        """Positions never to admit again: their groups were acked but lost in a crash."""
        self._skip_ids: set[str] = set()
        """Submitted prompt ids never to admit again, for the same reason."""

    @property
    def sources(self) -> tuple[Source, ...]:
        """What the sampler draws from, in the configuration's order."""
        return self._sources

    @property
    def cursor(self) -> Position:
        """The next position of the first source to admit."""
        return self._cursors[0]

    @property
    def cursors(self) -> tuple[Position, ...]:
        """The next position to admit of each source."""
        return tuple(self._cursors)

    @property
    def pending(self) -> int:
        return len(self._submitted) - self._submitted_head + len(self._readmit)

    def _spent(self, source: int) -> bool:
        """Whether the source has nothing more to admit: no prompts, no weight, or every
        configured epoch admitted."""
        cursor = self._cursors[source]
        s = self.sources[source]
        return (
            not s.prompts
            or s.weight <= 0
            or (self._epochs is not None and cursor.epoch >= self._epochs)
        )

    @property
    def exhausted(self) -> bool:
        """Every source has admitted every configured epoch (never true without an epoch
        limit)."""
        return all(map(self._spent, range(len(self.sources))))

    def order(self, epoch: int, source: int = 0) -> list[int]:
        cached = self._orders.get(source)
        if cached is None or cached[0] != epoch:
            order = list(range(len(self.sources[source].prompts)))
            if self._shuffle:
                key = f"{self._seed}:{epoch}" if source == 0 else f"{self._seed}:{source}:{epoch}"
                random.Random(key).shuffle(order)
            cached = self._orders[source] = (epoch, order)
        return cached[1]

    def prompt_at(self, position: Position) -> Prompt:
        prompts = self.sources[position.source].prompts
        return prompts[self.order(position.epoch, position.source)[position.offset]]

    def source_name(self, position: Position | None) -> str:
        """The name of the source of a prompt at ``position`` (None: a submitted prompt)."""
        return SUBMITTED if position is None else self.sources[position.source].name

    def has_next(self) -> bool:
        return self.pending > 0 or not self.exhausted

    def status(self) -> list[SourceStatus]:
        return [
            SourceStatus(s.name, s.weight, self._cursors[i], len(s.prompts), self._spent(i))
            for i, s in enumerate(self.sources)
        ]

    def _draw(self) -> int | None:
        """The source of the next dataset admission; None when every one is spent."""
        live = [i for i in range(len(self.sources)) if not self._spent(i)]
        if len(live) <= 1:
            return live[0] if live else None
        weights = [self.sources[i].weight for i in live]
        at = random.Random(f"{self._seed}:draw:{self._draws}").random() * sum(weights)
        self._draws += 1
        for i, w in zip(live, weights, strict=True):
            at -= w
            if at < 0:
                return i
        return live[-1]

    def next(self) -> Admission | None:
        if self._readmit:
            return self._readmit.popleft()
        while self._submitted_head < len(self._submitted):
            self._submitted_head += 1
            prompt = self._submitted[self._submitted_head - 1]
            self._pending_bytes -= prompt_bytes(prompt)
            if prompt.prompt_id in self._skip_ids:
                self._skip_ids.discard(prompt.prompt_id)
                continue
            return Admission(prompt, None)
        while (source := self._draw()) is not None:
            position = self._cursors[source]
            offset = position.offset + 1
            self._cursors[source] = (
                Position(position.epoch + 1, 0, source)
                if offset == len(self.sources[source].prompts)
                else Position(position.epoch, offset, source)
            )
            if position in self._skip:
                self._skip.discard(position)
                continue
            return Admission(self.prompt_at(position), position)
        return None

    def fresh(self, prompts: Iterable[Prompt]) -> list[Prompt]:
        """The prompts :meth:`submit` would accept, without queueing them; raises what it would."""
        given = list(prompts)
        fresh = self._check(given)
        if self.pending + len(fresh) > self._max_pending:
            raise ResourceExhausted(
                f"{self.pending} prompts are waiting for admission; accepting {len(fresh)} more "
                f"would exceed limits.max_pending_prompts={self._max_pending}"
            )
        size = sum(map(prompt_bytes, fresh))
        if self._pending_bytes + size > self._max_pending_bytes:
            raise ResourceExhausted(
                f"{self._pending_bytes} bytes of prompts are waiting for admission; accepting "
                f"{size} more would exceed limits.max_pending_bytes={self._max_pending_bytes}"
            )
        return fresh

    def submit(self, prompts: Iterable[Prompt], *, bounded: bool = True) -> tuple[int, int]:
        """Queues new prompts; returns (accepted, duplicates). All or nothing on overflow.
        ``bounded=False`` when replaying prompts that were accepted before a restart."""
        given = list(prompts)
        fresh = self.fresh(given) if bounded else self._check(given)
        self._submitted.extend(fresh)  # append-only: captured prefixes stay valid
        self._pending_bytes += sum(map(prompt_bytes, fresh))
        self._submitted_ids.update((p.prompt_id, p) for p in fresh)
        return len(fresh), len(given) - len(fresh)

    def _check(self, given: list[Prompt]) -> list[Prompt]:
        """The prompts not submitted before; a prompt id submitted with another prompt fails."""
        fresh: list[Prompt] = []
        batch: dict[str, Prompt] = {}
        for p in given:
            earlier = self._submitted_ids.get(p.prompt_id) or batch.get(p.prompt_id)
            if earlier is None:
                batch[p.prompt_id] = p
                fresh.append(p)
            elif earlier != p:
                differing = [
                    f
                    for f in ("text", "messages", "metadata", "generation", "tools")
                    if getattr(earlier, f) != getattr(p, f)
                ]
                raise FailedPrecondition(
                    f"prompt {p.prompt_id!r} was submitted before with another "
                    f"{' and '.join(differing)}; a prompt id names one prompt"
                )
        return fresh

    def skip(self, admission: Admission) -> None:
        """Never admit this again: its group was acknowledged, though no snapshot held it."""
        if admission.position is None:
            self._skip_ids.add(admission.prompt.prompt_id)
        elif admission.position >= self._cursors[admission.position.source]:
            self._skip.add(admission.position)

    def taken(self, admission: Admission) -> None:
        """This was admitted after the snapshot the sampler was restored from (a journal
        replay builds its group again): never admit it again, from the readmit queue either."""
        if admission in self._readmit:
            self._readmit.remove(admission)
        else:
            self.skip(admission)

    def unskip(self, admission: Admission) -> None:
        """Undoes :meth:`skip` (the lease that held the group expired unacknowledged): admit the
        prompt again, at its place if the cursor has not reached it, else first."""
        if admission.position is None and admission.prompt.prompt_id in self._skip_ids:
            self._skip_ids.discard(admission.prompt.prompt_id)
        elif admission.position is not None and admission.position in self._skip:
            self._skip.discard(admission.position)
        else:
            self.readmit(admission)

    def resolve(self, prompt_id: str, position: Position | None) -> Admission:
        """The admission a journal record names by reference: the dataset prompt at
        ``position``, or the submitted prompt ``prompt_id`` (every one ever accepted is kept)."""
        if position is None:
            prompt = self._submitted_ids.get(prompt_id)
        else:
            known = position.source < len(self.sources) and position.offset < len(
                self.sources[position.source].prompts
            )
            prompt = self.prompt_at(position) if known else None
        if prompt is None or prompt.prompt_id != prompt_id:
            raise KeyError(f"prompt {prompt_id!r} at {position} is not in the dataset or submitted")
        return Admission(prompt, position)

    def readmit(self, admission: Admission) -> None:
        """Admit this prompt again first (its group was lost, evicted or rewound past durability)."""
        self._readmit.append(admission)

    # --- state for snapshots ---------------------------------------------------------------

    def capture(self) -> SamplerState:
        """Shares the append-only submitted list; copies the readmit and skip queues (prompts
        lost, evicted or rewound: their length, not the dataset's). Call under the exclusive
        hold."""
        return SamplerState(
            self._cursors[0],
            self._submitted,
            self._submitted_head,
            len(self._submitted),
            tuple(self._readmit),
            tuple(self._skip),
            tuple(self._skip_ids),
            tuple(self._cursors),
            self._draws,
        )

    def restore(self, state: SamplerState) -> None:
        cursors = state.cursors or (state.cursor,)
        self._cursors = [
            cursors[i] if i < len(cursors) else Position(0, 0, i) for i in range(len(self.sources))
        ]
        self._draws = state.draws
        self._submitted = list(state.submitted_prompts)
        self._submitted_head = state.submitted_head
        self._submitted_ids = {p.prompt_id: p for p in self._submitted}
        self._pending_bytes = sum(map(prompt_bytes, self._submitted[self._submitted_head :]))
        self._readmit = deque(state.readmit)
        self._skip = set(state.skip)
        self._skip_ids = set(state.skip_ids)


@dataclass(frozen=True)
class SamplerState:
    """The sampler's part of a snapshot: cursors, submitted prompts, queues."""

    cursor: Position
    """The first source's cursor (all a snapshot before format 5 holds)."""
    submitted: list[Prompt]
    """The sampler's append-only list, shared: only ``submitted[:submitted_len]`` belongs here."""
    submitted_head: int
    """Submitted prompts before this index have been admitted."""
    submitted_len: int
    readmit: tuple[Admission, ...]
    skip: tuple[Position, ...]
    skip_ids: tuple[str, ...]
    cursors: tuple[Position, ...] = ()
    """Each source's cursor (empty: only ``cursor``, a snapshot before format 5)."""
    draws: int = 0
    """Weighted draws of a source made so far."""

    @property
    def submitted_prompts(self) -> list[Prompt]:
        """The prompts submitted up to the capture (a copy: call outside the hold)."""
        return self.submitted[: self.submitted_len]
