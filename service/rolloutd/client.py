"""Python trainer client: several endpoints, retries with backoff, W3C context propagation.

A fetch asks every endpoint at once (one rolloutd per GPU node, a fleet) and returns the first
lease any of them grants, so a trainer gets groups as soon as one replica has them. At most one
fetch per endpoint is in flight: a call still waiting when another endpoint answered goes on, and
a lease it brings back is kept and returned by the next ``fetch``, never stranded. An endpoint
that fails (down, draining: UNAVAILABLE) is left out with exponential backoff and probed again
later, so a dead one does not slow every call. An ack goes back to the endpoint that issued the
lease. Other calls that are safe to repeat (every RPC here: acks and prompt submissions are
idempotent) are retried with exponential backoff and jitter: DEADLINE_EXCEEDED and
RESOURCE_EXHAUSTED a few times, UNAVAILABLE for as long as an outage may last (``outage_s``).

A service that restarts (a SIGKILL, a rollout of its pod, a vLLM start of a minute) is an outage
the client rides out: leases, acks and finalized steps are durable and an ack is idempotent, so a
call that waits for the endpoint to come back loses nothing and trains nothing twice. The client
logs one warning when an endpoint stops answering and one line when it answers again, whatever
the number of calls that waited meanwhile.

:func:`client_stream` runs a client-streaming call (``PushWeights``) from ``grpc.aio`` code.
"""

from __future__ import annotations

import asyncio
import contextvars
import hashlib
import json
import logging
import mmap
import os
import queue
import random
import threading
import time
from collections import deque
from collections.abc import AsyncIterable, AsyncIterator, Callable, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

import grpc

from rolloutd.push_codec import encode_chunk
from rolloutd.v1 import rollout_pb2 as pb
from rolloutd.v1 import rollout_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

RETRYABLE = frozenset(
    {
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.DEADLINE_EXCEEDED,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
    }
)

T = TypeVar("T")


@dataclass(frozen=True)
class Lease:
    """Groups leased from one endpoint; ack it with :meth:`RolloutClient.ack`."""

    lease_id: str
    endpoint: str
    groups: Sequence[pb.Group]
    expires_at: float


@dataclass
class _Endpoint:
    """What the client knows of one endpoint's health, and its fetch in flight."""

    name: str
    failures: int = 0
    """Failed fetches in a row."""
    retry_at: float = 0.0
    """``time.monotonic()`` before which the endpoint is not asked (backoff)."""
    in_flight: bool = False
    sent: list[float] = field(default_factory=list)
    """When each fetch was sent (monotonic): what a test or a log can count."""
    down_since: float | None = None
    """``time.monotonic()`` of the first UNAVAILABLE of the outage under way; None: it answers."""


