"""gRPC server reflection under both names clients use: ``grpc.reflection.v1`` (what current
grpcurl, Postman and grpcui ask first) and ``grpc.reflection.v1alpha`` (older clients).

grpcio-reflection ships v1alpha only; v1 has the same messages, so the same servicer answers
on both paths. The Python stubs' descriptors carry no comments; the API's own file is served
from ``rollout_source.binpb`` (written by scripts/gen_proto.py with source info) instead, so
``grpcurl describe`` shows the documentation of the ``.proto``.
"""

from __future__ import annotations

from collections.abc import AsyncIterable, AsyncIterator, Iterable
from importlib import resources
from typing import Any

import grpc
from google.protobuf.descriptor_pb2 import (
    FileDescriptorProto,
    FileDescriptorSet,
    SourceCodeInfo,
)
from grpc_reflection.v1alpha import reflection
from grpc_reflection.v1alpha import reflection_pb2 as messages

V1_SERVICE_NAME = "grpc.reflection.v1.ServerReflection"


def _source_info() -> dict[str, SourceCodeInfo]:
    raw = resources.files("rolloutd.v1").joinpath("rollout_source.binpb").read_bytes()
    return {f.name: f.source_code_info for f in FileDescriptorSet.FromString(raw).file}


class _DocumentedReflection:
    """The stock servicer, with the comments (source info) added to the descriptors of the API's
    own file; everything else is what the stock servicer sends.

    It wraps the stock servicer's one public method, the RPC itself, so no private method of
    grpcio-reflection is overridden: every response that carries files passes through
    :meth:`_documented` on its way out."""

    def __init__(self, service_names: Iterable[str]) -> None:
        self._stock = reflection.aio.ReflectionServicer(service_names)
        self._source_info = _source_info()

    async def ServerReflectionInfo(
        self, request_iterator: AsyncIterable[Any], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[Any]:
        async for response in self._stock.ServerReflectionInfo(request_iterator, context):
            yield self._documented(response)

    def _documented(self, response: Any) -> Any:
        if response.HasField("file_descriptor_response"):
            files = response.file_descriptor_response.file_descriptor_proto
            for i, raw in enumerate(files):
                proto = FileDescriptorProto.FromString(raw)
                if proto.name in self._source_info:
                    proto.source_code_info.CopyFrom(self._source_info[proto.name])
                    files[i] = proto.SerializeToString()
        return response


def enable_reflection(service_names: Iterable[str], server: grpc.aio.Server) -> None:
    """Reflection of ``service_names`` (and of reflection itself, under both names)."""
    names = (*service_names, reflection.SERVICE_NAME, V1_SERVICE_NAME)
    servicer = _DocumentedReflection(names)
    server.add_generic_rpc_handlers(
        (
            grpc.method_handlers_generic_handler(
                reflection.SERVICE_NAME,
                {"ServerReflectionInfo": _handler(servicer)},
            ),
            grpc.method_handlers_generic_handler(
                V1_SERVICE_NAME, {"ServerReflectionInfo": _handler(servicer)}
            ),
        )
    )


def _handler(servicer: _DocumentedReflection) -> grpc.RpcMethodHandler:
    return grpc.stream_stream_rpc_method_handler(
        servicer.ServerReflectionInfo,
        request_deserializer=messages.ServerReflectionRequest.FromString,
        response_serializer=messages.ServerReflectionResponse.SerializeToString,
    )
