"""PushWeights' request deserializer (``convert.push_request``): a chunk is read straight off the
wire by the codec the client encodes with (``rolloutd.push_codec``, tested against protobuf in
``tests/test_push_codec.py``), and anything the codec does not take comes out as protobuf parses
it, or is refused as protobuf refuses it.
"""

from __future__ import annotations

import pytest
from google.protobuf.message import DecodeError

from rolloutd.api.convert import push_request
from rolloutd.push_codec import encode_chunk
from rolloutd.v1 import rollout_pb2 as pb
from rolloutd.weights.receive import PushChunk

CHUNKS = [
    pb.WeightsChunk(file="model.safetensors", offset=0, data=b"\x00\x01" * 40),
    pb.WeightsChunk(file="model-00002-of-00002.safetensors", offset=2**40 + 3, data=b"x"),
    pb.WeightsChunk(file="model.safetensors", offset=300, data=bytes(range(256)) * 700),
    pb.WeightsChunk(file="model.safetensors", offset=5, data=b""),
    pb.WeightsChunk(file="modèle.safetensors", offset=127, data=b"\x80"),
]


def as_proto(decoded: pb.PushWeightsRequest | PushChunk) -> pb.PushWeightsRequest:
    if isinstance(decoded, PushChunk):
        chunk = pb.WeightsChunk(file=decoded.file, offset=decoded.offset, data=bytes(decoded.data))
        return pb.PushWeightsRequest(chunk=chunk)
    return decoded


@pytest.mark.parametrize("chunk", CHUNKS, ids=range(len(CHUNKS)))
def test_a_chunk_is_read_off_the_wire_without_copying_its_bytes(chunk):
    raw = pb.PushWeightsRequest(chunk=chunk).SerializeToString()
    decoded = push_request(raw)
    assert isinstance(decoded, PushChunk)
    assert (decoded.file, decoded.offset, bytes(decoded.data)) == (
        chunk.file,
        chunk.offset,
        chunk.data,
    )
    assert isinstance(decoded.data, memoryview) and decoded.data.obj is raw


@pytest.mark.parametrize("chunk", CHUNKS, ids=range(len(CHUNKS)))
def test_the_clients_chunks_are_read_off_the_wire(chunk):
    raw = encode_chunk(chunk.file, chunk.offset, memoryview(chunk.data))
    assert push_request(raw) == PushChunk(chunk.file, chunk.offset, memoryview(chunk.data))


def _field(tag: int, payload: bytes) -> bytes:
    assert len(payload) < 128
    return bytes([tag, len(payload)]) + payload


UNUSUAL = {
    # Fields in another order, a repeated field (the last one wins), an unknown field.
    "reordered": _field(0x1A, b"data") + b"\x10\x07" + _field(0x0A, b"a.safetensors"),
    "repeated": _field(0x0A, b"a.safetensors") + _field(0x0A, b"b.safetensors") + b"\x10\x01",
    "unknown field": _field(0x0A, b"a.safetensors") + b"\x20\x05" + _field(0x1A, b"d"),
}


@pytest.mark.parametrize("inner", UNUSUAL.values(), ids=UNUSUAL.keys())
def test_any_other_encoding_means_what_protobuf_says(inner):
    raw = _field(0x12, inner)
    assert as_proto(push_request(raw)) == pb.PushWeightsRequest.FromString(raw)


def test_a_header_and_two_messages_in_one_are_protobufs():
    head = pb.PushWeightsRequest(header=pb.PushWeightsHeader(version=3))
    raw = head.SerializeToString()
    assert push_request(raw) == head
    # A chunk then a header in one message: protobuf keeps the last member of the oneof.
    both = pb.PushWeightsRequest(chunk=CHUNKS[0]).SerializeToString() + raw
    assert push_request(both) == head


MALFORMED = {
    "length past the end": b"\x12\x10\x0a\x01a",
    "data past the end": b"\x12\x04\x1a\x09abc",
    "endless varint": b"\x12\x0c\x10" + b"\xff" * 11,
    "not UTF-8": _field(0x12, _field(0x0A, b"\xff\xfe")),
}


@pytest.mark.parametrize("raw", MALFORMED.values(), ids=MALFORMED.keys())
def test_a_malformed_message_is_refused_by_protobuf(raw):
    with pytest.raises(DecodeError):
        push_request(raw)
