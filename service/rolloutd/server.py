"""The composition root: builds every component from the config, serves, shuts down in order.

Health: the overall status ``""`` is liveness (SERVING while the process can recover by itself),
``rolloutd.v1.RolloutService`` is readiness (SERVING only while accepting work).

Shutdown (SIGTERM/SIGINT, idempotent): readiness NOT_SERVING, stop accepting RPCs with a grace
period, stop generation, final checkpoint, stop the engine, flush telemetry.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from rolloutd.api.admin import AdminServer, SnapshotInfo, create_admin_app
from rolloutd.api.convert import OUTCOMES, REASONS, status_to_proto
from rolloutd.api.json_shape import to_json
from rolloutd.api.reflection import enable_reflection
from rolloutd.api.servicer import SERVING_STATES, RolloutServicer
from rolloutd.checkpoint.checkpointer import AckJournal, Checkpointer, CheckpointerConfig
from rolloutd.checkpoint.report import CheckpointReport, Outcome, Trigger
from rolloutd.checkpoint.restore import Granularity, restore
from rolloutd.checkpoint.store import SnapshotStore
from rolloutd.config import Config
from rolloutd.dataset import load_prompts
from rolloutd.domain.controller import Controller, ControllerConfig
from rolloutd.domain.group import GroupState
from rolloutd.domain.lifecycle import ServingState
from rolloutd.domain.sampler import Sampler
from rolloutd.engines.base import GenerationEngine, SamplingParams
from rolloutd.engines.factory import build_engine
from rolloutd.startup import PortUnavailable
from rolloutd.telemetry.interceptors import RpcMetricsInterceptor, server_interceptors
from rolloutd.telemetry.providers import Telemetry, setup_telemetry
from rolloutd.telemetry.sources import CheckpointState, StatusSnapshot
from rolloutd.v1 import rollout_pb2 as pb
from rolloutd.v1 import rollout_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["RolloutService"].full_name


@dataclass(frozen=True)
class Addresses:
    grpc: str
    http: str | None


def controller_config(config: Config) -> ControllerConfig:
    lim, eng = config.limits, config.engine
    return ControllerConfig(
        group_size=config.group_size,
        max_in_flight=lim.max_in_flight,
        buffer_capacity=lim.buffer_capacity,
        max_staleness=lim.max_staleness,
        lease_timeout_s=lim.lease_timeout_s,
        rewind_window=lim.rewind_window,
        max_fetch_groups=lim.max_fetch_groups,
        max_wait_ms=lim.max_wait_ms,
        seed=config.dataset.seed,
        sampling=SamplingParams(eng.max_tokens, eng.temperature, eng.top_p),
    )


class RolloutService:
    """One running rolloutd: engine, controller, gRPC server, and their lifecycle."""

    def __init__(
        self,
        config: Config,
        *,
        engine: GenerationEngine | None = None,
        telemetry: Telemetry | None = None,
    ) -> None:
        self.config = config
        prompts, self.dataset_digest = load_prompts(config.dataset.path)
        if engine is None:
            built = build_engine(
                config.engine, max_sequences=config.limits.max_in_flight * config.group_size
            )
            engine, model_id = built.engine, built.model_id
        else:
            model_id = engine.name
        self.engine = engine
        self.telemetry = telemetry or setup_telemetry()
        self.observer = self.telemetry.observer()
        sampler = Sampler(
            prompts,
            seed=config.dataset.seed,
            shuffle=config.dataset.shuffle,
            epochs=config.dataset.epochs,
            max_pending=config.limits.max_pending_prompts,
        )
        ckpt = config.checkpoint
        self.store = SnapshotStore(ckpt.dir, ckpt.storage_options)
        self.journal = AckJournal(self.store)
        self.controller = Controller(
            controller_config(config),
            self.engine,
            sampler,
            observer=self.observer,
            journal=self.journal,
        )
        self.fingerprint = config.semantic_fingerprint(self.dataset_digest, model_id)
        self.checkpointer = Checkpointer(
            self.controller,
            self.store,
            self.journal,
            CheckpointerConfig(
                interval_s=ckpt.interval_s,
                keep_latest=ckpt.keep_latest,
                keep_tagged=ckpt.keep_tagged,
                max_consecutive_failures=ckpt.max_consecutive_failures,
                timeout_s=ckpt.timeout_s,
                compact_segments=ckpt.compact_segments,
            ),
            self.fingerprint,
            observer=self.observer,
        )
        self._periodic: asyncio.Task[None] | None = None
        self._attempts: set[asyncio.Task[CheckpointReport]] = set()
        self._gauges: asyncio.Task[None] | None = None
        self._status_snapshot = StatusSnapshot()
        self._admin: AdminServer | None = None
        self.observer.register_sources(
            engine_counters=self.engine.counters,
            engine_name=self.engine.name,
            status=lambda: self._status_snapshot,
            checkpoint_state=lambda: CheckpointState(
                interval_s=ckpt.interval_s,
                since_success_s=self.checkpointer.since_success_s(),
                consecutive_failures=self.checkpointer.consecutive_failures,
            ),
        )
        self._state = ServingState.STARTING
        self._health = health.aio.HealthServicer()
        self._server: grpc.aio.Server | None = None
        self._stopping = asyncio.Event()
        self._stopped = False
        self.addresses: Addresses | None = None
        tls = config.grpc
        self._credentials = (
            grpc.ssl_server_credentials(
                [(Path(tls.tls_key).read_bytes(), Path(tls.tls_cert).read_bytes())],
                root_certificates=Path(tls.tls_client_ca).read_bytes()
                if tls.tls_client_ca
                else None,
                require_client_auth=tls.tls_client_ca is not None,
            )
            if tls.tls_cert and tls.tls_key
            else None
        )

    # --- Host protocol of the servicer -----------------------------------------------------

    @property
    def state(self) -> ServingState:
        return self._state

    @property
    def engine_name(self) -> str:
        return self.engine.name

    async def checkpoint(self, tag: str, trainer_step: int | None) -> CheckpointReport:
        return await self._checkpoint(Trigger.ON_DEMAND, tag, trainer_step)

    def status_proto(self) -> pb.GetStatusResponse:
        response = status_to_proto(
            self.controller.status(), self.engine.name, SERVING_STATES[self._state]
        )
        response.counters.generation_tokens = self.engine.counters().generation_tokens
        response.last_checkpoint.CopyFrom(self.last_checkpoint())
        return response

    # --- AdminState protocol of the admin app ----------------------------------------------

    def live(self) -> bool:
        return self.controller.fatal is None

    def readiness(self) -> tuple[bool, str]:
        if self._state.ready:
            return True, ""
        if self._state is ServingState.NOT_READY:
            return False, (
                f"not ready: {self.checkpointer.consecutive_failures} checkpoint failures in a row"
                if self.controller.fatal is None
                else f"not ready: {self.controller.fatal}"
            )
        return False, self._state.value

    def status(self) -> Mapping[str, Any]:
        return to_json(self.status_proto())

    def checkpoints(self) -> Sequence[SnapshotInfo]:
        return [
            SnapshotInfo(
                m.sequence, m.tag, m.trainer_step, m.created_at, m.live_rows, m.total_bytes
            )
            for m in self.store.list()
        ]

    def last_checkpoint(self) -> pb.CheckpointStatus:
        c = self.checkpointer
        status = pb.CheckpointStatus(
            sequence=c.sequence,
            consecutive_failures=c.consecutive_failures,
            completed_at=0.0 if c.last_success is None else c.last_success_at,
        )
        if c.last_attempt is not None:
            status.outcome = OUTCOMES[c.last_attempt.outcome]
            status.reason = REASONS[c.last_attempt.reason]
            status.attempted_at = c.last_attempt.ended_ns / 1e9
            status.tag = c.last_attempt.tag
        return status

    async def _checkpoint(
        self, trigger: Trigger, tag: str = "", trainer_step: int | None = None
    ) -> CheckpointReport:
        """One attempt, after which readiness follows the checkpointer's health.

        The attempt runs as a task of its own that the caller's cancellation does not reach (an
        RPC past its deadline, a client gone, shutdown stopping the periodic loop): cut short
        while a worker thread writes and publishes its snapshot, it would leave the checkpointer
        a sequence number behind the store, and every later attempt would fail. Shutdown waits
        for the attempts in flight before the final checkpoint.
        """

        async def attempt() -> CheckpointReport:
            report = await self.checkpointer.checkpoint(trigger, tag, trainer_step)
            await self._follow_checkpoint_health()
            return report

        task = asyncio.create_task(attempt(), name=f"rolloutd-checkpoint-{trigger.value}")
        self._attempts.add(task)
        task.add_done_callback(self._attempts.discard)
        return await asyncio.shield(task)

    async def _follow_checkpoint_health(self) -> None:
        """Repeated checkpoint failures make the service not-ready; a success makes it ready."""
        if self._state is ServingState.SERVING and self.checkpointer.failing:
            log.error(
                "%d checkpoint failures in a row: not ready, admission paused",
                self.checkpointer.consecutive_failures,
            )
            await self.controller.set_admitting(False)
            await self._set_state(ServingState.NOT_READY)
        elif self._state is ServingState.NOT_READY and not self.checkpointer.failing:
            await self.controller.set_admitting(True)
            await self._set_state(ServingState.SERVING)

    async def _periodic_checkpoints(self) -> None:
        interval = self.config.checkpoint.interval_s
        while True:
            await asyncio.sleep(interval)
            await self._checkpoint(Trigger.PERIODIC)

    # --- lifecycle -------------------------------------------------------------------------

    async def _set_state(self, state: ServingState) -> None:
        self._state = state
        serving, not_serving = (
            health_pb2.HealthCheckResponse.SERVING,
            health_pb2.HealthCheckResponse.NOT_SERVING,
        )
        await self._health.set(SERVICE_NAME, serving if state.ready else not_serving)
        alive = state is not ServingState.DRAINING and self.controller.fatal is None
        await self._health.set("", serving if alive else not_serving)
        log.info("state: %s", state.value)

    async def _refresh_status(self) -> None:
        """Keeps the snapshot that metric readers (other threads) observe fresh, once a second."""
        while True:
            s = self.controller.status()
            b = s.buffer
            self._status_snapshot = StatusSnapshot(
                groups={
                    GroupState.GENERATING: b.generating,
                    GroupState.COMMITTED: b.committed,
                    GroupState.LEASED: b.leased,
                    GroupState.ACKED: b.acked,
                },
                inflight_samples=s.inflight_samples,
                policy_version=s.policy_version,
                pending_prompts=s.pending_prompts,
                expired_leases=s.counters.expired_leases,
                requeued_groups=s.counters.requeued_groups,
            )
            await asyncio.sleep(1.0)

    def install_signal_handlers(self) -> None:
        """SIGTERM/SIGINT request an orderly shutdown, also while still starting or restoring."""
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.request_stop)

    async def start(self) -> Addresses:
        """Starts every part; a start that fails leaves none of them running."""
        try:
            return await self._start()
        except BaseException:
            await self._close_failed_start()
            raise

    async def _close_failed_start(self) -> None:
        """No port, task or engine process outlives a failed start; there is nothing to save."""
        self._stopped = True
        for task in (self._gauges, self._periodic):
            if task is not None:
                task.cancel()
        if self._server is not None:
            await self._server.stop(0)
        if self._admin is not None:
            await self._admin.stop()
        await self.engine.stop()
        await self.telemetry.aclose()

    async def _start(self) -> Addresses:
        await self._set_state(ServingState.STARTING)
        cfg = self.config.grpc
        options = [
            ("grpc.max_receive_message_length", cfg.max_message_mb * 2**20),
            ("grpc.max_send_message_length", cfg.max_message_mb * 2**20),
            ("grpc.so_reuseport", 0),
        ]
        server = grpc.aio.server(
            options=options,
            interceptors=[
                *server_interceptors(self.telemetry.tracer_provider),
                RpcMetricsInterceptor(SERVICE_NAME, self.observer.rpc_finished),
            ],
        )
        pb_grpc.add_RolloutServiceServicer_to_server(
            RolloutServicer(self.controller, self, self.config.auth.token), server
        )
        health_pb2_grpc.add_HealthServicer_to_server(self._health, server)
        enable_reflection(
            (SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name), server
        )
        address = f"{cfg.host}:{cfg.port}"
        try:
            if self._credentials is not None:
                port = server.add_secure_port(address, self._credentials)
            else:
                port = server.add_insecure_port(address)
        except RuntimeError as exc:  # grpc says only "Failed to bind to address ..."
            raise PortUnavailable("gRPC", address, "--grpc-port", "grpc.port", "in use") from exc
        await server.start()
        self._server = server
        http_address = None
        if self.config.http.enabled:
            app = create_admin_app(
                self, self.telemetry.prometheus_registry, auth_token=self.config.auth.token
            )
            self._admin = AdminServer(app, host=self.config.http.host, port=self.config.http.port)
            try:
                http_port = await self._admin.start()
            except OSError as exc:
                where = f"{self.config.http.host}:{self.config.http.port}"
                raise PortUnavailable(
                    "admin HTTP", where, "--http-port", "http.port", exc.strerror or str(exc)
                ) from exc
            http_address = f"{self.config.http.host}:{http_port}"
        self._gauges = asyncio.create_task(self._refresh_status(), name="rolloutd-status-gauges")
        await self.engine.start()
        if self.config.restore != "none":
            await self._set_state(ServingState.RESTORING)
            self.checkpointer.restoring = True
            try:
                await restore(
                    self.controller,
                    self.store,
                    self.checkpointer,
                    self.config.restore,
                    self.fingerprint,
                    Granularity(self.config.recovery.granularity),
                )
            finally:
                self.checkpointer.restoring = False
        self.controller.start()
        if self.config.checkpoint.interval_s > 0:
            self._periodic = asyncio.create_task(
                self._periodic_checkpoints(), name="rolloutd-checkpoints"
            )
        await self._set_state(ServingState.SERVING)
        self.addresses = Addresses(grpc=f"{cfg.host}:{port}", http=http_address)
        log.info(
            "listening: grpc=%s http=%s engine=%s group_size=%d",
            self.addresses.grpc,
            self.addresses.http or "off",
            self.engine.name,
            self.config.group_size,
        )
        return self.addresses

    def request_stop(self) -> None:
        self._stopping.set()

    async def run_until_stopped(self) -> int:
        """Serves until SIGTERM/SIGINT or a fatal controller error; returns an exit code."""
        dead = asyncio.create_task(self.controller.wait_dead())
        stop = asyncio.create_task(self._stopping.wait())
        done, _ = await asyncio.wait({dead, stop}, return_when=asyncio.FIRST_COMPLETED)
        for t in (dead, stop):
            t.cancel()
        await self.shutdown()
        return 1 if dead in done else 0

    async def shutdown(self) -> None:
        if self._stopped:
            return
        self._stopped = True
        started = time.perf_counter()
        await self._set_state(ServingState.DRAINING)
        await self.controller.begin_drain()
        if self._server is not None:
            await self._server.stop(self.config.grpc.grace_s)
        if self._periodic is not None:
            self._periodic.cancel()
        if self._attempts:  # the final checkpoint follows the attempts in flight
            await asyncio.wait(self._attempts)
        await self.controller.stop()
        self.checkpointer.shutting_down = True
        final = await self.checkpointer.checkpoint(Trigger.SHUTDOWN)
        if final.outcome is Outcome.FAILED:
            log.error(
                "final checkpoint failed: %s; restart restores snapshot %d",
                final.error,
                self.checkpointer.sequence,
            )
        await self.engine.stop()
        for task in (self._gauges,):
            if task is not None:
                task.cancel()
        if self._admin is not None:
            await self._admin.stop()
        await self.telemetry.aclose()
        log.info("stopped in %.2fs", time.perf_counter() - started)
