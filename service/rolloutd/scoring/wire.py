"""The frames between the service and a verifier worker: a 4-byte big-endian length, then a
pickle. Both ends are the same Python and the same rolloutd, so pickle is safe here."""

from __future__ import annotations

import pickle
import struct
from dataclasses import dataclass
from typing import Any, BinaryIO

from rolloutd.scoring.inputs import ScoringInput

HEADER = struct.Struct(">I")
READY = b"ready"
"""What a worker sends once it has started, before its first answer."""


@dataclass(frozen=True)
class Call:
    """One call of a verifier: ``spec`` (an entry point) with one input, or a group verifier
    with the list of all siblings' inputs."""

    spec: str
    inputs: tuple[ScoringInput, ...]
    group: bool


def frame(value: Any) -> bytes:
    body = value if isinstance(value, bytes) else pickle.dumps(value, pickle.HIGHEST_PROTOCOL)
    return HEADER.pack(len(body)) + body


def read_frame(stream: BinaryIO) -> bytes | None:
    """The next frame's body from a blocking stream, or None at its end."""
    header = stream.read(HEADER.size)
    if len(header) < HEADER.size:
        return None
    (size,) = HEADER.unpack(header)
    return stream.read(size)
