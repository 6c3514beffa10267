"""The receiving end of ``PushWeights``: a header, then chunks written into a staging directory.

What must hold: only declared files are written, each strictly in order (a chunk's offset is the
number of that file's bytes already received), never past its declared size; the stream is whole
only when every declared file is complete. Anything else is refused with the file it concerns.

Each chunk is written on a worker thread while the next one is received (one write in flight at
a time). Checksums are verified afterwards, file by file in parallel
(:func:`rolloutd.weights.staging.verify_files`): hashing each chunk on the receiving path made the
transfer hash-bound (about 500 MB/s against about 1,350 MB/s write-only for 134 MB pushed on the
2-core development machine), while the re-read after the stream ends comes from the page cache
and spreads over a sharded checkpoint's files.
"""

from __future__ import annotations

import asyncio
import os
from dataclasses import dataclass
from pathlib import Path

from rolloutd.weights.layout import WeightsRejected
from rolloutd.weights.staging import FileSpec


@dataclass(frozen=True)
class PushHeader:
    version: int
    files: tuple[FileSpec, ...]


@dataclass(frozen=True)
class PushChunk:
    file: str
    offset: int
    data: bytes | memoryview
    """A view of the received message where it can be (see ``rolloutd.api.convert``)."""


def _write(fd: int, data: bytes | memoryview, offset: int) -> None:
    written = os.pwrite(fd, data, offset)
    if written != len(data):
        raise OSError(f"short write: {written} of {len(data)} bytes at offset {offset}")


class PushReceiver:
    """Writes the chunks of one push into ``dest``; the files were checked by the caller.

    Call :meth:`settle` then :meth:`close` whatever happens, :meth:`finish` when the stream ended.
    """

    def __init__(self, files: tuple[FileSpec, ...], dest: Path) -> None:
        self._specs = {f.name: f for f in files}
        self._received = dict.fromkeys(self._specs, 0)
        self._dest = dest
        self._fds: dict[str, int] = {}
        self._pending: asyncio.Future[None] | None = None

    async def write(self, chunk: PushChunk) -> None:
        spec = self._specs.get(chunk.file)
        if spec is None:
            raise WeightsRejected(f"chunk for {chunk.file!r}", "that file was not declared")
        have = self._received[chunk.file]
        if chunk.offset != have:
            raise WeightsRejected(
                chunk.file,
                f"chunk at offset {chunk.offset}, expected {have} (chunks of a file must come "
                "in order, without gaps or overlaps)",
            )
        end = have + len(chunk.data)
        if end > spec.size:
            raise WeightsRejected(
                chunk.file, f"chunk ends at byte {end}, past the declared size {spec.size}"
            )
        fd = self._fds.get(chunk.file)
        if fd is None:
            fd = os.open(self._dest / chunk.file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            self._fds[chunk.file] = fd
        await self.settle()
        self._pending = asyncio.ensure_future(
            asyncio.to_thread(_write, fd, chunk.data, chunk.offset)
        )
        self._received[chunk.file] = end

    async def settle(self) -> None:
        """Waits for the write in flight (and raises its error)."""
        pending, self._pending = self._pending, None
        if pending is not None:
            await pending

    async def finish(self) -> None:
        """The client closed its side: every declared file must be complete."""
        await self.settle()
        for name, spec in self._specs.items():
            got = self._received[name]
            if got != spec.size:
                raise WeightsRejected(
                    name, f"the stream ended after {got} of its {spec.size} bytes (truncated)"
                )

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()
