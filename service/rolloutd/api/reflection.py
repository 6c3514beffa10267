"""gRPC server reflection under both names clients use: ``grpc.reflection.v1`` (what current
grpcurl, Postman and grpcui ask first) and ``grpc.reflection.v1alpha`` (older clients).

grpcio-reflection ships v1alpha only; v1 has the same messages, so the same servicer answers
on both paths.
"""

from __future__ import annotations

from collections.abc import Iterable

import grpc
from grpc_reflection.v1alpha import reflection
from grpc_reflection.v1alpha import reflection_pb2 as messages

V1_SERVICE_NAME = "grpc.reflection.v1.ServerReflection"


def enable_reflection(service_names: Iterable[str], server: grpc.aio.Server) -> None:
    """Reflection of ``service_names`` (and of reflection itself, under both names)."""
    names = (*service_names, reflection.SERVICE_NAME, V1_SERVICE_NAME)
    reflection.enable_server_reflection(names, server)
    servicer = reflection.aio.ReflectionServicer(names)
    handler = grpc.stream_stream_rpc_method_handler(
        servicer.ServerReflectionInfo,
        request_deserializer=messages.ServerReflectionRequest.FromString,
        response_serializer=messages.ServerReflectionResponse.SerializeToString,
    )
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(V1_SERVICE_NAME, {"ServerReflectionInfo": handler}),)
    )
