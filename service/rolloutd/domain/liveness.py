"""Whether the controller admits work, drains, or has died: the one way it dies.

Any task of the controller whose unexpected error escapes ends it (:meth:`Liveness.watched`);
the service waits on :meth:`Liveness.wait_dead` and turns the error into not-ready and exit
code 1. Draining (shutting down) stops admission and answers waiting fetches ``Unavailable`` so
that a trainer retries another replica.
"""

from __future__ import annotations

import asyncio
import logging

from rolloutd.domain.errors import Unavailable

log = logging.getLogger(__name__)


class Liveness:
    """See the module docstring."""

    def __init__(self) -> None:
        self._admitting = False
        self._draining = False
        self._fatal: BaseException | None = None
        self._dead = asyncio.Event()

    @property
    def admitting(self) -> bool:
        return self._admitting

    @property
    def draining(self) -> bool:
        return self._draining

    @property
    def fatal(self) -> BaseException | None:
        return self._fatal

    @property
    def open(self) -> bool:
        """Neither draining nor dead: fetches wait for groups."""
        return not self._draining and self._fatal is None

    def admit(self, admitting: bool) -> None:
        """Admission on (the service is ready) or off; never on once draining or dead."""
        self._admitting = admitting and self.open

    def drain(self) -> None:
        self._admitting, self._draining = False, True

    def watched(self, task: asyncio.Task[None]) -> asyncio.Task[None]:
        """A task of the controller whose unexpected error ends the controller (never silently:
        the service waits on :meth:`wait_dead`)."""

        def ended(t: asyncio.Task[None]) -> None:
            if not t.cancelled() and t.exception() is not None:
                self.die(t.exception())  # type: ignore[arg-type]

        task.add_done_callback(ended)
        return task

    def die(self, exc: BaseException) -> None:
        if self._fatal is None:
            log.critical("controller cannot go on: %s", exc, exc_info=exc)
            self._fatal = exc
            self._admitting = False
            self._dead.set()

    async def wait_dead(self) -> BaseException:
        await self._dead.wait()
        assert self._fatal is not None
        return self._fatal

    def check_serving(self) -> None:
        if self._fatal is not None:
            raise Unavailable(f"the service failed: {self._fatal}")
        if self._draining:
            raise Unavailable("the service is draining (shutting down); fetch from another replica")
