"""The push receiver's writer thread: chunks land byte for byte whatever the queue holds, the
loop waits while too much is queued, and a failed write is raised to the stream, not lost."""

from __future__ import annotations

import os
import resource
import signal
from pathlib import Path

import pytest

from rolloutd.weights.receive import PushChunk, PushReceiver
from rolloutd.weights.staging import FileSpec

CHUNK = 4096


def pieces(name: str, data: bytes) -> list[PushChunk]:
    return [
        PushChunk(name, offset, memoryview(data)[offset : offset + CHUNK])
        for offset in range(0, len(data), CHUNK)
    ]


@pytest.mark.parametrize("max_pending", [1, 3 * CHUNK, 2**30], ids=["each", "some", "all"])
async def test_interleaved_chunks_are_written_byte_for_byte(tmp_path: Path, max_pending: int):
    files = {"a.safetensors": os.urandom(40 * CHUNK + 7), "b.safetensors": os.urandom(9 * CHUNK)}
    specs = tuple(FileSpec(n, len(d)) for n, d in files.items())
    a, b = (pieces(n, d) for n, d in files.items())
    receiver = PushReceiver(specs, tmp_path, max_pending=max_pending)
    try:
        for chunk in [c for pair in zip(a, b, strict=False) for c in pair] + a[len(b) :]:
            await receiver.write(chunk)
        await receiver.finish()
        # finish() returns once everything is on the page cache, before the files are closed.
        for name, data in files.items():
            assert (tmp_path / name).read_bytes() == data
    finally:
        await receiver.close()


@pytest.fixture
def file_size_limit():
    """Files of this process may not grow past 2 chunks: writes beyond fail (EFBIG) instead of
    the default SIGXFSZ killing the process."""
    limits = resource.getrlimit(resource.RLIMIT_FSIZE)
    handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (2 * CHUNK, limits[1]))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, limits)
        signal.signal(signal.SIGXFSZ, handler)


async def test_a_failed_write_is_raised_to_the_stream(tmp_path: Path, file_size_limit):
    data = os.urandom(8 * CHUNK)
    receiver = PushReceiver((FileSpec("a.safetensors", len(data)),), tmp_path, max_pending=1)
    try:
        with pytest.raises(OSError):
            for chunk in pieces("a.safetensors", data):
                await receiver.write(chunk)
            await receiver.finish()
    finally:
        await receiver.close()
    assert (tmp_path / "a.safetensors").stat().st_size <= 2 * CHUNK
