"""Groups in flight: what runs for each group between its admission and its commit or drop.

A group is in flight from the dispatch of its siblings (after admission, or after a restore)
until it commits, is dropped or is evicted. For each such group :class:`Flight` holds its
siblings' tasks, their episode logs, the task of its finishing stage, and the trace context of
its generation span (whether the observer was told it started). Generation fills it; finishing,
drops and eviction take groups out of it; admission counts it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping

from rolloutd.domain.engine import GenerationEngine
from rolloutd.domain.episode_log import EpisodeLog
from rolloutd.domain.ids import request_id
from rolloutd.domain.observer import GenerationStarted, Observer
from rolloutd.domain.partial import PartialSibling


class Flight:
    """The groups in flight and what runs for them; see the module docstring."""

    def __init__(self, engine: GenerationEngine, observer: Observer) -> None:
        self._engine = engine
        self._observer = observer
        self._siblings: dict[int, dict[int, asyncio.Task[None]]] = {}
        """Groups in flight (generating or finishing) -> their siblings still running."""
        self._finishing: dict[int, asyncio.Task[None]] = {}
        """Groups whose finishing stage runs -> the task that runs it."""
        self._episodes: dict[tuple[int, int], EpisodeLog] = {}
        """(group id, index) -> the episode records of a generating sibling (a restore's first)
        and its current turn's tokens; kept while the sibling runs."""
        self._traced: dict[int, Mapping[str, str]] = {}
        """Trace context of each group whose generation the observer was told about."""
        self._departed = 0
        """Groups that left flight (committed, dropped, evicted) since the controller started."""

    # --- reading ---------------------------------------------------------------------------

    @property
    def groups(self) -> int:
        """Groups in flight."""
        return len(self._siblings)

    @property
    def samples(self) -> int:
        """Siblings running."""
        return sum(len(s) for s in self._siblings.values())

    @property
    def running(self) -> bool:
        """At least one sibling runs (the engine generates)."""
        return any(self._siblings.values())

    @property
    def departed(self) -> int:
        return self._departed

    def running_siblings(self, group_id: int) -> list[int]:
        return sorted(self._siblings.get(group_id, {}))

    @property
    def episodes(self) -> Mapping[tuple[int, int], EpisodeLog]:
        """(group id, index) -> the episode log of each sibling running (read them only)."""
        return self._episodes

    def episode(self, key: tuple[int, int]) -> EpisodeLog | None:
        return self._episodes.get(key)

    def trace(self, group_id: int) -> Mapping[str, str]:
        return self._traced.get(group_id, {})

    def episode_partials(self) -> tuple[PartialSibling, ...]:
        """The records and current turn's tokens of every episode in flight (constant time
        each: references and lengths); inside the exclusive hold."""
        return tuple(
            PartialSibling(gid, index, e.deltas, len(e.deltas), e.turn, e.records, len(e.records))
            for (gid, index), e in self._episodes.items()
            if e.records
        )

    # --- changes ---------------------------------------------------------------------------

    def traced(self, group_id: int, started: GenerationStarted) -> Mapping[str, str]:
        """Tells the observer a group's generation starts, once, and keeps its trace context
        (the W3C headers every sibling request carries)."""
        headers = self._traced.get(group_id)
        if headers is None:
            headers = self._traced[group_id] = self._observer.generation_started(started)
        return headers

    def enter(self, group_id: int) -> None:
        """The group is in flight (its siblings are dispatched, or its stage runs)."""
        self._siblings.setdefault(group_id, {})

    def sibling(self, key: tuple[int, int], task: asyncio.Task[None], log: EpisodeLog) -> None:
        gid, index = key
        self._siblings.setdefault(gid, {})[index] = task
        self._episodes[key] = log

    def sibling_done(self, key: tuple[int, int]) -> None:
        """A sibling was staged (inside its mutation)."""
        gid, index = key
        self._siblings[gid].pop(index, None)
        self._episodes.pop(key, None)

    def finishing(self, group_id: int, task: asyncio.Task[None]) -> None:
        self._finishing[group_id] = task

    def finished(self, group_id: int, task: asyncio.Task[None]) -> None:
        """The stage's task ended (unless the group was cancelled meanwhile)."""
        if self._finishing.get(group_id) is task:
            del self._finishing[group_id]

    def leave(self, group_id: int) -> dict[int, asyncio.Task[None]]:
        """Takes a group out of flight; returns its siblings still running."""
        tasks = self._siblings.pop(group_id, None)
        if tasks is None:
            return {}
        self._departed += 1
        return tasks

    def committed(self, group_id: int) -> None:
        """The group committed: its generation span ends with it."""
        self._traced.pop(group_id, None)

    def abandon(self, group_id: int, reason: str) -> None:
        """The group will never commit (dropped or evicted): its generation span ends so."""
        if self._traced.pop(group_id, None) is not None:
            self._observer.generation_abandoned(group_id, reason)

    async def cancel(self, group_id: int) -> None:
        """Aborts a group's running siblings and its finishing stage (inside a mutation); the
        caller removes the group, and with it their staged tokens."""
        current = asyncio.current_task()
        tasks = self.leave(group_id)
        for index in tasks:
            self._episodes.pop((group_id, index), None)
        await self._engine.abort([request_id(group_id, i) for i in tasks])
        finishing = self._finishing.pop(group_id, None)
        for task in [*tasks.values(), *([finishing] if finishing else [])]:
            if task is not current:
                task.cancel()

    async def stop(self) -> None:
        """Aborts every running sibling and finishing stage; staged siblings stay."""
        tasks = [t for sibs in self._siblings.values() for t in sibs.values()]
        await self._engine.abort(
            [request_id(gid, i) for gid, s in self._siblings.items() for i in s]
        )
        tasks += self._finishing.values()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
