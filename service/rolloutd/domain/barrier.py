"""The mutation barrier: mutations share it, a checkpoint holds it exclusively with writer priority.

A readers-writer lock on one asyncio loop. Mutations (readers) run concurrently with each other;
``exclusive()`` waits for active mutations to drain and, from the moment it asks, makes new
mutations wait (writer priority), so a checkpoint is never starved by a steady stream of mutations.
A mutation that had to wait is reported with its kind and wait time.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass

from rolloutd.domain.mutation import MutationKind

BlockedCallback = Callable[[MutationKind, float], None]


@dataclass
class ExclusiveTiming:
    """Filled in by ``exclusive()``: how long the drain took, when the hold started."""

    wait_s: float = 0.0
    acquired_at: float = 0.0


class MutationBarrier:
    def __init__(self, on_blocked: BlockedCallback | None = None) -> None:
        self._active = 0
        self._writers_waiting = 0
        self._writer_active = False
        self._cond = asyncio.Condition()
        self._on_blocked = on_blocked

    @property
    def exclusive_held(self) -> bool:
        return self._writer_active

    def mutation(self, kind: MutationKind) -> _Mutation:
        """``async with barrier.mutation(kind):`` around one mutation of the buffer or ledger."""
        if not isinstance(kind, MutationKind):
            raise TypeError(f"mutation kind must be a MutationKind, got {kind!r}")
        return _Mutation(self, kind)

    async def _enter(self, kind: MutationKind) -> None:
        if self._writer_active or self._writers_waiting:
            async with self._cond:
                started = time.perf_counter()
                await self._cond.wait_for(
                    lambda: not self._writer_active and not self._writers_waiting
                )
                if self._on_blocked is not None:
                    self._on_blocked(kind, time.perf_counter() - started)
                self._active += 1
        else:  # the common case takes no lock: nothing awaits between the check and the count
            self._active += 1

    async def _exit(self) -> None:
        self._active -= 1
        if self._active == 0 and self._writers_waiting:
            async with self._cond:
                self._cond.notify_all()

    @asynccontextmanager
    async def exclusive(self) -> AsyncIterator[ExclusiveTiming]:
        timing = ExclusiveTiming()
        started = time.perf_counter()
        async with self._cond:
            self._writers_waiting += 1
            try:
                await self._cond.wait_for(lambda: self._active == 0 and not self._writer_active)
            finally:
                self._writers_waiting -= 1
            self._writer_active = True
        timing.wait_s = time.perf_counter() - started
        timing.acquired_at = time.perf_counter()
        try:
            yield timing
        finally:
            async with self._cond:
                self._writer_active = False
                self._cond.notify_all()


class _Mutation:
    """One mutation's share of the barrier. A plain context manager object rather than a
    generator-based one: every group takes the barrier about fourteen times on its way from
    admission to ack, and the generator machinery cost more than the rest of the rules."""

    __slots__ = ("_barrier", "_kind")

    def __init__(self, barrier: MutationBarrier, kind: MutationKind) -> None:
        self._barrier = barrier
        self._kind = kind

    async def __aenter__(self) -> None:
        await self._barrier._enter(self._kind)

    async def __aexit__(self, *exc_info: object) -> None:
        await self._barrier._exit()