class RolloutClient:
    def __init__(
        self,
        endpoints: str | Sequence[str],
        *,
        token: str | None = None,
        timeout_s: float = 30.0,
        retries: int = 5,
        outage_s: float = 300.0,
        backoff_s: float = 0.2,
        max_backoff_s: float = 5.0,
        secure: bool = False,
        tls_ca: str | None = None,
        tls_cert: str | None = None,
        tls_key: str | None = None,
        interceptors: Iterable[grpc.UnaryUnaryClientInterceptor] | None = None,
        max_message_mb: int = 64,
    ) -> None:
        """``secure``: TLS, trusting the system's CA roots. ``tls_ca``: a PEM CA bundle to trust
        instead (implies TLS; for a private CA). ``tls_cert``/``tls_key``: a PEM client
        certificate and key, for a server that requires them (``grpc.tls_client_ca``).
        ``max_message_mb``: the largest message sent or received, the service's
        ``grpc.max_message_mb`` (gRPC's own default, 4 MiB, would refuse a fetch of groups
        with large metadata that the service sends).

        ``retries``: how often a call is repeated on DEADLINE_EXCEEDED or RESOURCE_EXHAUSTED.
        ``outage_s``: how long a call keeps trying an endpoint that answers UNAVAILABLE or not
        at all (restarting, a vLLM start, a pod rescheduled) before it raises; ``retries=0``
        repeats nothing, UNAVAILABLE included. Waits between tries grow from ``backoff_s`` to
        ``max_backoff_s``."""
        self.endpoints = [endpoints] if isinstance(endpoints, str) else list(endpoints)
        if not self.endpoints:
            raise ValueError("at least one endpoint is required")
        self._metadata = (("authorization", f"Bearer {token}"),) if token else ()
        self._timeout = timeout_s
        self._retries = retries
        self._outage_s = outage_s
        self._backoff = backoff_s
        self._max_backoff = max_backoff_s
        self._fleet = {ep: _Endpoint(ep) for ep in self.endpoints}
        self._outage_lock = threading.Lock()
        """Orders the outage warnings of calls that fail at once (pushes run in threads)."""
        self._answers: queue.Queue[tuple[_Endpoint, grpc.Future]] = queue.Queue()
        """Fetches that completed, in the order they did (filled from gRPC's threads)."""
        self._spare: deque[Lease] = deque()
        """Leases that came after a fetch returned another one: the next fetches return them."""
        if interceptors is None:
            interceptors = _default_interceptors()
        self._channels: dict[str, grpc.Channel] = {}
        self._stubs: dict[str, pb_grpc.RolloutServiceStub] = {}
        self._push_calls: dict[str, grpc.StreamUnaryMultiCallable] = {}
        credentials = _channel_credentials(secure, tls_ca, tls_cert, tls_key)
        size = max_message_mb << 20
        options = [
            ("grpc.max_receive_message_length", size),
            ("grpc.max_send_message_length", size),
        ]
        for ep in self.endpoints:
            channel = (
                grpc.insecure_channel(ep, options)
                if credentials is None
                else grpc.secure_channel(ep, credentials, options)
            )
            channel = grpc.intercept_channel(channel, *interceptors)
            self._channels[ep] = channel
            self._stubs[ep] = pb_grpc.RolloutServiceStub(channel)
            # PushWeights sends messages it encoded itself (see rolloutd.push_codec).
            self._push_calls[ep] = channel.stream_unary(
                "/rolloutd.v1.RolloutService/PushWeights",
                request_serializer=None,
                response_deserializer=pb.PushWeightsResponse.FromString,
            )

    def __enter__(self) -> RolloutClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        for channel in self._channels.values():
            channel.close()

    def _call(self, endpoint: str, fn: Callable[[pb_grpc.RolloutServiceStub], T]) -> T:
        """``fn`` on ``endpoint``'s stub, repeated as the module docstring says."""
        ep = self._fleet[endpoint]
        delay = self._backoff
        attempt = 0
        while True:
            try:
                result = fn(self._stubs[endpoint])
            except grpc.RpcError as exc:
                code = exc.code()  # type: ignore[attr-defined]
                if code not in RETRYABLE or self._retries == 0:
                    raise
                if code is grpc.StatusCode.UNAVAILABLE:
                    if self._unavailable(ep, exc) >= self._outage_s:
                        raise
                else:
                    attempt += 1
                    if attempt > self._retries:
                        raise
                log.debug("%s: %s, retrying in %.2fs", endpoint, code.name, delay)
                time.sleep(delay * random.uniform(0.5, 1.5))
                delay = min(delay * 2, self._max_backoff)
                continue
            self._answered(ep)
            return result

    def _unavailable(self, ep: _Endpoint, exc: grpc.RpcError) -> float:
        """``ep`` answered UNAVAILABLE (or nothing): the outage's length so far, which begins,
        with a warning, at the first."""
        now = time.monotonic()
        with self._outage_lock:
            if ep.down_since is None:
                ep.down_since = now
                log.warning(
                    "%s is unavailable (%s); waiting up to %.0f s for it to come back: leases "
                    "and acks are durable, so nothing is lost",
                    ep.name,
                    exc.details() or "no answer",  # type: ignore[attr-defined]
                    self._outage_s,
                )
            return now - ep.down_since

    def _answered(self, ep: _Endpoint) -> None:
        if ep.down_since is None:
            return
        with self._outage_lock:
            if ep.down_since is not None:
                log.warning(
                    "%s answers again after %.1f s", ep.name, time.monotonic() - ep.down_since
                )
                ep.down_since = None

    @property
    def outage_s(self) -> float | None:
        """How long every endpoint has been unavailable, or None while any answers (a trainer
        that counts idle time can leave an outage out of it)."""
        now = time.monotonic()
        since = [ep.down_since for ep in self._fleet.values()]
        if any(s is None for s in since):
            return None
        return now - max(s for s in since if s is not None)

    def _kw(self, extra_s: float = 0.0) -> dict[str, Any]:
        return {"timeout": self._timeout + extra_s, "metadata": self._metadata}

    def fetch(self, max_groups: int = 1, wait_ms: int = 1000, consumer: str = "") -> Lease | None:
        """Leases up to ``max_groups`` groups from whichever endpoint has some first, waiting up
        to ``wait_ms``; None when none had any (see the module docstring).

        A lease kept from an earlier call's fetch, still in flight then, comes first; it may
        hold up to that call's ``max_groups``. Raises the first error that retrying cannot cure
        (INVALID_ARGUMENT, UNAUTHENTICATED...); endpoints that are down are backed off from, and
        None is returned while they are (a restart), until every endpoint has been unavailable
        for ``outage_s``: then the last UNAVAILABLE is raised."""
        deadline = time.monotonic() + wait_ms / 1000
        sent: set[str] = set()
        while True:
            self._collect(block_until=None)
            if self._spare:
                return self._spare.popleft()
            now = time.monotonic()
            for ep in self._fleet.values():
                if not ep.in_flight and ep.retry_at <= now and ep.name not in sent:
                    sent.add(ep.name)
                    self._send(ep, max_groups, max(int((deadline - now) * 1000), 0), consumer)
            if now >= deadline:
                # what this call sent answers about now (its wait is over): take it in, no more
                while any(self._fleet[name].in_flight for name in sent):
                    self._collect(block_until=now + self._timeout)
                return self._spare.popleft() if self._spare else None
            probes = [
                ep.retry_at
                for ep in self._fleet.values()
                if ep.name not in sent and not ep.in_flight
            ]
            # an answer, the next endpoint due for a probe, or the deadline: whichever comes first
            self._collect(block_until=min([deadline, *probes]))

    def _send(self, ep: _Endpoint, max_groups: int, wait_ms: int, consumer: str) -> None:
        request = pb.FetchGroupsRequest(max_groups=max_groups, wait_ms=wait_ms, consumer=consumer)
        ep.in_flight = True
        ep.sent.append(time.monotonic())
        future = self._stubs[ep.name].FetchGroups.future(request, **self._kw(wait_ms / 1000))
        future.add_done_callback(lambda f: self._answers.put((ep, f)))

    def _collect(self, block_until: float | None) -> bool:
        """Takes in every completed fetch (waiting for one until ``block_until``, if given):
        leases go to the spares, failures back the endpoint off. True if any completed."""
        got = False
        while True:
            try:
                if block_until is None or got:
                    ep, future = self._answers.get_nowait()
                else:
                    ep, future = self._answers.get(timeout=max(block_until - time.monotonic(), 0))
            except queue.Empty:
                return got
            got = True
            ep.in_flight = False
            try:
                response: pb.FetchGroupsResponse = future.result()
            except grpc.RpcError as exc:
                code = exc.code()  # type: ignore[attr-defined]
                if code not in RETRYABLE:
                    raise
                if code is grpc.StatusCode.UNAVAILABLE and self._retries:
                    self._unavailable(ep, exc)
                    if (outage := self.outage_s) is not None and outage >= self._outage_s:
                        raise  # every endpoint, for longer than an outage may last
                ep.failures += 1
                pause = min(self._backoff * 2 ** (ep.failures - 1), self._max_backoff)
                ep.retry_at = time.monotonic() + pause * random.uniform(0.5, 1.5)
                log.debug("%s: %s; asked again in %.2fs at the earliest", ep.name, code.name, pause)
                continue
            ep.failures, ep.retry_at = 0, 0.0
            self._answered(ep)
            if response.lease_id:
                self._spare.append(
                    Lease(response.lease_id, ep.name, response.groups, response.lease_expires_at)
                )

    def ack(self, lease: Lease, trainer_step: int) -> pb.AckGroupsResponse:
        """Tells the endpoint that leased ``lease`` that trainer step ``trainer_step`` consumed
        its groups: durable when this returns, so they are not delivered again. Idempotent: an
        ack repeated (after a restart, say) gets the answer the first one got."""
        request = pb.AckGroupsRequest(lease_id=lease.lease_id, trainer_step=trainer_step)
        return self._call(lease.endpoint, lambda s: s.AckGroups(request, **self._kw()))

    def submit_prompts(self, prompts: Sequence[dict[str, Any]]) -> pb.SubmitPromptsResponse:
        """Prompts as dicts ``{prompt_id, text | messages, metadata, tools}``, spread over the
        endpoints."""
        n = len(self.endpoints)
        accepted = duplicates = 0
        for i, ep in enumerate(self.endpoints):
            share = [_prompt(p) for p in prompts[i::n]]
            if share:
                r: pb.SubmitPromptsResponse = self._call(
                    ep,
                    partial(_submit, request=pb.SubmitPromptsRequest(prompts=share), kw=self._kw()),
                )
                accepted, duplicates = accepted + r.accepted, duplicates + r.duplicates
        return pb.SubmitPromptsResponse(accepted=accepted, duplicates=duplicates)

    def checkpoint(
        self, trainer_step: int | None = None, tag: str = ""
    ) -> dict[str, pb.CheckpointResponse]:
        """Snapshots every endpoint; call when the trainer saves its checkpoint ``trainer_step``."""
        request = pb.CheckpointRequest(tag=tag)
        if trainer_step is not None:
            request.trainer_step = trainer_step
        return {
            ep: self._call(ep, lambda s: s.Checkpoint(request, **self._kw(60)))
            for ep in self.endpoints
        }

    def rewind(self, trainer_step: int) -> dict[str, pb.RewindResponse]:
        """Every endpoint makes the groups acked after ``trainer_step`` available again (or admits
        their prompts again): call it from a trainer restarted from its checkpoint
        ``trainer_step``, before fetching (docs/api.md, the delivery contract)."""
        request = pb.RewindRequest(trainer_step=trainer_step)
        return {
            ep: self._call(ep, lambda s: s.Rewind(request, **self._kw())) for ep in self.endpoints
        }

    def update_weights(
        self, version: int, weights_path: str, *, base_version: int | None = None
    ) -> dict[str, pb.UpdateWeightsResponse]:
        """Every endpoint loads ``weights_path`` (a directory or URL of safetensors files; with
        ``base_version``, a delta file from :func:`rolloutd.weights.delta.make_delta` that
        applies to that version) as policy ``version``."""
        request = pb.UpdateWeightsRequest(
            version=version, weights_path=weights_path, base_version=base_version
        )
        return {
            ep: self._call(ep, lambda s: s.UpdateWeights(request, **self._kw(600)))
            for ep in self.endpoints
        }

    def push_weights(
        self, version: int, directory: str | os.PathLike[str], *, chunk_mb: float = 1.0
    ) -> dict[str, pb.PushWeightsResponse]:
        """Streams the ``*.safetensors`` files of ``directory`` to every endpoint at once, each of
        which loads them as policy ``version``; returns each endpoint's answer.

        The files are hashed once, then sent to each endpoint from a memory map, ``chunk_mb`` MiB
        per message (see ``benchmarks/weights.py`` for the rates on loopback; ``chunk_mb`` must
        stay below the service's ``grpc.max_message_mb``). Raises the first endpoint's error
        (the others still finish their push).
        """
        return self._push(weights_header(version, directory), Path(directory), chunk_mb)

    def _push(
        self, header: pb.PushWeightsHeader, directory: Path, chunk_mb: float
    ) -> dict[str, pb.PushWeightsResponse]:
        chunk = int(chunk_mb * 2**20)

        def push(ep: str) -> pb.PushWeightsResponse:
            return self._call(
                ep,
                lambda _: self._push_calls[ep](
                    _push_requests(header, directory, chunk), **self._kw(600)
                ),
            )

        with ThreadPoolExecutor(len(self.endpoints), thread_name_prefix="push-weights") as pool:
            # Each push runs in the caller's context, so its span joins the trainer's trace.
            futures = {
                ep: pool.submit(contextvars.copy_context().run, push, ep) for ep in self.endpoints
            }
            return {ep: f.result() for ep, f in futures.items()}

    def push_delta(
        self,
        base_version: int,
        version: int,
        delta_file: str | os.PathLike[str],
        *,
        chunk_mb: float = 1.0,
    ) -> dict[str, pb.PushWeightsResponse]:
        """Streams a delta (a ``.delta`` file from :func:`rolloutd.weights.delta.make_delta`)
        to every endpoint, each of which must serve ``base_version`` (FAILED_PRECONDITION
        otherwise); each applies it, checks every resulting tensor, and serves ``version``."""
        path = Path(delta_file)
        header = pb.PushWeightsHeader(
            version=version,
            files=[pb.WeightsFile(name=path.name, size=path.stat().st_size, sha256=_sha256(path))],
            base_version=base_version,
        )
        return self._push(header, path.parent, chunk_mb)

    def status_of(self, endpoint: str) -> pb.GetStatusResponse:
        """One endpoint's status, without retries (for polling)."""
        return self._stubs[endpoint].GetStatus(pb.GetStatusRequest(), **self._kw())

    def status(self) -> dict[str, pb.GetStatusResponse]:
        """Every endpoint's ``GetStatus`` (state, buffer, counters, policy version), by
        endpoint."""
        return {
            ep: self._call(ep, lambda s: s.GetStatus(pb.GetStatusRequest(), **self._kw()))
            for ep in self.endpoints
        }


