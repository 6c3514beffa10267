"""Python trainer client: several endpoints, retries with backoff, W3C context propagation.

Fetches go round-robin over the endpoints (one rolloutd per GPU node); an ack goes back to the
endpoint that issued the lease. Calls that are safe to repeat (every RPC here: acks and prompt
submissions are idempotent) are retried on UNAVAILABLE, DEADLINE_EXCEEDED and RESOURCE_EXHAUSTED
with exponential backoff and jitter.
"""

from __future__ import annotations

import contextvars
import hashlib
import json
import logging
import mmap
import os
import random
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

import grpc

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


class RolloutClient:
    def __init__(
        self,
        endpoints: str | Sequence[str],
        *,
        token: str | None = None,
        timeout_s: float = 30.0,
        retries: int = 5,
        backoff_s: float = 0.2,
        max_backoff_s: float = 5.0,
        secure: bool = False,
        tls_ca: str | None = None,
        tls_cert: str | None = None,
        tls_key: str | None = None,
        interceptors: Iterable[grpc.UnaryUnaryClientInterceptor] | None = None,
    ) -> None:
        """``secure``: TLS, trusting the system's CA roots. ``tls_ca``: a PEM CA bundle to trust
        instead (implies TLS; for a private CA). ``tls_cert``/``tls_key``: a PEM client
        certificate and key, for a server that requires them (``grpc.tls_client_ca``)."""
        self.endpoints = [endpoints] if isinstance(endpoints, str) else list(endpoints)
        if not self.endpoints:
            raise ValueError("at least one endpoint is required")
        self._metadata = (("authorization", f"Bearer {token}"),) if token else ()
        self._timeout = timeout_s
        self._retries = retries
        self._backoff = backoff_s
        self._max_backoff = max_backoff_s
        self._next = 0
        if interceptors is None:
            interceptors = _default_interceptors()
        self._channels: dict[str, grpc.Channel] = {}
        self._stubs: dict[str, pb_grpc.RolloutServiceStub] = {}
        self._push_calls: dict[str, grpc.StreamUnaryMultiCallable] = {}
        credentials = _channel_credentials(secure, tls_ca, tls_cert, tls_key)
        for ep in self.endpoints:
            channel = (
                grpc.insecure_channel(ep)
                if credentials is None
                else grpc.secure_channel(ep, credentials)
            )
            channel = grpc.intercept_channel(channel, *interceptors)
            self._channels[ep] = channel
            self._stubs[ep] = pb_grpc.RolloutServiceStub(channel)
            # PushWeights sends messages it encoded itself (see _chunk_message).
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
        delay = self._backoff
        for attempt in range(self._retries + 1):
            try:
                return fn(self._stubs[endpoint])
            except grpc.RpcError as exc:
                code = exc.code()  # type: ignore[attr-defined]
                if code not in RETRYABLE or attempt == self._retries:
                    raise
                log.debug("%s: %s, retrying in %.2fs", endpoint, code.name, delay)
                time.sleep(delay * random.uniform(0.5, 1.5))
                delay = min(delay * 2, self._max_backoff)
        raise AssertionError("unreachable")

    def _kw(self, extra_s: float = 0.0) -> dict[str, Any]:
        return {"timeout": self._timeout + extra_s, "metadata": self._metadata}

    def fetch(self, max_groups: int = 1, wait_ms: int = 1000, consumer: str = "") -> Lease | None:
        """Leases up to ``max_groups`` groups from the next endpoint that has some."""
        request = pb.FetchGroupsRequest(max_groups=max_groups, wait_ms=wait_ms, consumer=consumer)
        n = len(self.endpoints)
        for i in range(n):
            ep = self.endpoints[(self._next + i) % n]
            # Only the last endpoint tried waits; the others are asked without waiting.
            req = (
                request
                if i == n - 1
                else pb.FetchGroupsRequest(max_groups=max_groups, consumer=consumer)
            )
            try:
                response: pb.FetchGroupsResponse = self._call(
                    ep, partial(_fetch, request=req, kw=self._kw(req.wait_ms / 1000))
                )
            except grpc.RpcError as exc:
                if exc.code() in RETRYABLE and i < n - 1:  # type: ignore[attr-defined]
                    continue
                raise
            if response.lease_id:
                self._next = (self._next + i + 1) % n
                return Lease(response.lease_id, ep, response.groups, response.lease_expires_at)
        self._next = (self._next + 1) % n
        return None

    def ack(self, lease: Lease, trainer_step: int) -> pb.AckGroupsResponse:
        request = pb.AckGroupsRequest(lease_id=lease.lease_id, trainer_step=trainer_step)
        return self._call(lease.endpoint, lambda s: s.AckGroups(request, **self._kw()))

    def submit_prompts(self, prompts: Sequence[dict[str, Any]]) -> pb.SubmitPromptsResponse:
        """Prompts as dicts ``{prompt_id, text | messages, metadata}``, spread over the endpoints."""
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
        request = pb.RewindRequest(trainer_step=trainer_step)
        return {
            ep: self._call(ep, lambda s: s.Rewind(request, **self._kw())) for ep in self.endpoints
        }

    def update_weights(
        self, version: int, weights_path: str
    ) -> dict[str, pb.UpdateWeightsResponse]:
        request = pb.UpdateWeightsRequest(version=version, weights_path=weights_path)
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
        header = weights_header(version, directory)
        chunk = int(chunk_mb * 2**20)

        def push(ep: str) -> pb.PushWeightsResponse:
            return self._call(
                ep,
                lambda _: self._push_calls[ep](
                    _push_requests(header, Path(directory), chunk), **self._kw(600)
                ),
            )

        with ThreadPoolExecutor(len(self.endpoints), thread_name_prefix="push-weights") as pool:
            # Each push runs in the caller's context, so its span joins the trainer's trace.
            futures = {
                ep: pool.submit(contextvars.copy_context().run, push, ep) for ep in self.endpoints
            }
            return {ep: f.result() for ep, f in futures.items()}

    def status_of(self, endpoint: str) -> pb.GetStatusResponse:
        """One endpoint's status, without retries (for polling)."""
        return self._stubs[endpoint].GetStatus(pb.GetStatusRequest(), **self._kw())

    def status(self) -> dict[str, pb.GetStatusResponse]:
        return {
            ep: self._call(ep, lambda s: s.GetStatus(pb.GetStatusRequest(), **self._kw()))
            for ep in self.endpoints
        }


