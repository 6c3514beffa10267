"""The gRPC server: the rollout servicer, health, reflection and TLS on one port.

Health: the overall status ``""`` is liveness (SERVING while the process can recover by itself),
``rolloutd.v1.RolloutService`` is readiness (SERVING only while accepting work).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from rolloutd.api import convert
from rolloutd.api.reflection import enable_reflection
from rolloutd.api.servicer import Host, RolloutServicer
from rolloutd.api.startup_errors import PortUnavailable
from rolloutd.domain.controller import Controller
from rolloutd.domain.lifecycle import ServingState
from rolloutd.v1 import rollout_pb2 as pb
from rolloutd.v1 import rollout_pb2_grpc as pb_grpc
from rolloutd.weights.updater import WeightsUpdater

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["RolloutService"].full_name
_SERVING = health_pb2.HealthCheckResponse.SERVING
_NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


class GrpcServer:
    def __init__(
        self,
        controller: Controller,
        host: Host,
        *,
        address: str,
        max_message_mb: int,
        auth_token: str | None,
        tls_cert: str | None,
        tls_key: str | None,
        tls_client_ca: str | None,
        interceptors: Sequence[grpc.aio.ServerInterceptor],
        weights: WeightsUpdater,
    ) -> None:
        self._address = address
        self._health = health.aio.HealthServicer()
        self._credentials = (
            grpc.ssl_server_credentials(
                [(Path(tls_key).read_bytes(), Path(tls_cert).read_bytes())],
                root_certificates=Path(tls_client_ca).read_bytes() if tls_client_ca else None,
                require_client_auth=tls_client_ca is not None,
            )
            if tls_cert and tls_key
            else None
        )
        size = max_message_mb * 2**20
        self._server = grpc.aio.server(
            options=[
                ("grpc.max_receive_message_length", size),
                ("grpc.max_send_message_length", size),
                ("grpc.so_reuseport", 0),
            ],
            interceptors=interceptors,
        )
        servicer = RolloutServicer(
            controller, host, auth_token, weights=weights, max_message_bytes=size
        )
        pb_grpc.add_RolloutServiceServicer_to_server(servicer, self._server)
        # PushWeights again, with a deserializer that keeps chunk bytes uncopied (registered
        # handlers are looked up by method; the later registration of a method wins).
        self._server.add_registered_method_handlers(
            SERVICE_NAME,
            {
                "PushWeights": grpc.stream_unary_rpc_method_handler(
                    servicer.PushWeights,
                    request_deserializer=convert.push_request,
                    response_serializer=pb.PushWeightsResponse.SerializeToString,
                )
            },
        )
        health_pb2_grpc.add_HealthServicer_to_server(self._health, self._server)
        enable_reflection(
            (SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name),
            self._server,
        )
        self._started = False

    async def start(self) -> int:
        """Binds and serves; returns the port (port 0 picks a free one)."""
        try:
            if self._credentials is not None:
                port = self._server.add_secure_port(self._address, self._credentials)
            else:
                port = self._server.add_insecure_port(self._address)
        except RuntimeError as exc:  # grpc says only "Failed to bind to address ..."
            raise PortUnavailable(
                "gRPC", self._address, "--grpc-port", "grpc.port", "in use"
            ) from exc
        await self._server.start()
        self._started = True
        return port

    async def set_health(self, state: ServingState, *, alive: bool) -> None:
        await self._health.set(SERVICE_NAME, _SERVING if state.ready else _NOT_SERVING)
        await self._health.set("", _SERVING if alive else _NOT_SERVING)

    async def stop(self, grace_s: float) -> None:
        """Stops accepting RPCs; those in progress get ``grace_s`` to finish."""
        if self._started:
            await self._server.stop(grace_s)
