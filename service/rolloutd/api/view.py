"""What the two APIs see of the running service: the servicer's ``Host`` and the admin app's
``AdminState``, answered from the controller, the lifecycle and the checkpoint scheduler."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from rolloutd.api import convert
from rolloutd.api.admin import SnapshotInfo
from rolloutd.api.json_shape import to_json
from rolloutd.checkpoint.scheduler import CheckpointScheduler
from rolloutd.checkpoint.store import SnapshotStore
from rolloutd.domain.controller import Controller
from rolloutd.domain.engine import GenerationEngine
from rolloutd.domain.lifecycle import Lifecycle, ServingState
from rolloutd.domain.report import CheckpointReport
from rolloutd.v1 import rollout_pb2 as pb


class ServiceView:
    def __init__(
        self,
        controller: Controller,
        engine: GenerationEngine,
        lifecycle: Lifecycle,
        scheduler: CheckpointScheduler,
        store: SnapshotStore,
    ) -> None:
        self._controller = controller
        self._engine = engine
        self._lifecycle = lifecycle
        self._scheduler = scheduler
        self._store = store

    # --- both ------------------------------------------------------------------------------

    async def checkpoint(self, tag: str, trainer_step: int | None) -> CheckpointReport:
        return await self._scheduler.on_demand(tag, trainer_step)

    # --- Host (the gRPC servicer) ----------------------------------------------------------

    @property
    def state(self) -> ServingState:
        return self._lifecycle.state

    @property
    def engine_name(self) -> str:
        return self._engine.name

    def status_proto(self) -> pb.GetStatusResponse:
        c = self._scheduler.checkpointer
        last = convert.checkpoint_status_to_proto(
            c.sequence,
            c.consecutive_failures,
            0.0 if c.last_success is None else c.last_success_at,  # no checkpoint yet
            c.last_attempt,
        )
        return convert.status_to_proto(
            self._controller.status(),
            self._engine.name,
            self._lifecycle.state,
            self._engine.counters().generation_tokens,
            last,
            self._controller.token_account(),
        )

    # --- AdminState (the admin HTTP app) ---------------------------------------------------

    def live(self) -> bool:
        return self._controller.fatal is None

    def readiness(self) -> tuple[bool, str]:
        return self._lifecycle.state.ready, self._lifecycle.reason

    def status(self) -> Mapping[str, Any]:
        return to_json(self.status_proto())

    def checkpoints(self) -> Sequence[SnapshotInfo]:
        return [
            SnapshotInfo(
                m.sequence, m.tag, m.trainer_step, m.created_at, m.live_rows, m.total_bytes
            )
            for m in self._store.list()
        ]
