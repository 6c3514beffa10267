"""The gRPC servicer: authorize, decode, call the domain, encode.

Besides each RPC's decode and encode (through ``convert``) it holds the bearer-token check, the
readiness gate of mutating calls and the mapping of errors to status codes (``errors.STATUS``).

Readiness stops new work only: while not ready (failed checkpoints, a task that ended) and while
draining, leases, admissions and weight updates are refused with ``UNAVAILABLE``, but acks,
rewinds and on-demand checkpoints of work already handed out go on, since refusing an ack would
let its lease expire and its groups be delivered twice. Nothing is served before the service
has restored.
"""

from __future__ import annotations

import hmac
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from functools import wraps
from typing import Any, Protocol, TypeVar

import grpc

from rolloutd.api import convert, validation
from rolloutd.api.errors import MAPPED, status_of
from rolloutd.domain.controller import Controller
from rolloutd.domain.errors import InvalidArgument, Unavailable
from rolloutd.domain.lifecycle import ServingState
from rolloutd.domain.report import CheckpointReport
from rolloutd.domain.sampler import Admission
from rolloutd.telemetry.generation import link_generations
from rolloutd.v1 import rollout_pb2 as pb
from rolloutd.v1 import rollout_pb2_grpc as pb_grpc
from rolloutd.weights.receive import PushChunk, PushHeader
from rolloutd.weights.updater import WeightsUpdater

log = logging.getLogger(__name__)

MAX_PROMPTS_PER_SUBMIT = 10_000


class Host(Protocol):
    """What the servicer needs from the running service beyond the controller."""

    @property
    def state(self) -> ServingState: ...

    @property
    def engine_name(self) -> str: ...

    async def checkpoint(self, tag: str, trainer_step: int | None) -> CheckpointReport: ...

    def status_proto(self) -> pb.GetStatusResponse: ...


Req = TypeVar("Req")
Resp = TypeVar("Resp")
Handler = Callable[[Any, Req, grpc.aio.ServicerContext], Awaitable[Resp]]


SETTLING = (ServingState.SERVING, ServingState.NOT_READY, ServingState.DRAINING)
"""States in which work already handed out (acks, rewinds, checkpoints) is still accepted."""


def rpc(
    *, mutating: bool, new_work: bool = True
) -> Callable[[Handler[Req, Resp]], Handler[Req, Resp]]:
    """Authorizes mutating calls, refuses new work unless serving (and settling work unless
    restored, see the module docstring), maps domain and engine errors to status codes."""

    def decorate(handler: Handler[Req, Resp]) -> Handler[Req, Resp]:
        @wraps(handler)
        async def wrapper(
            self: RolloutServicer, request: Req, context: grpc.aio.ServicerContext
        ) -> Resp:
            if mutating and not self._authorized(context):
                # set, not abort, as below
                context.set_code(grpc.StatusCode.UNAUTHENTICATED)
                context.set_details("a valid bearer token is required")
                return None  # type: ignore[return-value]
            try:
                state = self._host.state
                if mutating and not (state.ready or (not new_work and state in SETTLING)):
                    raise Unavailable(f"the service is {state.value}; retry later")
                return await handler(self, request, context)
            except MAPPED as exc:
                # Set, not abort: an abort's exception keeps this call's frames, and with them
                # its request, in a cycle through gRPC's call state that the collector cannot
                # break, so each refused request (up to grpc.max_message_mb) stayed in memory.
                context.set_code(status_of(exc))
                context.set_details(str(exc))
                return None  # type: ignore[return-value]  # gRPC sends no message with an error

        return wrapper

    return decorate


