"""Whether the service accepts work; health checks and readiness follow this state."""

from __future__ import annotations

import enum
import logging
from collections.abc import Awaitable, Callable

log = logging.getLogger(__name__)


class ServingState(enum.Enum):
    STARTING = "starting"
    RESTORING = "restoring"
    SERVING = "serving"
    NOT_READY = "not_ready"
    """Repeated checkpoint failures, a background task that ended, or a dead engine: no new work
    is accepted."""
    DRAINING = "draining"

    @property
    def ready(self) -> bool:
        return self is ServingState.SERVING


class Lifecycle:
    """The serving state, and why the service is not ready.

    The service moves through STARTING, RESTORING, SERVING and DRAINING. While serving, any
    number of causes can hold readiness off (``block``); the state is NOT_READY until every one
    is lifted (``unblock``), so one cause's recovery never hides another's. ``on_change`` hears
    every change of the state (health checks, admission).
    """

    def __init__(self, on_change: Callable[[ServingState], Awaitable[None]]) -> None:
        self._on_change = on_change
        self._phase = ServingState.STARTING
        self._blocks: dict[str, str] = {}

    @property
    def state(self) -> ServingState:
        if self._phase is ServingState.SERVING and self._blocks:
            return ServingState.NOT_READY
        return self._phase

    @property
    def reason(self) -> str:
        """Why the service is not ready ("" when it is)."""
        if self.state.ready:
            return ""
        if self.state is ServingState.NOT_READY:
            return "not ready: " + "; ".join(self._blocks.values())
        return self.state.value

    def blocked(self, cause: str) -> bool:
        return cause in self._blocks

    async def enter(self, phase: ServingState) -> None:
        if phase is ServingState.NOT_READY:
            raise ValueError("NOT_READY follows from block(), it is not entered")
        await self._change(lambda: setattr(self, "_phase", phase))

    async def block(self, cause: str, reason: str) -> None:
        """Readiness off for ``cause`` until :meth:`unblock`."""
        await self._change(lambda: self._blocks.__setitem__(cause, reason))

    async def unblock(self, cause: str) -> None:
        await self._change(lambda: self._blocks.pop(cause, None))

    async def _change(self, apply: Callable[[], object]) -> None:
        before = self.state
        apply()
        if self.state is not before:
            why = "; ".join(self._blocks.values()) if self.state is ServingState.NOT_READY else ""
            log.info("state: %s%s", self.state.value, f" ({why})" if why else "")
            await self._on_change(self.state)