def _fetch(
    stub: pb_grpc.RolloutServiceStub, request: pb.FetchGroupsRequest, kw: dict[str, Any]
) -> Any:
    return stub.FetchGroups(request, **kw)


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
        name = f.name.encode()
        with (
            (directory / f.name).open("rb") as src,
            mmap.mmap(src.fileno(), 0, access=mmap.ACCESS_READ) as mapped,
        ):
            view = memoryview(mapped)
            try:
                for offset in range(0, len(view), chunk):
                    data = view[offset : offset + chunk]
                    message = _chunk_message(name, offset, data)
                    data.release()
                    yield message
            finally:
                view.release()


def _chunk_message(name: bytes, offset: int, data: memoryview) -> bytes:
    """A ``PushWeightsRequest`` holding one ``WeightsChunk``, encoded around ``data``, which is
    copied once (protobuf copies it into the message, then again into the encoding)."""
    fields = b"\x0a" + _varint(len(name)) + name + b"\x10" + _varint(offset) + b"\x1a"
    fields += _varint(len(data))
    return b"".join((b"\x12", _varint(len(fields) + len(data)), fields, data))


def _varint(n: int) -> bytes:
    out = bytearray()
    while n >= 0x80:
        out.append(n & 0x7F | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _prompt(p: dict[str, Any]) -> pb.Prompt:
    """Metadata travels as JSON text (``metadata_json``), so it comes back exactly."""
    metadata = p.get("metadata")
    return pb.Prompt(
        prompt_id=str(p["prompt_id"]),
        text=p.get("text", ""),
        metadata_json="" if metadata is None else json.dumps(metadata),
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
