"""The composition root: builds every component from the config and wires them; runs them in order.

Nothing here decides policy or encodes anything: checkpoint cadence and the readiness it implies
are the :class:`CheckpointScheduler`'s, serving state the :class:`Lifecycle`'s, background tasks
the :class:`Supervisor`'s, proto encoding ``api/convert.py``'s.

Start-up: gRPC and admin servers (health NOT_SERVING), a check that the snapshot ``--restore``
names exists, engine, restore, admission, periodic checkpoints, SERVING, and one ``ready`` line
that says where to connect and what was restored. A start that fails shuts down what it
started, without a final checkpoint.

Shutdown (SIGTERM/SIGINT, idempotent): DRAINING, stop accepting RPCs with a grace period, stop
generation, final checkpoint, stop the engine, flush telemetry.

Exit code: 0 after a requested stop, 1 after an unrecoverable failure (a dead engine, also one that
dies while the service is idle, an invariant violation, a background task that died of one), so
the orchestrator restarts the process.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import signal
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from rolloutd.api.admin import AdminServer, AdminTls, create_admin_app
from rolloutd.api.dashboard import dashboard_router
from rolloutd.api.grpc_server import SERVICE_NAME, GrpcServer
from rolloutd.api.startup_errors import PortUnavailable
from rolloutd.api.view import ServiceView
from rolloutd.checkpoint.backends import ObjectBackend
from rolloutd.checkpoint.checkpointer import Checkpointer
from rolloutd.checkpoint.claim import Fenced, StoreHeld
from rolloutd.checkpoint.resolver import LATEST
from rolloutd.checkpoint.restore import Granularity, restore
from rolloutd.checkpoint.scheduler import CheckpointScheduler
from rolloutd.checkpoint.segments import ArrowSealer
from rolloutd.checkpoint.store import SnapshotStore
from rolloutd.checkpoint.tags import NONE, sequence_of
from rolloutd.config import Config, ConfigError
from rolloutd.dataset import load_prompts, load_source
from rolloutd.domain.controller import Controller
from rolloutd.domain.engine import EngineDeadError, GenerationEngine, ReportsRequests
from rolloutd.domain.episode import EnvironmentPort
from rolloutd.domain.episode_runner import EpisodeRunner
from rolloutd.domain.errors import (
    FailedPrecondition,
    InvalidArgument,
    InvariantError,
    RestoreRefused,
)
from rolloutd.domain.lifecycle import Lifecycle, ServingState
from rolloutd.domain.report import RestoreReport
from rolloutd.domain.sampler import DATASET, Sampler, Source, fleet_share
from rolloutd.engines.factory import build_engine
from rolloutd.entrypoints import EntryPointError, load
from rolloutd.episodes.loader import load_environment
from rolloutd.scoring import build_stage
from rolloutd.startup import ready_line
from rolloutd.supervisor import Supervisor
from rolloutd.telemetry.history import MetricHistory, history_log
from rolloutd.telemetry.interceptors import RpcMetricsInterceptor, server_interceptors
from rolloutd.telemetry.providers import Telemetry, setup_telemetry
from rolloutd.telemetry.sources import CheckpointState, StatusSnapshot, status_snapshot
from rolloutd.telemetry.vllm_metrics import VLLMFamilies
from rolloutd.weights.layout import served_layout
from rolloutd.weights.policy import SourcePolicy
from rolloutd.weights.staging import StagingArea
from rolloutd.weights.store import WeightsStore
from rolloutd.weights.updater import WeightsUpdater

log = logging.getLogger(__name__)

CLAIM = "store-claim"
"""The cause under which a store that cannot be claimed yet holds readiness off."""

ENGINE_WATCH_S = 1.0
"""How often the engine is asked whether it is alive."""

UNRECOVERABLE = (InvariantError, EngineDeadError)
"""Errors after which the process must be restarted rather than wait to be ready again."""


def _check_exposure(config: Config) -> None:
    """Secure by default: a port reachable from other machines needs a token (or mutual TLS),
    unless the operator opts out, and then hears about it at every start (docs/security.md)."""
    exposed = config.unauthenticated_binds()
    if not exposed:
        return
    where = " and ".join(f"{key} {_host_of(config, key)}" for key in exposed)
    if not config.auth.allow_unauthenticated:
        raise ConfigError(
            f"config key '{exposed[0]}': {where} accepts connections from other machines but "
            "nothing authenticates them; set auth.token (ROLLOUTD_AUTH__TOKEN, e.g. "
            "`export ROLLOUTD_AUTH__TOKEN=$(openssl rand -hex 32)`), bind 127.0.0.1, or set "
            "auth.allow_unauthenticated: true to serve without authentication"
        )
    log.warning(
        "%s: serving without authentication (auth.allow_unauthenticated): anyone who can reach "
        "the port may replace the weights, rewind or submit prompts",
        where,
    )


def _host_of(config: Config, key: str) -> str:
    return config.grpc.host if key == "grpc.host" else config.http.host


def _plugged(key: str, spec: str | None) -> Any:
    """A pipeline component built from its entry point (None: the default one); a failure is a
    configuration error that names the key."""
    if spec is None:
        return None
    try:
        return load(spec)()
    except EntryPointError as exc:
        raise ConfigError(f"{key}: {exc}") from exc


@dataclass(frozen=True)
class Addresses:
    grpc: str
    http: str | None


def _episode_runner(config: Config) -> EpisodeRunner:
    """The episode runner with each configured environment loaded (errors name their key)."""
    ep = config.episodes

    def loaded(key: str, spec: str, env_config: Mapping[str, Any]) -> EnvironmentPort:
        try:
            return load_environment(
                spec, env_config, step_timeout_s=ep.step_timeout_s, retries=ep.retries, key=key
            )
        except ValueError as exc:
            raise ConfigError(str(exc)) from exc

    default = (
        None
        if ep.environment is None
        else loaded("episodes.environment", ep.environment, ep.environment_config)
    )
    by_source = {
        s.name: loaded(
            f"dataset.sources[{i}].environment",
            s.environment,
            ep.environment_config if s.environment_config is None else s.environment_config,
        )
        for i, s in enumerate(config.dataset.sources)
        if s.environment
    }
    return EpisodeRunner(by_source, default, ep.limits())


class RolloutService:
    """One running rolloutd: every component, built from ``config`` (the wiring is __init__)."""

    def __init__(
        self,
        config: Config,
        *,
        engine: GenerationEngine | None = None,
        telemetry: Telemetry | None = None,
    ) -> None:
        self.config = config
        _check_exposure(config)
        runner = _plugged("pipeline.sibling_runner", config.pipeline.sibling_runner)
        stage = _plugged("pipeline.finishing_stage", config.pipeline.finishing_stage)
        self.episodes = _episode_runner(config) if config.episodes_configured() else None
        runner = runner or self.episodes
        try:
            self.scoring = build_stage(
                config.scoring_config(),
                config.filter_config(),
                {s.name: s.verifier for s in config.dataset.sources if s.verifier},
                episodes=self.episodes is not None,
            )
        except ValueError as exc:  # a verifier's entry point that cannot be loaded
            raise ConfigError(str(exc)) from exc
        stage = stage or self.scoring
        limits = config.spec_limits()
        sources: list[Source] = []
        dataset_digest: str | dict[str, str]
        if config.dataset.sources:
            dataset_digest = {}
            for s in config.dataset.sources:
                source, dataset_digest[s.name] = load_source(
                    s.name,
                    s.path,
                    s.weight,
                    s.generation.spec(),
                    limits,
                    config.limits.max_metadata_bytes,
                )
                sources.append(source)
        else:
            prompts, dataset_digest = load_prompts(
                config.dataset.path, limits, config.limits.max_metadata_bytes
            )
            sources.append(Source(DATASET, prompts))
        if engine is None:
            built = build_engine(
                config.engine_factory(),
                max_sequences=config.limits.in_flight_cap * config.group_size,
            )
            engine, model_id, model_dir = built.engine, built.model_id, built.model_dir
        else:
            model_id = engine.name
            model_dir = None if config.engine.model is None else Path(config.engine.model)
        self.engine = engine
        self.telemetry = telemetry or setup_telemetry()
        self.observer = self.telemetry.observer()
        if isinstance(engine, ReportsRequests):
            engine.report_requests(self.observer)
        ckpt, fleet = config.checkpoint, config.fleet
        self.store = SnapshotStore(
            ckpt.dir, ckpt.storage_options, lock_timeout_s=ckpt.lock_timeout_s
        )
        self.controller = Controller(
            config.controller(),
            engine,
            Sampler(
                [
                    replace(s, prompts=fleet_share(s.prompts, fleet.replica, fleet.replicas))
                    for s in sources
                ],
                seed=config.dataset.seed,
                shuffle=config.dataset.shuffle,
                epochs=config.dataset.epochs,
                max_pending=config.limits.max_pending_prompts,
                max_pending_bytes=config.limits.max_pending_bytes,
            ),
            observer=self.observer,
            journal=self.store.journal,
            sealer=ArrowSealer(),
            runner=runner,
            stage=stage,
        )
        self.fingerprint = config.semantic_fingerprint(dataset_digest, model_id)
        weights = config.weights
        self.staging = StagingArea(weights.staging_dir)
        layout = served_layout(model_dir)
        self.weights = WeightsUpdater(
            self.controller,
            self.staging,
            layout,
            storage_options=(
                ckpt.storage_options if weights.storage_options is None else weights.storage_options
            ),
            concurrency=weights.fetch_concurrency,
            observer=self.observer,
            served_dir=None if layout is None else model_dir,
            policy=SourcePolicy(weights.allowed_urls, weights.local_root),
            transfer_timeout_s=weights.transfer_timeout_s,
            push_idle_timeout_s=weights.push_idle_timeout_s,
            store=None
            if weights.store is None
            else WeightsStore(
                weights.store,
                ckpt.storage_options
                if weights.storage_options is None
                else weights.storage_options,
            ),
        )
        self.lifecycle = Lifecycle(self._state_changed)
        self.checkpointer = Checkpointer(
            self.controller,
            self.store,
            self.store.journal,
            config.checkpointer(),
            self.fingerprint,
            observer=self.observer,
            lifecycle=self.lifecycle,
        )
        self.scheduler = CheckpointScheduler(
            self.checkpointer, self.lifecycle, ckpt.interval_s, kept=self.weights
        )
        self.supervisor = Supervisor(self._task_failed, UNRECOVERABLE)
        view = ServiceView(self.controller, engine, self.lifecycle, self.scheduler, self.store)
        self._grpc = GrpcServer(
            self.controller,
            view,
            address=f"{config.grpc.host}:{config.grpc.port}",
            max_message_mb=config.grpc.max_message_mb,
            auth_token=config.auth.token,
            tls_cert=config.grpc.tls_cert,
            tls_key=config.grpc.tls_key,
            tls_client_ca=config.grpc.tls_client_ca,
            interceptors=[
                *server_interceptors(self.telemetry.tracer_provider, self.telemetry.records_spans),
                RpcMetricsInterceptor(SERVICE_NAME, self.observer.rpc_finished),
            ],
            weights=self.weights,
        )
        self.history = MetricHistory(
            self.telemetry.prometheus_registry,
            run=uuid.uuid4().hex[:12],
            capacity=config.http.dashboard_points,
            log=history_log(
                ckpt.dir,
                self.store.backend if isinstance(self.store.backend, ObjectBackend) else None,
                config.http.dashboard_points,
            ),
        )
        if engine.name == "vllm":
            self.telemetry.prometheus_registry.register(VLLMFamilies())
        self._admin: AdminServer | None = None
        if config.http.enabled:
            app = create_admin_app(
                view, self.telemetry.prometheus_registry, auth_token=config.auth.token
            )
            app.include_router(
                dashboard_router(
                    self.history,
                    config.http.dashboard_interval_s,
                    scoring=self.scoring is not None,
                )
            )
            self._admin = AdminServer(
                app,
                host=config.http.host,
                port=config.http.port,
                tls=AdminTls(config.http.tls_cert, config.http.tls_key, config.http.tls_client_ca)
                if config.http.tls_cert is not None and config.http.tls_key is not None
                else None,
                header_timeout_s=config.http.header_timeout_s,
            )
        self._status = StatusSnapshot()
        self.observer.register_sources(
            engine_counters=engine.counters,
            engine_name=engine.name,
            status=lambda: self._status,
            checkpoint_state=lambda: CheckpointState(
                interval_s=ckpt.interval_s,
                since_success_s=self.checkpointer.since_success_s(),
                consecutive_failures=self.checkpointer.consecutive_failures,
            ),
            model=model_id,
            dataset_sources=[s.name for s in sources],
        )
        self._stopping = asyncio.Event()
        self._stopped = False
        self._exit_code = 0
        self.addresses: Addresses | None = None

    # --- start, run, stop ------------------------------------------------------------------

    async def start(self) -> Addresses:
        """Starts every component; on failure shuts down what it started and raises."""
        try:
            return await self._start()
        except BaseException:
            log.error("start-up failed; shutting down what was started")
            await self.shutdown(final_checkpoint=False)
            raise

    async def _start(self) -> Addresses:
        await self._state_changed(self.lifecycle.state)
        # a frozen holder's claim is waited out; a live holder ends the start
        await self._claim_store(self.config.checkpoint.claim_wait)
        self.supervisor.spawn("store-claim", self._keep_claim())
        if self.config.restore not in (LATEST, NONE):
            # a snapshot that is not there fails the start before the engine takes its time
            await asyncio.to_thread(sequence_of, self.store, self.config.restore)
        port = await self._grpc.start()
        http = None
        if self._admin is not None:
            try:
                http_port = await self._admin.start()
            except OSError as exc:
                where = f"{self.config.http.host}:{self.config.http.port}"
                raise PortUnavailable(
                    "admin HTTP", where, "--http-port", "http.port", exc.strerror or str(exc)
                ) from exc
            http = f"{self.config.http.host}:{http_port}"
            self.supervisor.spawn(
                "dashboard-history", self.history.run_every(self.config.http.dashboard_interval_s)
            )
        self.supervisor.spawn("status-gauges", self._refresh_status())
        await asyncio.to_thread(self.staging.prepare)
        await self.engine.start()
        self.supervisor.spawn("engine", self._watch_engine())
        if self.scoring is not None:
            await self.scoring.start()  # before a restore: it may score restored groups
        restored: RestoreReport | None = None
        if self.config.restore != NONE:
            await self.lifecycle.enter(ServingState.RESTORING)
            restored = await restore(
                self.controller,
                self.store,
                self.checkpointer,
                self.config.restore,
                self.fingerprint,
                Granularity(self.config.recovery.granularity),
                observer=self.observer,
            )
            if self.controller.weights_path is not None:
                self.weights.restored(self.controller.weights_path)
        try:
            await self.weights.catch_up()  # before the first admission
        except (FailedPrecondition, InvalidArgument) as exc:
            raise RestoreRefused(f"catching up with the weights store: {exc}") from exc
        if self.config.restore == NONE:
            # What start-up built (modules, configuration, engine) lives as long as the service:
            # out of the collector's view, full collections scan only what changes afterwards
            # (a restore does the same for what it built).
            gc.freeze()
        # Every group allocates thousands of short-lived objects: at the default threshold (700)
        # young collections ran thousands of times a second under 64 trainers and aged objects
        # into full ones (0.84 s of collections in a 10 s window, 0.28 s at this threshold);
        # rarer ones cost a few MB of garbage waiting at most.
        gc.set_threshold(20_000, 10, 10)
        self.controller.start()
        self.supervisor.spawn("controller", self._watch_controller())
        if self.config.checkpoint.interval_s > 0:
            self.supervisor.spawn("checkpoints", self.scheduler.run_periodic())
        await self.lifecycle.enter(ServingState.SERVING)
        self.addresses = Addresses(grpc=f"{self.config.grpc.host}:{port}", http=http)
        log.info(
            "%s",
            ready_line(
                self.addresses.grpc,
                self.addresses.http,
                self.config.checkpoint.dir,
                restored,
                not_ready=self.lifecycle.reason,
                https=self.config.http.tls_cert is not None,
            ),
        )
        return self.addresses

    def install_signal_handlers(self) -> None:
        """SIGTERM/SIGINT request an orderly shutdown, also while still starting or restoring."""
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.request_stop)

    def request_stop(self) -> None:
        self._stopping.set()

    async def run_until_stopped(self) -> int:
        """Serves until SIGTERM/SIGINT or an unrecoverable failure; returns the exit code."""
        fatal = asyncio.ensure_future(self.supervisor.wait_fatal())
        stop = asyncio.ensure_future(self._stopping.wait())
        await asyncio.wait({fatal, stop}, return_when=asyncio.FIRST_COMPLETED)
        error = fatal.result() if fatal.done() else None
        for t in (fatal, stop):
            t.cancel()
        # After an invariant violation the state may be wrong: restart from the last snapshot
        # and the journal rather than save it.
        await self.shutdown(final_checkpoint=not isinstance(error, InvariantError))
        return 1 if error is not None else self._exit_code

    async def shutdown(self, *, final_checkpoint: bool = True) -> None:
        """Idempotent. ``final_checkpoint=False`` after a failed start: a snapshot of what did
        not start would hide the one that could not be restored."""
        if self._stopped:
            return
        self._stopped = True
        started = time.perf_counter()
        await self.lifecycle.enter(ServingState.DRAINING)
        await self.controller.begin_drain()
        await self._grpc.stop(self.config.grpc.grace_s)
        await self.supervisor.stop()
        await self.controller.stop()
        if final_checkpoint:
            try:
                await self.scheduler.final()
            except InvariantError as exc:  # the rest of the shutdown still runs, in order
                log.critical("final checkpoint: %s", exc)
                self._exit_code = 1
        if self.store.claim.held:
            try:
                await asyncio.to_thread(self.store.claim.release)
            except OSError as exc:
                log.warning("could not release the store's claim: %s", exc)
        if self.scoring is not None:
            await self.scoring.aclose()
        await self.engine.stop()
        self.weights.close()
        if self._admin is not None:
            await asyncio.to_thread(self.history.sample)  # the final checkpoint on the dashboard
            await self._admin.stop()
        await self.telemetry.aclose()
        log.info("stopped in %.2fs", time.perf_counter() - started)

    # --- wiring callbacks ------------------------------------------------------------------

    async def _state_changed(self, state: ServingState) -> None:
        """Health follows the serving state; admission pauses while not ready."""
        alive = state is not ServingState.DRAINING and self.controller.fatal is None
        await self._grpc.set_health(state, alive=alive)
        if state in (ServingState.SERVING, ServingState.NOT_READY):
            await self.controller.set_admitting(state.ready)

    async def _task_failed(self, name: str, error: BaseException) -> None:
        await self.lifecycle.block(f"task:{name}", f"{name} ended: {error}")

    async def _claim_store(self, wait_s: float = 0.0) -> None:
        """Claims the store, waiting up to ``wait_s`` for another process's claim to lapse;
        :class:`StoreHeld` ends the start. A store that cannot be written (read-only,
        unreachable) leaves the service not ready until a later attempt succeeds."""
        try:
            await asyncio.to_thread(self.store.claim.acquire, wait_s)
        except StoreHeld:
            raise
        except OSError as exc:
            log.error("cannot claim the store: %s; retrying", exc)
            await self.lifecycle.block(CLAIM, f"cannot claim the store: {exc}")
        else:
            await self.lifecycle.unblock(CLAIM)

    async def _keep_claim(self) -> None:
        """Claims the store until it holds it, then renews the claim; once another process took
        it over, readiness stays off (its writes are fenced already) and the task waits for the
        shutdown."""
        claim = self.store.claim
        while claim.fenced is None:
            await asyncio.sleep(claim.timeout_s / 3)
            if not claim.held:
                await self._claim_store()
                continue
            try:
                await asyncio.to_thread(claim.renew)
            except Fenced:
                break
            except OSError as exc:  # the store is unreachable: the next renewal retries
                log.warning("could not renew the claim on the store: %s", exc)
        await self.lifecycle.block("fenced", claim.fenced or "fenced")
        await asyncio.Event().wait()

    async def _watch_engine(self) -> None:
        """Ends with :class:`EngineDeadError` once the engine dies, also while the service is
        idle: an engine death is otherwise seen only by the next engine call."""
        while True:
            self.engine.check_alive()
            await asyncio.sleep(ENGINE_WATCH_S)

    async def _watch_controller(self) -> None:
        """Ends, with the controller's fatal error, when the controller cannot go on."""
        raise await self.controller.wait_dead()

    async def _refresh_status(self) -> None:
        """Keeps the snapshot that metric readers (other threads) observe fresh, once a second."""
        while True:
            self._status = status_snapshot(self.controller.status())
            await asyncio.sleep(1.0)
