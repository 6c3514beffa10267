"""The sampler: which prompt is admitted next.

Dataset prompts are visited in a seeded permutation per epoch, addressed by a cursor
``Position(epoch, offset)``; the order is a pure function of (seed, epoch), so a restored cursor
continues exactly where the snapshot left off. Prompts submitted by trainers and prompts to
re-admit (their groups were lost or rewound) go first.
"""

from __future__ import annotations

import random
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from rolloutd.domain.errors import ResourceExhausted
from rolloutd.domain.group import Position, Prompt


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
    ) -> None:
        self._prompts = prompts
        self._seed = seed
        self._shuffle = shuffle
        self._epochs = epochs
        self._max_pending = max_pending
        self._cursor = Position(0, 0)
        self._order_epoch = -1
        self._order: list[int] = []
        self._submitted: deque[Prompt] = deque()
        self._submitted_ids: set[str] = set()
        self._readmit: deque[Admission] = deque()

    @property
    def cursor(self) -> Position:
        """The next dataset position to admit."""
        return self._cursor

    @property
    def pending(self) -> int:
        return len(self._submitted) + len(self._readmit)

    @property
    def exhausted(self) -> bool:
        """Every configured epoch has been admitted (never true without an epoch limit)."""
        return self._epochs is not None and self._cursor.epoch >= self._epochs

    @property
    def dataset_size(self) -> int:
        return len(self._prompts)

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
        return bool(self._readmit or self._submitted) or (
            not self.exhausted and bool(self._prompts)
        )

    def next(self) -> Admission | None:
        if self._readmit:
            return self._readmit.popleft()
        if self._submitted:
            return Admission(self._submitted.popleft(), None)
        if self.exhausted or not self._prompts:
            return None
        position = self._cursor
        prompt = self.prompt_at(position)
        offset = position.offset + 1
        self._cursor = (
            Position(position.epoch + 1, 0)
            if offset == len(self._prompts)
            else Position(position.epoch, offset)
        )
        return Admission(prompt, position)

    def submit(self, prompts: Iterable[Prompt]) -> tuple[int, int]:
        """Queues new prompts; returns (accepted, duplicates). All or nothing on overflow."""
        given = list(prompts)
        fresh: list[Prompt] = []
        seen = set(self._submitted_ids)
        for p in given:
            if p.prompt_id not in seen:
                seen.add(p.prompt_id)
                fresh.append(p)
        duplicates = len(given) - len(fresh)
        if self.pending + len(fresh) > self._max_pending:
            raise ResourceExhausted(
                f"{self.pending} prompts are waiting for admission; accepting {len(fresh)} more "
                f"would exceed limits.max_pending_prompts={self._max_pending}"
            )
        self._submitted.extend(fresh)
        self._submitted_ids.update(p.prompt_id for p in fresh)
        return len(fresh), duplicates

    def readmit(self, admission: Admission) -> None:
        """Admit this prompt again first (its group was lost, evicted or rewound past durability)."""
        self._readmit.append(admission)

    # --- state for snapshots ---------------------------------------------------------------

    def state(self) -> dict[str, Any]:
        return {
            "cursor": [self._cursor.epoch, self._cursor.offset],
            "submitted": [prompt_state(p) for p in self._submitted],
            "submitted_ids": sorted(self._submitted_ids),
            "readmit": [
                {
                    "prompt": prompt_state(a.prompt),
                    "position": None
                    if a.position is None
                    else [a.position.epoch, a.position.offset],
                }
                for a in self._readmit
            ],
        }

    def load_state(self, state: dict[str, Any]) -> None:
        epoch, offset = state["cursor"]
        self._cursor = Position(int(epoch), int(offset))
        self._submitted = deque(prompt_from_state(p) for p in state["submitted"])
        self._submitted_ids = set(state["submitted_ids"])
        self._readmit = deque(
            Admission(
                prompt_from_state(a["prompt"]),
                None if a["position"] is None else Position(*a["position"]),
            )
            for a in state["readmit"]
        )


def prompt_state(p: Prompt) -> dict[str, Any]:
    return {"id": p.prompt_id, "text": p.text, "metadata": p.metadata, "messages": list(p.messages)}


def prompt_from_state(d: dict[str, Any]) -> Prompt:
    return Prompt(
        prompt_id=str(d["id"]),
        text=str(d["text"]),
        metadata=dict(d["metadata"]),
        messages=tuple(d["messages"]),
    )
