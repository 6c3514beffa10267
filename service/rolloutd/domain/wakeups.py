"""The wake-ups that admission and waiting fetches sleep on.

Every change that may let admission start a group, or make a group ready, notifies: admission
wakes, and as many waiting fetches as there are ready groups (all of them when the controller
drains or dies, so that they answer ``Unavailable``), not every waiting trainer.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from rolloutd.domain.buffer import RolloutBuffer
from rolloutd.domain.liveness import Liveness


class Wakeups:
    """See the module docstring."""

    def __init__(
        self, buffer: RolloutBuffer, liveness: Liveness, on_notify: Callable[[], None]
    ) -> None:
        self._buffer = buffer
        self._liveness = liveness
        self._on_notify = on_notify
        self._changed = asyncio.Condition()
        self._fetchable = asyncio.Condition()

    @property
    def changed(self) -> asyncio.Condition:
        """Admission waits on it for room."""
        return self._changed

    @property
    def fetchable(self) -> asyncio.Condition:
        """Fetches wait on it for ready groups."""
        return self._fetchable

    async def notify(self) -> None:
        """Wakes admission, and as many waiting fetches as there are ready groups."""
        self._on_notify()
        async with self.changed:
            self.changed.notify_all()
        async with self.fetchable:
            if self._liveness.open:
                self.fetchable.notify(self._buffer.ready_count)
            else:
                self.fetchable.notify_all()

    async def wake_admission(self) -> None:
        """Wakes admission alone (a fetch began to wait: the staleness gate may admit more)."""
        async with self.changed:
            self.changed.notify_all()
