"""The admin HTTP app: liveness, readiness, Prometheus ``/metrics``, status and checkpoints.

Thin like the gRPC servicer: it asks :class:`AdminState` (implemented by the composition root) and
encodes the answer. Handlers that read the state run on the event loop, like the rest of the
service; only ``/metrics`` runs on a worker thread, since a scrape collects every instrument.

It runs on uvicorn inside the service's own event loop (:class:`AdminServer`), never installs
signal handlers or logging configuration, and binds its socket itself so a port in use is an
``OSError`` for the caller rather than an exit of the process.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import socket
import ssl
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Annotated, Any, Protocol

import uvicorn
from fastapi import Depends, FastAPI, Header, HTTPException, Request, Response, status
from prometheus_client import CollectorRegistry
from prometheus_client.exposition import choose_encoder
from pydantic import BaseModel, ConfigDict, Field
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from rolloutd import __version__
from rolloutd.api import validation
from rolloutd.domain.errors import InvalidArgument, public_cause
from rolloutd.domain.report import CheckpointReport, Outcome, Reason, Trigger

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class SnapshotInfo:
    """One restorable snapshot, newest first in listings."""

    sequence: int
    tag: str
    trainer_step: int | None
    created_unix_s: float
    """Wall-clock time the snapshot was published."""
    rows: int
    """Rows live in the snapshot."""
    size_bytes: int
    """Bytes of every file the snapshot references."""


def find_snapshot(snapshots: Sequence[SnapshotInfo], spec: str) -> SnapshotInfo | None:
    """``latest`` (the first: listings are newest first), a sequence number, or a tag."""
    if spec == "latest":
        return snapshots[0] if snapshots else None
    if spec.isascii() and spec.isdigit():  # "²".isdigit() too, but int() refuses it
        return next((s for s in snapshots if s.sequence == int(spec)), None)
    return next((s for s in snapshots if s.tag == spec), None)


class AdminState(Protocol):
    """What the admin app needs from the service."""

    def live(self) -> bool:
        """False once the service cannot recover by itself (engine dead, loop wedged)."""

    def readiness(self) -> tuple[bool, str]:
        """(ready, reason): not ready while restoring, after repeated checkpoint failures, or
        draining; the reason says which."""

    def status(self) -> Mapping[str, Any]:
        """The ``GetStatus`` answer as JSON-compatible data."""

    def checkpoints(self) -> Sequence[SnapshotInfo]:
        """Restorable snapshots, newest first."""

    async def checkpoint(self, tag: str, trainer_step: int | None) -> CheckpointReport:
        """Runs one on-demand checkpoint attempt and reports how it went."""


class Health(BaseModel):
    live: bool


class Readiness(BaseModel):
    ready: bool
    reason: str = Field(description="Why the service is not ready; empty when ready.")


class CheckpointRequest(BaseModel):
    """Checked by :func:`validation.checkpoint_request`, as the ``Checkpoint`` RPC is."""

    model_config = ConfigDict(extra="forbid")

    tag: str = Field(
        "",
        description="Label stored with the snapshot; not all digits, latest or none (those "
        "name a sequence or a --restore keyword).",
    )
    trainer_step: int | None = Field(
        None, description="Trainer checkpoint step: acks up to it are finalized."
    )


class CheckpointResult(BaseModel):
    outcome: Outcome
    reason: Reason
    trigger: Trigger
    sequence: int | None = Field(description="Snapshot sequence; null when none was written.")
    tag: str
    trainer_step: int | None
    seconds: float = Field(description="Duration of the whole attempt.")
    phase_seconds: dict[str, float] = Field(description="Duration of each phase that ran.")
    error: str | None = Field(description="What went wrong, for a failed attempt.")
    message: str = Field(
        description="What the caller should know beyond the outcome: the error, or that the tag "
        "moved from an older snapshot (still reachable by its sequence) to this one; empty if "
        "nothing."
    )

    @classmethod
    def from_report(cls, report: CheckpointReport) -> CheckpointResult:
        return cls(
            outcome=report.outcome,
            reason=report.reason,
            trigger=report.trigger,
            sequence=report.sequence,
            tag=report.tag,
            trainer_step=report.trainer_step,
            seconds=report.seconds,
            phase_seconds=report.phase_seconds(),
            error=None
            if report.error is None
            else f"{type(report.error).__name__}: {public_cause(report.error)}",
            message=report.message(),
        )


_PROMETHEUS_RESPONSE: dict[int | str, dict[str, Any]] = {
    200: {
        "description": "Prometheus text exposition (OpenMetrics when asked for in Accept).",
        "content": {"text/plain": {}},
    }
}


def create_admin_app(
    state: AdminState,
    prometheus_registry: CollectorRegistry,
    *,
    auth_token: str | None = None,
) -> FastAPI:
    """The admin app. ``auth_token``: required as ``Authorization: Bearer`` (scheme in any
    case) on every route that changes state, the same token as mutating RPCs; reads are
    open. A new route that is not a ``GET`` takes ``dependencies=[Depends(require_token)]``
    (tests/api/test_admin.py checks every route)."""
    app = FastAPI(
        title="rolloutd admin",
        version=__version__,
        description="Health, readiness, Prometheus metrics, status and checkpoints of rolloutd.",
        # Swagger UI and ReDoc load their assets from a CDN and do not render offline; the
        # OpenAPI document itself stays at /openapi.json.
        docs_url=None,
        redoc_url=None,
    )

    expected = None if auth_token is None else auth_token.encode()

    def require_token(authorization: Annotated[str | None, Header()] = None) -> None:
        if expected is None:
            return
        scheme, _, token = (authorization or "").partition(" ")
        # as bytes: compare_digest refuses text that is not ASCII (a header decoded as latin-1)
        if scheme.lower() != "bearer" or not secrets.compare_digest(
            token.strip().encode(), expected
        ):
            raise HTTPException(
                status.HTTP_401_UNAUTHORIZED,
                "a valid bearer token is required",
                headers={"WWW-Authenticate": "Bearer"},
            )

    @app.get("/healthz", response_model=Health, responses={503: {"model": Health}})
    async def healthz(response: Response) -> Health:
        """Liveness: 503 when the service should be restarted."""
        live = state.live()
        if not live:
            response.status_code = status.HTTP_503_SERVICE_UNAVAILABLE
        return Health(live=live)

    @app.get("/readyz", response_model=Readiness, responses={503: {"model": Readiness}})
    async def readyz(response: Response) -> Readiness:
        """Readiness: 503 with the reason while restoring, after repeated checkpoint failures,
        or while draining."""
        ready, reason = state.readiness()
        if not ready:
            response.status_code = status.HTTP_503_SERVICE_UNAVAILABLE
        return Readiness(ready=ready, reason="" if ready else reason)

    @app.get("/metrics", response_class=Response, responses=_PROMETHEUS_RESPONSE)
    def metrics(request: Request) -> Response:
        """Every catalogue instrument in Prometheus naming (run off the event loop: a scrape
        collects all instruments)."""
        encoder, content_type = choose_encoder(request.headers.get("accept", ""))
        return Response(content=encoder(prometheus_registry), media_type=content_type)

    @app.get("/v1/status")
    async def get_status() -> dict[str, Any]:
        """Buffer, in-flight work, policy version, last checkpoint and counters."""
        return dict(state.status())

    @app.get("/v1/checkpoints")
    async def list_checkpoints() -> list[SnapshotInfo]:
        """Restorable snapshots, newest first."""
        return list(state.checkpoints())

    @app.get("/v1/checkpoints/{snapshot}", responses={404: {"description": "No such snapshot."}})
    async def get_checkpoint(snapshot: str) -> SnapshotInfo:
        """One snapshot, named as ``--restore`` names it: ``latest``, a sequence number or a
        tag."""
        found = find_snapshot(state.checkpoints(), snapshot)
        if found is None:
            raise HTTPException(status.HTTP_404_NOT_FOUND, f"no snapshot {snapshot!r}")
        return found

    @app.post("/v1/checkpoints", dependencies=[Depends(require_token)])
    async def create_checkpoint(body: CheckpointRequest | None = None) -> CheckpointResult:
        """Runs one on-demand checkpoint; the outcome (completed, skipped or failed) and its
        reason are in the body, as in the ``Checkpoint`` RPC."""
        request = body or CheckpointRequest()
        try:
            validation.checkpoint_request(request.tag, request.trainer_step)
            report = await state.checkpoint(request.tag, request.trainer_step)
        except InvalidArgument as exc:
            raise HTTPException(status.HTTP_422_UNPROCESSABLE_CONTENT, str(exc)) from None
        return CheckpointResult.from_report(report)

    return app


@dataclass(frozen=True)
class AdminTls:
    """PEM files: the admin port serves HTTPS only; with ``client_ca``, mutual TLS."""

    cert: str
    key: str
    client_ca: str | None = None


def _with_header_timeout(timeout_s: float) -> type[HttpToolsProtocol]:
    """uvicorn's protocol, closing a connection that has not sent a whole request head within
    ``timeout_s`` of opening or of its previous response. uvicorn itself only times out idle
    keep-alive connections, and a byte now and then resets even that (slowloris)."""

    class HeaderTimeoutProtocol(HttpToolsProtocol):
        _head_timer: asyncio.TimerHandle | None = None

        def _arm(self) -> None:
            self._disarm()
            self._head_timer = self.loop.call_later(timeout_s, self._head_timed_out)

        def _disarm(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None

        def _head_timed_out(self) -> None:
            self._head_timer = None
            if not self.transport.is_closing():
                self.transport.close()

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._arm()

        def on_headers_complete(self) -> None:
            self._disarm()
            super().on_headers_complete()

        def on_response_complete(self) -> None:
            self._arm()  # before: a pipelined request's head may complete inside
            super().on_response_complete()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

    return HeaderTimeoutProtocol


class _EmbeddedServer(uvicorn.Server):
    """uvicorn without its signal handling: the host owns SIGINT/SIGTERM and shuts us down."""

    @contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


class AdminServer:
    """Runs an ASGI app on uvicorn as a task of the current event loop.

    ``start`` returns once it accepts connections (port 0 picks a free port, reported by
    ``port``); ``stop`` lets requests in progress finish for up to ``grace_s``.
    """

    def __init__(
        self,
        app: FastAPI,
        host: str = "127.0.0.1",
        port: int = 8080,
        grace_s: int = 5,
        *,
        tls: AdminTls | None = None,
        header_timeout_s: float = 10.0,
    ):
        self._host = host
        self._requested_port = port
        self._grace_s = grace_s
        self._config = uvicorn.Config(
            app,
            host=host,
            port=port,
            http=_with_header_timeout(header_timeout_s),
            log_config=None,
            access_log=False,
            lifespan="off",
            server_header=False,
            timeout_graceful_shutdown=grace_s,
            ssl_certfile=None if tls is None else tls.cert,
            ssl_keyfile=None if tls is None else tls.key,
            ssl_ca_certs=None if tls is None else tls.client_ca,
            ssl_cert_reqs=ssl.CERT_REQUIRED
            if tls is not None and tls.client_ca is not None
            else ssl.CERT_NONE,
        )
        self._server = _EmbeddedServer(self._config)
        self._socket: socket.socket | None = None
        self._task: asyncio.Task[None] | None = None

    @property
    def port(self) -> int:
        if self._socket is None:
            raise RuntimeError("the admin server is not started")
        port: int = self._socket.getsockname()[1]
        return port

    async def start(self) -> int:
        if self._task is not None:
            raise RuntimeError("the admin server is already started")
        self._socket = _bind(self._host, self._requested_port)
        self._task = asyncio.create_task(self._serve(self._socket), name="rolloutd-admin-http")
        while not self._server.started:
            if self._task.done():
                self._task.result()
                raise RuntimeError("the admin server stopped while starting")
            await asyncio.sleep(0.01)
        logger.info("admin HTTP on %s:%d", self._host, self.port)
        return self.port

    async def _serve(self, sock: socket.socket) -> None:
        try:
            await self._server.serve(sockets=[sock])
        except SystemExit as exc:
            raise RuntimeError(f"the admin server exited (code {exc.code})") from None

    async def stop(self) -> None:
        """Idempotent; returns once the server has closed its socket."""
        if self._task is None or self._task.done():
            return
        self._server.should_exit = True
        try:
            await asyncio.wait_for(asyncio.shield(self._task), timeout=self._grace_s + 1.0)
        except TimeoutError:
            self._server.force_exit = True
            await self._task


def _bind(host: str, port: int) -> socket.socket:
    family, kind, proto, _, address = socket.getaddrinfo(
        host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    )[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
    except OSError:
        sock.close()
        raise
    return sock
