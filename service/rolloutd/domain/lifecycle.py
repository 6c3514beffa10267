"""Whether the service accepts work; health checks and readiness follow this state."""

from __future__ import annotations

import enum


class ServingState(enum.Enum):
    STARTING = "starting"
    RESTORING = "restoring"
    SERVING = "serving"
    NOT_READY = "not_ready"
    """Repeated checkpoint failures or a dead engine: no new work is accepted."""
    DRAINING = "draining"

    @property
    def ready(self) -> bool:
        return self is ServingState.SERVING