class RolloutServicer(pb_grpc.RolloutServiceServicer):
    def __init__(
        self,
        controller: Controller,
        host: Host,
        auth_token: str | None = None,
        *,
        weights: WeightsUpdater,
        max_message_bytes: int = 64 << 20,
    ) -> None:
        self._controller = controller
        self._encoder = convert.GroupEncoder(max_message_bytes, controller.settings_of)
        self._host = host
        self._weights = weights
        self._token = auth_token.encode() if auth_token else None

    def _authorized(self, context: grpc.aio.ServicerContext) -> bool:
        if self._token is None:
            return True
        metadata = dict(context.invocation_metadata() or ())
        scheme, _, given = str(metadata.get("authorization", "")).partition(" ")
        # the scheme in any case (RFC 9110 11.1), as on the admin port
        return scheme.lower() == "bearer" and hmac.compare_digest(
            given.strip().encode(), self._token
        )

    @rpc(mutating=True)
    async def FetchGroups(
        self, request: pb.FetchGroupsRequest, context: grpc.aio.ServicerContext
    ) -> pb.FetchGroupsResponse:
        leased = await self._controller.fetch_encoded(
            request.max_groups, request.wait_ms, request.consumer, self._encoder
        )
        if leased is None:
            return pb.FetchGroupsResponse()
        lease, groups = leased
        link_generations(lambda: self._controller.generation_traces(lease.group_ids))
        return pb.FetchGroupsResponse(
            lease_id=lease.lease_id, groups=groups, lease_expires_at=lease.expires_at
        )

    @rpc(mutating=True, new_work=False)
    async def AckGroups(
        self, request: pb.AckGroupsRequest, context: grpc.aio.ServicerContext
    ) -> pb.AckGroupsResponse:
        result = await self._controller.ack(request.lease_id, request.trainer_step)
        return pb.AckGroupsResponse(
            acked_groups=result.acked_groups, already_acked=result.already_acked
        )

    @rpc(mutating=True)
    async def SubmitPrompts(
        self, request: pb.SubmitPromptsRequest, context: grpc.aio.ServicerContext
    ) -> pb.SubmitPromptsResponse:
        if not request.prompts:
            raise InvalidArgument("prompts", "must not be empty")
        if len(request.prompts) > MAX_PROMPTS_PER_SUBMIT:
            raise InvalidArgument("prompts", f"at most {MAX_PROMPTS_PER_SUBMIT} per call")
        max_metadata = self._controller.config.max_metadata_bytes
        admissions = [
            Admission(convert.prompt_from_proto(p, i, max_metadata), None)
            for i, p in enumerate(request.prompts)
        ]
        accepted, duplicates = await self._controller.submit(admissions)
        return pb.SubmitPromptsResponse(accepted=accepted, duplicates=duplicates)

    @rpc(mutating=True)
    async def UpdateWeights(
        self, request: pb.UpdateWeightsRequest, context: grpc.aio.ServicerContext
    ) -> pb.UpdateWeightsResponse:
        started = time.perf_counter()
        base = request.base_version if request.HasField("base_version") else None
        self._controller.check_version(request.version)
        result = await self._weights.update(request.version, request.weights_path, base)
        return pb.UpdateWeightsResponse(
            **convert.weights_update_fields(result, time.perf_counter() - started)
        )

    @rpc(mutating=True)
    async def PushWeights(
        self,
        request_iterator: AsyncIterator[pb.PushWeightsRequest | PushChunk],
        context: grpc.aio.ServicerContext,
    ) -> pb.PushWeightsResponse:
        started = time.perf_counter()
        result = await self._weights.push(self._checked(convert.push_messages(request_iterator)))
        return pb.PushWeightsResponse(
            **convert.weights_update_fields(result, time.perf_counter() - started)
        )

    async def _checked(
        self, messages: AsyncIterator[PushHeader | PushChunk]
    ) -> AsyncIterator[PushHeader | PushChunk]:
        """A push's messages, its header's version checked before any chunk is taken."""
        async for message in messages:
            if isinstance(message, PushHeader):
                self._controller.check_version(message.version)
            yield message

    @rpc(mutating=True, new_work=False)
    async def Checkpoint(
        self, request: pb.CheckpointRequest, context: grpc.aio.ServicerContext
    ) -> pb.CheckpointResponse:
        step = request.trainer_step if request.HasField("trainer_step") else None
        validation.checkpoint_request(request.tag, step)
        report = await self._host.checkpoint(request.tag, step)
        return convert.checkpoint_to_proto(report)

    @rpc(mutating=True, new_work=False)
    async def Rewind(
        self, request: pb.RewindRequest, context: grpc.aio.ServicerContext
    ) -> pb.RewindResponse:
        result = await self._controller.rewind(request.trainer_step)
        return pb.RewindResponse(
            redelivered_groups=result.redelivered_groups,
            readmitted_prompts=result.readmitted_prompts,
        )

    @rpc(mutating=False)
    async def GetStatus(
        self, request: pb.GetStatusRequest, context: grpc.aio.ServicerContext
    ) -> pb.GetStatusResponse:
        return self._host.status_proto()
