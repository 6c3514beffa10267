"""The wire encoding of a ``PushWeightsRequest`` that holds one ``WeightsChunk``, written by the
client and read by the service without protobuf, whose message would copy each chunk's bytes.

Protobuf copies a chunk's payload into its message and again into the encoding (or, parsing,
into the message and out of it as ``bytes``), on the process whose CPU bounds a push on a small
machine (see the weights section of ``benchmarks/README.md``). :func:`encode_chunk` copies the
payload once; :func:`decode_chunk` keeps it as a view of the received message.

What must hold: the bytes mean exactly what protobuf means by them (``tests/test_push_codec.py``
checks both directions against the generated message). The field numbers are the ``.proto``'s:
``chunk`` is field 2 of ``PushWeightsRequest``; ``file``, ``offset`` and ``data`` are fields 1, 2
and 3 of ``WeightsChunk``. :func:`decode_chunk` takes only the encoding every protobuf library
writes for a chunk (one ``chunk`` field holding ``file``, ``offset`` and ``data`` with one-byte
tags, any order, the last of a repeated field winning, as protobuf has it) and answers None for
anything else, malformed messages included, which the caller then gives to protobuf.

Standard library only: the client imports it without the service.
"""

from __future__ import annotations

_CHUNK = 0x12
"""``PushWeightsRequest.chunk``: field 2, length-delimited."""
_FILE = 0x0A
"""``WeightsChunk.file``: field 1, length-delimited."""
_OFFSET = 0x10
"""``WeightsChunk.offset``: field 2, varint."""
_DATA = 0x1A
"""``WeightsChunk.data``: field 3, length-delimited."""
_MAX_VARINT = 10
"""Bytes of the longest varint (a 64-bit value)."""


def encode_varint(n: int) -> bytes:
    """``n`` (from 0 below 2**64) as a protobuf varint: seven bits a byte, least significant
    first, the high bit set on every byte but the last."""
    out = bytearray()
    while n >= 0x80:
        out.append(n & 0x7F | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def decode_varint(raw: bytes, pos: int) -> tuple[int, int]:
    """The varint at ``pos`` and the position after it; one running past the end, or longer
    than 10 bytes, reads as ``len(raw) + 1``, a position every caller refuses."""
    value = 0
    for i, byte in enumerate(raw[pos : pos + _MAX_VARINT]):
        value |= (byte & 0x7F) << (7 * i)
        if byte < 0x80:
            return value, pos + i + 1
    return 0, len(raw) + 1


def encode_chunk(file: str, offset: int, data: bytes | memoryview) -> bytes:
    """A ``PushWeightsRequest`` holding one ``WeightsChunk``, encoded around ``data``, which is
    copied once. Every field is written, even one at its default (protobuf leaves those out):
    both mean the same message."""
    name = file.encode()
    fields = bytes([_FILE]) + encode_varint(len(name)) + name
    fields += bytes([_OFFSET]) + encode_varint(offset) + bytes([_DATA]) + encode_varint(len(data))
    return b"".join((bytes([_CHUNK]), encode_varint(len(fields) + len(data)), fields, data))


def decode_chunk(raw: bytes) -> tuple[str, int, memoryview] | None:
    """``(file, offset, data)`` of a message holding one chunk, ``data`` a view of ``raw``; None
    for any other message, which only protobuf reads as it should."""
    end = len(raw)
    if end < 2 or raw[0] != _CHUNK:
        return None
    length, pos = decode_varint(raw, 1)
    if pos + length != end:
        return None
    name, offset, data = "", 0, memoryview(raw)[end:]
    while pos < end:
        tag = raw[pos]
        if tag == _OFFSET:
            offset, pos = decode_varint(raw, pos + 1)
            continue
        if tag not in (_FILE, _DATA):
            return None
        size, pos = decode_varint(raw, pos + 1)
        if pos + size > end:
            return None
        if tag == _FILE:
            try:
                name = raw[pos : pos + size].decode()
            except UnicodeDecodeError:
                return None
        else:
            data = memoryview(raw)[pos : pos + size]
        pos += size
    return None if pos != end else (name, offset, data)
