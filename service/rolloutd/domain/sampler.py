"""The sampler: which prompt is admitted next.

Dataset prompts are visited in a seeded permutation per epoch, addressed by a cursor
``Position(epoch, offset)``; the order is a pure function of (seed, epoch), so a restored cursor
continues exactly where the snapshot left off. Prompts submitted by trainers and prompts to
re-admit (their groups were lost or rewound) go first.
"""

from __future__ import annotations

import json
import random
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from rolloutd.domain.errors import FailedPrecondition, ResourceExhausted
from rolloutd.domain.group import Position, Prompt


def fleet_share(prompts: Sequence[Prompt], replica: int, replicas: int) -> Sequence[Prompt]:
    """The dataset prompts replica ``replica`` of ``replicas`` owns: those whose row index is
    ``replica`` modulo ``replicas``. Every prompt has exactly one owner, the same in every epoch,
    so the fleet delivers each prompt once an epoch; each replica permutes its own share."""
    if not 0 <= replica < replicas:
        raise ValueError(f"replica {replica} is not within a fleet of {replicas}")
    return prompts[replica::replicas]


_JSON = json.JSONEncoder(ensure_ascii=False).encode


def prompt_bytes(prompt: Prompt) -> int:
    """What a prompt weighs against the submission budgets: its text, its messages' contents and
    its metadata as JSON, in UTF-8 bytes."""
    size = len(prompt.text.encode()) + sum(len(m["content"].encode()) for m in prompt.messages)
    return size if prompt.metadata is None else size + len(_JSON(prompt.metadata).encode())


@dataclass(frozen=True)
class Admission:
    """The next prompt to admit; ``position`` is None for submitted prompts."""

    prompt: Prompt
    position: Position | None


class Sampler:
    def __init__(
        self,
        prompts: Sequence[Prompt],
        *,
        seed: int,
        shuffle: bool = True,
        epochs: int | None = None,
        max_pending: int = 100_000,
        max_pending_bytes: int = 256 << 20,
    ) -> None:
        self._prompts = prompts
        self._seed = seed
        self._shuffle = shuffle
        self._epochs = epochs
        self._max_pending = max_pending
        self._max_pending_bytes = max_pending_bytes
        self._pending_bytes = 0
        """:func:`prompt_bytes` of the submitted prompts not admitted yet."""
        self._cursor = Position(0, 0)
        self._order_epoch = -1
        self._order: list[int] = []
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
    def cursor(self) -> Position:
        """The next dataset position to admit."""
        return self._cursor

    @property
    def pending(self) -> int:
        return len(self._submitted) - self._submitted_head + len(self._readmit)

    @property
    def exhausted(self) -> bool:
        """Every configured epoch has been admitted (never true without an epoch limit)."""
        return self._epochs is not None and self._cursor.epoch >= self._epochs

    def order(self, epoch: int) -> list[int]:
        if epoch != self._order_epoch:
            order = list(range(len(self._prompts)))
            if self._shuffle:
                random.Random(f"{self._seed}:{epoch}").shuffle(order)
            self._order, self._order_epoch = order, epoch
        return self._order

    def prompt_at(self, position: Position) -> Prompt:
        return self._prompts[self.order(position.epoch)[position.offset]]

    def has_next(self) -> bool:
        return self.pending > 0 or (not self.exhausted and bool(self._prompts))

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
        while not self.exhausted and self._prompts:
            position = self._cursor
            offset = position.offset + 1
            self._cursor = (
                Position(position.epoch + 1, 0)
                if offset == len(self._prompts)
                else Position(position.epoch, offset)
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
                    for f in ("text", "messages", "metadata")
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
        elif admission.position >= self._cursor:
            self._skip.add(admission.position)

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
            prompt = self.prompt_at(position) if position.offset < len(self._prompts) else None
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
            self._cursor,
            self._submitted,
            self._submitted_head,
            len(self._submitted),
            tuple(self._readmit),
            tuple(self._skip),
            tuple(self._skip_ids),
        )

    def restore(self, state: SamplerState) -> None:
        self._cursor = state.cursor
        self._submitted = list(state.submitted_prompts)
        self._submitted_head = state.submitted_head
        self._submitted_ids = {p.prompt_id: p for p in self._submitted}
        self._pending_bytes = sum(map(prompt_bytes, self._submitted[self._submitted_head :]))
        self._readmit = deque(state.readmit)
        self._skip = set(state.skip)
        self._skip_ids = set(state.skip_ids)


@dataclass(frozen=True)
class SamplerState:
    """The sampler's part of a snapshot: cursor, submitted prompts, queues."""

    cursor: Position
    submitted: list[Prompt]
    """The sampler's append-only list, shared: only ``submitted[:submitted_len]`` belongs here."""
    submitted_head: int
    """Submitted prompts before this index have been admitted."""
    submitted_len: int
    readmit: tuple[Admission, ...]
    skip: tuple[Position, ...]
    skip_ids: tuple[str, ...]

    @property
    def submitted_prompts(self) -> list[Prompt]:
        """The prompts submitted up to the capture (a copy: call outside the hold)."""
        return self.submitted[: self.submitted_len]
