"""The trainer client against servers that answer a client-streaming call before it ends.

A server refuses a push on its header (a stale version) while the client is still writing chunks;
the client must report the server's status, whichever of the write and the answer it sees first.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
import pytest

from rolloutd.client import RolloutClient, client_stream
from rolloutd.v1 import rollout_pb2 as pb
from rolloutd.v1 import rollout_pb2_grpc as pb_grpc

REFUSAL = "version: must be greater than the current policy version 0"
BIG = 16 * 2**20
"""Chunks this large keep the client writing well after the server answered."""


async def refuse_after_the_first_message(requests, context: grpc.aio.ServicerContext) -> bytes:
    async for _ in requests:
        break
    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, REFUSAL)
    raise AssertionError("unreachable")


@pytest.fixture
async def refusing_server():
    """The address of a server whose PushWeights reads the header and refuses the push."""
    server = grpc.aio.server(options=[("grpc.max_receive_message_length", 2 * BIG)])
    handler = grpc.stream_unary_rpc_method_handler(refuse_after_the_first_message)
    server.add_generic_rpc_handlers(
        [
            grpc.method_handlers_generic_handler(
                "rolloutd.v1.RolloutService", {"PushWeights": handler}
            )
        ]
    )
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    yield f"127.0.0.1:{port}"
    await server.stop(None)


def push(chunks: int) -> list[pb.PushWeightsRequest]:
    header = pb.PushWeightsHeader(version=0, files=[pb.WeightsFile(name="m.safetensors", size=1)])
    chunk = pb.WeightsChunk(file="m.safetensors", offset=0, data=b"\0" * BIG)
    return [pb.PushWeightsRequest(header=header)] + [pb.PushWeightsRequest(chunk=chunk)] * chunks


async def test_an_async_push_refused_mid_stream_reports_the_servers_status(refusing_server):
    """Each push ends with the server's answer arriving while a chunk is being written; plain
    ``grpc.aio`` turns most of these into INTERNAL (grpc/grpc#36066)."""
    messages = push(chunks=3)
    async with grpc.aio.insecure_channel(refusing_server) as channel:
        stub = pb_grpc.RolloutServiceStub(channel)
        for _ in range(10):
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await client_stream(stub.PushWeights, messages)
            assert (info.value.code(), info.value.details()) == (
                grpc.StatusCode.INVALID_ARGUMENT,
                REFUSAL,
            )


async def test_a_push_refused_mid_stream_reports_the_servers_status(refusing_server, tmp_path):
    weights = tmp_path / "weights"
    weights.mkdir()
    with (weights / "model.safetensors").open("wb") as f:
        f.truncate(4 * BIG)
    with RolloutClient(refusing_server, retries=0, interceptors=[]) as client:
        for _ in range(3):
            with pytest.raises(grpc.RpcError) as info:
                await asyncio.to_thread(client.push_weights, 1, Path(weights), chunk_mb=BIG / 2**20)
            code, details = info.value.code(), info.value.details()  # type: ignore[attr-defined]
            assert (code, details) == (grpc.StatusCode.INVALID_ARGUMENT, REFUSAL)