async def client_stream(
    method: grpc.aio.StreamUnaryMultiCallable,
    messages: Iterable[Any] | AsyncIterable[Any],
    **kwargs: Any,
) -> Any:
    """Runs a client-streaming call from ``grpc.aio`` code (``stub.PushWeights``), writing
    ``messages`` in order; returns the answer, or raises the status the server ended the call
    with. ``kwargs`` go to the call (``timeout``, ``metadata``).

    A server may answer before the stream ends: a push of a stale version is refused on its
    header while the client is still writing chunks. The write in flight then fails, and
    ``grpc.aio`` replaces the server's status by INTERNAL "Internal error from Core" whenever it
    handles that failure after the answer came (grpc/grpc#36066). Here the write in flight when
    the call ends is cancelled instead, which leaves the server's status in place.
    """
    call = method(**kwargs)
    step: asyncio.Future[None] | None = None
    cut = False

    def ended(_: object) -> None:
        nonlocal cut
        if step is not None and not step.done():
            cut = True
            step.cancel()

    call.add_done_callback(ended)
    try:
        async for message in _as_async(messages):
            if call.done():
                break
            step = asyncio.ensure_future(call.write(message))
            if not await _finished(step, lambda: cut):
                break
        else:
            step = asyncio.ensure_future(call.done_writing())
            await _finished(step, lambda: cut)
        return await call
    finally:
        call.cancel()  # a no-op once the call ended; a caller's cancellation reaches the server


