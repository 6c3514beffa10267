"""The supervisor: owns the service's background tasks and notices when one ends.

A background task runs for the life of the service; one that ends before :meth:`Supervisor.stop`
(by returning or raising) is a failure, never silent: it is logged with its error and
``on_failure`` turns readiness off. When the error is unrecoverable (an invariant violation, a
dead engine) :meth:`wait_fatal` returns it, and the service stops with a non-zero exit so that
its orchestrator restarts it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

log = logging.getLogger(__name__)


class TaskEnded(RuntimeError):
    """A background task returned although it should run until stopped."""


class Supervisor:
    def __init__(
        self,
        on_failure: Callable[[str, BaseException], Awaitable[None]],
        unrecoverable: tuple[type[BaseException], ...],
    ) -> None:
        self._on_failure = on_failure
        self._unrecoverable = unrecoverable
        self._tasks: dict[asyncio.Task[Any], str] = {}
        self._stopping = False
        self._fatal: BaseException | None = None
        self._fatal_set = asyncio.Event()

    def spawn(self, name: str, coro: Coroutine[Any, Any, Any]) -> asyncio.Task[Any]:
        task = asyncio.create_task(coro, name=f"rolloutd-{name}")
        self._tasks[task] = name
        task.add_done_callback(self._ended)
        return task

    async def wait_fatal(self) -> BaseException:
        """Returns the first unrecoverable error."""
        await self._fatal_set.wait()
        assert self._fatal is not None
        return self._fatal

    async def stop(self) -> None:
        """Cancels every task and waits for them; ends after this are expected. Idempotent."""
        self._stopping = True
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def _ended(self, task: asyncio.Task[Any]) -> None:
        name = self._tasks.pop(task)
        if self._stopping or task.cancelled():
            return
        error = task.exception() or TaskEnded(f"background task {name} returned")
        asyncio.get_running_loop().create_task(self._failed(name, error))

    async def _failed(self, name: str, error: BaseException) -> None:
        fatal = isinstance(error, self._unrecoverable)
        log.critical(
            "background task %s ended: %s: %s%s",
            name,
            type(error).__name__,
            error,
            "; stopping the service" if fatal else "; not ready",
            exc_info=error,
        )
        await self._on_failure(name, error)
        if fatal and self._fatal is None:
            self._fatal = error
            self._fatal_set.set()
