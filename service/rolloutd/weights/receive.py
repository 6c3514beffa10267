"""The receiving end of ``PushWeights``: a header, then chunks written into a staging directory.

What must hold: only declared files are written, each strictly in order (a chunk's offset is the
number of that file's bytes already received), never past its declared size; the stream is whole
only when every declared file is complete. Anything else is refused with the file it concerns.
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
    data: bytes


class PushReceiver:
    """Writes the chunks of one push into ``dest``; the files were checked by the caller."""

    def __init__(self, files: tuple[FileSpec, ...], dest: Path) -> None:
        self._specs = {f.name: f for f in files}
        self._received = dict.fromkeys(self._specs, 0)
        self._dest = dest
        self._fds: dict[str, int] = {}
        self.bytes = 0

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
        await asyncio.to_thread(os.pwrite, fd, chunk.data, chunk.offset)
        self._received[chunk.file] = end
        self.bytes += len(chunk.data)

    def finish(self) -> None:
        """The client closed its side: every declared file must be complete."""
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