async def _finished(step: asyncio.Future[None], cut: Callable[[], bool]) -> bool:
    """Awaits one write (or the half-close) of :func:`client_stream`: True if it went out,
    False if the call ended under it (the call's own status then tells why)."""
    try:
        await step
    except asyncio.CancelledError:
        task = asyncio.current_task()
        if not cut() or (task is not None and task.cancelling()):
            raise
        return False
    except (grpc.aio.AioRpcError, asyncio.InvalidStateError):
        return False
    return True


async def _as_async(messages: Iterable[Any] | AsyncIterable[Any]) -> AsyncIterator[Any]:
    if isinstance(messages, AsyncIterable):
        async for m in messages:
            yield m
    else:
        for m in messages:
            yield m


def _submit(
    stub: pb_grpc.RolloutServiceStub, request: pb.SubmitPromptsRequest, kw: dict[str, Any]
) -> Any:
    return stub.SubmitPrompts(request, **kw)


def weights_header(version: int, directory: str | os.PathLike[str]) -> pb.PushWeightsHeader:
    """The header of a push of every ``*.safetensors`` file in ``directory``, with checksums."""
    paths = sorted(Path(directory).glob("*.safetensors"))
    if not paths:
        raise ValueError(f"{directory} holds no *.safetensors files")
    return pb.PushWeightsHeader(
        version=version,
        files=[
            pb.WeightsFile(name=p.name, size=p.stat().st_size, sha256=_sha256(p)) for p in paths
        ],
    )


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb", buffering=0) as f:
        while block := f.read(8 * 2**20):
            h.update(block)
    return h.hexdigest()


