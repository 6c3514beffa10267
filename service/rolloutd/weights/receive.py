"""The receiving end of ``PushWeights``: a header, then chunks written into a staging directory.

What must hold: only declared files are written, each strictly in order (a chunk's offset is the
number of that file's bytes already received), never past its declared size; the stream is whole
only when every declared file is complete. Anything else is refused with the file it concerns.

The event loop only checks a chunk and queues it; one writer thread per push writes the queued
chunks (``pwrite`` releases the GIL, so writing overlaps receiving on a second core). The loop
waits only while more than ``max_pending`` bytes are queued, so a stream never holds more than
that beyond what gRPC buffers. A thread hop per chunk (``asyncio.to_thread``, one write in flight)
cost the receive path a wake-up and a context switch each way per chunk: in a bare ``grpc.aio``
sink on the 2-core development machine, writing 222 MB from a queue ran at 1,500-1,780 MB/s
against 1,390-1,450 with a hop per chunk (see the weights section of ``benchmarks/README.md``).

Checksums are verified afterwards, file by file in parallel
(:func:`rolloutd.weights.staging.verify_files`): hashing each chunk on the receiving path made the
transfer hash-bound (about 500 MB/s against about 1,350 MB/s write-only for 134 MB pushed on the
2-core development machine), while the re-read after the stream ends comes from the page cache
and spreads over a sharded checkpoint's files.
"""

from __future__ import annotations

import asyncio
import os
import queue
import threading
from concurrent.futures import Executor
from dataclasses import dataclass
from pathlib import Path

from rolloutd.weights.layout import WeightsRejected
from rolloutd.weights.staging import FileSpec, disk_full

MAX_PENDING = 32 * 2**20
"""Bytes of received chunks a push may have queued for writing before the loop waits."""


@dataclass(frozen=True)
class PushHeader:
    version: int
    files: tuple[FileSpec, ...]
    base_version: int | None = None
    """Set for a delta: the version it applies to."""


@dataclass(frozen=True)
class PushChunk:
    file: str
    offset: int
    data: bytes | memoryview
    """A view of the received message where it can be (see ``rolloutd.push_codec``)."""


class _Writer:
    """One thread writing queued ``(fd, data, offset)`` in order; the first error stops it.

    ``pending`` is the number of queued bytes not yet written; the loop that queues is woken
    through ``room`` when it drops to ``max_pending`` or below, or when writing failed.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop, max_pending: int) -> None:
        self._loop = loop
        self._max_pending = max_pending
        self._queue: queue.SimpleQueue[tuple[int, bytes | memoryview, int] | None] = (
            queue.SimpleQueue()
        )
        self._lock = threading.Lock()
        self._pending = 0
        self._waiting = False
        self.room = asyncio.Event()
        self.error: OSError | None = None
        self._thread = threading.Thread(target=self._run, name="push-writer", daemon=True)
        self._thread.start()

    def put(self, fd: int, data: bytes | memoryview, offset: int) -> bool:
        """Queues a write; False when the caller must wait for ``room`` before the next one."""
        with self._lock:
            self._pending += len(data)
            full = self._pending > self._max_pending and self.error is None
            if full:
                self._waiting = True
                self.room.clear()
        self._queue.put((fd, data, offset))
        return not full

    def drained(self) -> bool:
        """True when nothing is left to write (or writing failed); otherwise ``room`` will be set
        when it is."""
        with self._lock:
            done = self._pending == 0 or self.error is not None
            if not done:
                self._max_pending = 0  # wake the loop only once everything is written
                self._waiting = True
                self.room.clear()
        return done

    def stop(self) -> None:
        """Ends the thread after what is queued (skipped once writing failed)."""
        self._queue.put(None)
        self._thread.join()

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            fd, data, offset = item
            if self.error is None:
                try:
                    _write(fd, data, offset)
                except OSError as exc:
                    self.error = exc
            with self._lock:
                self._pending -= len(data)
                wake = self._waiting and (
                    self._pending <= self._max_pending or self.error is not None
                )
                if wake:
                    self._waiting = False
            if wake:
                self._loop.call_soon_threadsafe(self.room.set)


def _write(fd: int, data: bytes | memoryview, offset: int) -> None:
    written = os.pwrite(fd, data, offset)
    if written != len(data):
        raise OSError(f"short write: {written} of {len(data)} bytes at offset {offset}")


class PushReceiver:
    """Writes the chunks of one push into ``dest``; the files were checked by the caller.

    Call :meth:`close` whatever happens (it waits for the writer thread), :meth:`finish` when
    the stream ended.
    """

    def __init__(
        self,
        files: tuple[FileSpec, ...],
        dest: Path,
        *,
        max_pending: int = MAX_PENDING,
        executor: Executor | None = None,
    ) -> None:
        """``executor``: where :meth:`close` waits for the writer (not the loop's default one,
        which the data plane uses, when given)."""
        self._executor = executor
        self._specs = {f.name: f for f in files}
        self._received = dict.fromkeys(self._specs, 0)
        self._dest = dest
        self._fds: dict[str, int] = {}
        self._writer = _Writer(asyncio.get_running_loop(), max_pending)

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
        self._raise_write_error()
        fd = self._fds.get(chunk.file)
        if fd is None:
            fd = os.open(self._dest / chunk.file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            self._fds[chunk.file] = fd
        self._received[chunk.file] = end
        if not self._writer.put(fd, chunk.data, chunk.offset):
            await self._writer.room.wait()

    async def finish(self) -> None:
        """The client closed its side: every declared file must be complete and written."""
        for name, spec in self._specs.items():
            got = self._received[name]
            if got != spec.size:
                raise WeightsRejected(
                    name, f"the stream ended after {got} of its {spec.size} bytes (truncated)"
                )
        if not self._writer.drained():
            await self._writer.room.wait()
        self._raise_write_error()

    async def close(self) -> None:
        """Stops the writer (after its queue, or at once if it failed) and closes the files."""
        await asyncio.get_running_loop().run_in_executor(self._executor, self._writer.stop)
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()

    def _raise_write_error(self) -> None:
        """A full disk is RESOURCE_EXHAUSTED; other write errors are the service's."""
        error = self._writer.error
        if error is None:
            return
        if (full := disk_full(error)) is not None:
            raise full from error
        raise error
