"""The wire codec of pushed chunks (rolloutd.push_codec) against protobuf's own encoding: what the
client writes is byte for byte what protobuf writes for the same fields, what protobuf writes
decodes to those fields, and a round trip gives back every field exactly.

``hypothesis`` is not among the test dependencies, so the cases are drawn from a seeded
``random.Random`` (the same cases every run), beside the edges picked by hand.
"""

from __future__ import annotations

import random

import pytest

from rolloutd.push_codec import decode_chunk, decode_varint, encode_chunk, encode_varint
from rolloutd.v1 import rollout_pb2 as pb

EDGE_VALUES = [0, 1, 127, 128, 255, 300, 2**14 - 1, 2**14, 2**21, 2**32, 2**35, 2**63, 2**64 - 1]
"""Each varint width's first and last value, and the largest uint64."""


def _name(rng: random.Random) -> str:
    alphabet = "abcxyz-_.0123456789èß雪🙂"
    return "".join(rng.choice(alphabet) for _ in range(rng.randrange(0, 70)))


def _cases(count: int, *, seed: int) -> list[tuple[str, int, bytes]]:
    rng = random.Random(seed)
    cases = []
    for _ in range(count):
        offset = rng.choice([rng.randrange(2 ** rng.randrange(1, 65)), rng.choice(EDGE_VALUES)])
        size = rng.choice([0, 1, rng.randrange(2, 200), rng.randrange(2**14 - 2, 2**14 + 2)])
        cases.append((_name(rng), offset, rng.randbytes(size)))
    return cases


CASES = [
    ("model.safetensors", 0, b"\x00\x01" * 40),
    ("model-00002-of-00002.safetensors", 2**40 + 3, b"x"),
    ("model.safetensors", 300, bytes(range(256)) * 700),
    ("model.safetensors", 5, b""),
    ("modèle.safetensors", 127, b"\x80"),
    ("", 0, b""),
    ("a", 2**64 - 1, b"\xff" * 2**21),
    *_cases(400, seed=0),
]


def _message(file: str, offset: int, data: bytes) -> pb.PushWeightsRequest:
    return pb.PushWeightsRequest(chunk=pb.WeightsChunk(file=file, offset=offset, data=data))


@pytest.mark.parametrize("value", EDGE_VALUES)
def test_a_varint_is_protobufs_and_round_trips(value):
    encoded = encode_varint(value)
    if value:  # protobuf leaves a field at its default out
        assert pb.WeightsChunk(offset=value).SerializeToString() == b"\x10" + encoded
    assert decode_varint(b"\x99" + encoded + b"\x01", 1) == (value, 1 + len(encoded))


@pytest.mark.parametrize(
    "raw", [b"", b"\x80", b"\xff\xff", b"\xff" * 11], ids=["empty", "cut", "cut long", "too long"]
)
def test_a_varint_that_does_not_end_in_time_reads_past_the_end(raw):
    assert decode_varint(raw, 0) == (0, len(raw) + 1)


def test_every_case_round_trips_with_its_bytes_a_view_of_the_message():
    for file, offset, data in CASES:
        raw = encode_chunk(file, offset, memoryview(data))
        decoded = decode_chunk(raw)
        assert decoded is not None, (file, offset, len(data))
        assert (decoded[0], decoded[1], bytes(decoded[2])) == (file, offset, data)
        assert decoded[2].obj is raw


def test_the_encoding_is_protobufs_byte_for_byte():
    """Protobuf leaves out a field at its default, which the codec writes: such a case is the
    same message, not the same bytes."""
    for file, offset, data in CASES:
        raw = encode_chunk(file, offset, data)
        message = _message(file, offset, data)
        assert pb.PushWeightsRequest.FromString(raw) == message, (file, offset, len(data))
        if file and offset and data:
            assert raw == message.SerializeToString(), (file, offset, len(data))


def test_protobufs_encoding_decodes_to_the_same_fields():
    for file, offset, data in CASES:
        decoded = decode_chunk(_message(file, offset, data).SerializeToString())
        assert decoded is not None, (file, offset, len(data))
        assert (decoded[0], decoded[1], bytes(decoded[2])) == (file, offset, data)


def _field(tag: int, payload: bytes) -> bytes:
    assert len(payload) < 128
    return bytes([tag, len(payload)]) + payload


UNUSUAL = {
    # Fields in another order, a repeated field (the last one wins).
    "reordered": _field(0x1A, b"data") + b"\x10\x07" + _field(0x0A, b"a.safetensors"),
    "repeated": _field(0x0A, b"a.safetensors") + _field(0x0A, b"b.safetensors") + b"\x10\x01",
}


@pytest.mark.parametrize("inner", UNUSUAL.values(), ids=UNUSUAL.keys())
def test_another_order_or_a_repeated_field_means_what_protobuf_says(inner):
    raw = _field(0x12, inner)
    decoded = decode_chunk(raw)
    assert decoded is not None
    assert _message(decoded[0], decoded[1], bytes(decoded[2])) == pb.PushWeightsRequest.FromString(
        raw
    )


NOT_A_CHUNK = {
    "a header": pb.PushWeightsRequest(header=pb.PushWeightsHeader(version=3)).SerializeToString(),
    "a chunk then a header": _message("a", 1, b"d").SerializeToString()
    + pb.PushWeightsRequest(header=pb.PushWeightsHeader(version=3)).SerializeToString(),
    "an unknown field": _field(0x12, _field(0x0A, b"a.safetensors") + b"\x20\x05"),
    "length past the end": b"\x12\x10\x0a\x01a",
    "data past the end": b"\x12\x04\x1a\x09abc",
    "endless varint": b"\x12\x0c\x10" + b"\xff" * 11,
    "not UTF-8": _field(0x12, _field(0x0A, b"\xff\xfe")),
}


@pytest.mark.parametrize("raw", NOT_A_CHUNK.values(), ids=NOT_A_CHUNK.keys())
def test_anything_else_is_left_to_protobuf(raw):
    assert decode_chunk(raw) is None