def _push_requests(header: pb.PushWeightsHeader, directory: Path, chunk: int) -> Iterator[bytes]:
    """The encoded messages of a push: the header, then each file in order, ``chunk`` bytes at a
    time."""
    yield pb.PushWeightsRequest(header=header).SerializeToString()
    for f in header.files:
        if f.size == 0:
            continue  # nothing to map; the service checks the size
        with (
            (directory / f.name).open("rb") as src,
            mmap.mmap(src.fileno(), 0, access=mmap.ACCESS_READ) as mapped,
        ):
            view = memoryview(mapped)
            try:
                for offset in range(0, len(view), chunk):
                    data = view[offset : offset + chunk]
                    message = encode_chunk(f.name, offset, data)
                    data.release()
                    yield message
            finally:
                view.release()


def _prompt(p: dict[str, Any]) -> pb.Prompt:
    """Metadata travels as JSON text (``metadata_json``), so it comes back exactly; ``tools``
    (a list of tool schemas) as ``tools_json``."""
    metadata = p.get("metadata")
    tools = p.get("tools")
    return pb.Prompt(
        prompt_id=str(p["prompt_id"]),
        text=p.get("text", ""),
        metadata_json="" if metadata is None else json.dumps(metadata),
        tools_json=json.dumps(list(tools)) if tools else "",
        messages=[
            pb.ChatMessage(role=m["role"], content=m["content"]) for m in p.get("messages", ())
        ],
    )


def _channel_credentials(
    secure: bool, ca: str | None, cert: str | None, key: str | None
) -> grpc.ChannelCredentials | None:
    """None for plaintext; reads the PEM files once, so a missing one fails at construction."""
    if (cert is None) != (key is None):
        raise ValueError("tls_cert and tls_key must be given together")
    if not (secure or ca or cert):
        return None
    return grpc.ssl_channel_credentials(
        root_certificates=Path(ca).read_bytes() if ca else None,
        private_key=Path(key).read_bytes() if key else None,
        certificate_chain=Path(cert).read_bytes() if cert else None,
    )


def _default_interceptors() -> list[grpc.UnaryUnaryClientInterceptor]:
    """OpenTelemetry's client interceptor: a trainer's spans continue into the service."""
    from rolloutd.telemetry.interceptors import client_interceptors

    return client_interceptors()
