"""The push receiver's writer thread: chunks land byte for byte whatever the queue holds, the
loop waits while too much is queued, and a failed write is raised to the stream, not lost."""

from __future__ import annotations

import errno
import os
import resource
import signal
import subprocess
import sys
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


# The failing write runs in a child process: RLIMIT_FSIZE is per process, and in this one it would
# also fail pytest's own writes to a log file that is already larger than the limit.
FAILING_PUSH = """
import asyncio, os, sys
from pathlib import Path
from rolloutd.weights.receive import PushChunk, PushReceiver
from rolloutd.weights.staging import FileSpec

CHUNK = 4096

async def main(dest):
    data = os.urandom(8 * CHUNK)
    receiver = PushReceiver((FileSpec("a.safetensors", len(data)),), dest, max_pending=1)
    try:
        for offset in range(0, len(data), CHUNK):
            piece = memoryview(data)[offset : offset + CHUNK]
            await receiver.write(PushChunk("a.safetensors", offset, piece))
        await receiver.finish()
    except OSError as error:
        print("raised", type(error).__name__, error.errno)
        return
    finally:
        await receiver.close()
    print("no error")

asyncio.run(main(Path(sys.argv[1])))
"""


def limit_file_size() -> None:
    """Files of the child may not grow past 2 chunks: writes beyond fail (EFBIG) instead of the
    default SIGXFSZ killing it."""
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(
        resource.RLIMIT_FSIZE, (2 * CHUNK, resource.getrlimit(resource.RLIMIT_FSIZE)[1])
    )


def test_a_failed_write_is_raised_to_the_stream(tmp_path: Path):
    child = subprocess.run(
        [sys.executable, "-c", FAILING_PUSH, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
        preexec_fn=limit_file_size,
        check=False,
    )
    assert child.returncode == 0, child.stderr
    assert child.stdout.split() == ["raised", "OSError", str(errno.EFBIG)]
    assert (tmp_path / "a.safetensors").stat().st_size <= 2 * CHUNK
