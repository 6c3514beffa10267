"""Verifying a snapshot's files: sizes, checksums, and the threads that check large files fast.

A restore verifies every byte it reads, and a file that exists but does not verify raises
:class:`CorruptSnapshot`. :class:`Verifier` is the first of the store's jobs (reader.py,
resolver.py, writer.py and retention.py build on it; store.py composes them).
"""

from __future__ import annotations

import builtins
import functools
import os
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor

import pyarrow as pa

from rolloutd.checkpoint import segments
from rolloutd.checkpoint.backends import CorruptSnapshot, LocalBackend, ObjectBackend, nothing
from rolloutd.checkpoint.checksums import (
    Hasher,
    arrival_for,
    checksum_algorithm,
    checksum_parts,
    checksum_started,
)
from rolloutd.checkpoint.manifest import FileEntry, Manifest, SegmentEntry
from rolloutd.checkpoint.rows import SegmentKind
from rolloutd.checkpoint.segments import Started

_VERIFY_THREADS = min(os.cpu_count() or 1, 4)
_VERIFY_PART = 64 << 20
"""At restore, a file is checksummed in parts of at least this size, each on its own thread: a
restore verifies every byte it reads, and one core checksumming a cold memory-mapped file
(faulting its pages in as it goes) ran slower than the disk's sequential read here."""


@functools.cache
def _verifiers() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(_VERIFY_THREADS, thread_name_prefix="rolloutd-verify")


class Verifier:
    """Checks files of a store against what their manifest says of them."""

    backend: LocalBackend | ObjectBackend

    def _size_problem(self, entry: FileEntry) -> str | None:
        try:
            size = self.backend.size(entry.path)
        except FileNotFoundError:
            return f"{entry.path}: missing"
        if size != entry.size:
            kind = "truncated" if size < entry.size else "longer than recorded"
            return f"{entry.path}: {size} bytes, manifest says {entry.size} ({kind})"
        return None

    @staticmethod
    def _checksum_problem(entry: FileEntry, chunks: Iterable[memoryview]) -> str | None:
        hasher = Hasher(checksum_algorithm(entry.checksum))
        for chunk in chunks:
            hasher.update(chunk)
        if hasher.value != entry.checksum:
            return f"{entry.path}: checksum {hasher.value}, manifest says {entry.checksum}"
        return None

    def check_sizes(self, manifest: Manifest, *, partials: bool = True) -> builtins.list[str]:
        """Problems found by comparing each file's size only (cheap: no file is read); with
        ``partials=False`` the partials file is left out (a restore that finds it damaged loses
        only the tokens it held, see ``restore._partials``)."""
        files = manifest.files()
        if not partials and manifest.partials is not None:
            files = tuple(f for f in files if f != manifest.partials)
        return [p for p in map(self._size_problem, files) if p is not None]

    def verify_file(self, entry: FileEntry) -> builtins.list[str]:
        """Problems with one file: missing, wrong size or wrong checksum; [] when it verifies."""
        problem = self._size_problem(entry) or self._checksum_problem(
            entry, self.backend.chunks(entry.path)
        )
        return [problem] if problem else []

    def read_verified(
        self, entry: FileEntry, threads: int = 1, buffer: pa.Buffer | None = None
    ) -> pa.Buffer:
        """``entry``'s bytes (``buffer`` when already read), checked against the manifest."""
        buffer = self.backend.read(entry.path) if buffer is None else buffer
        if buffer.size != entry.size:
            raise CorruptSnapshot(-1, [f"{entry.path}: {buffer.size} bytes, expected {entry.size}"])
        parts = min(threads, -(-buffer.size // _VERIFY_PART))
        value = checksum_parts(
            memoryview(buffer).cast("B"),  # type: ignore[arg-type]
            checksum_algorithm(entry.checksum),
            parts,
            _verifiers(),
        )
        if value != entry.checksum:
            problem = f"{entry.path}: checksum {value}, manifest says {entry.checksum}"
            raise CorruptSnapshot(-1, [problem])
        return buffer

    def open_segment(
        self,
        segment: SegmentEntry,
        kind: SegmentKind = SegmentKind.SAMPLES,
        *,
        threads: int = 1,
        buffer: pa.Buffer | None = None,
    ) -> pa.ipc.RecordBatchFileReader:
        """A segment's reader over its verified bytes; :class:`CorruptSnapshot` if they differ.
        ``threads`` checksum it at once: a restore, which has the machine to itself, uses
        several; compaction, which runs beside the service's event loop, one."""
        verified = self.read_verified(segment.file, threads, buffer)
        return segments.open_reader(verified, segment, kind)

    def _start(self, entry: FileEntry) -> Started:
        """Maps ``entry`` and starts its checksum on the verify threads, in parts of at least
        :data:`_VERIFY_PART`, each read front to back (see :class:`Arrival`).

        A file checksummed in one part is mapped to be read in order (``read_in_order``: 30 ms
        for 64 MB here, where asking for all of it ahead took 35 ms); one in several parts is
        asked for all at once (``read``), since parts read in order from several offsets at
        once restored the 1.6 GB full run in ~730 ms against ~520 ms."""
        parts = min(_VERIFY_THREADS, -(-entry.size // _VERIFY_PART))
        if parts > 1:
            buffer, read = self.backend.read(entry.path), nothing
        else:
            buffer, read = self.backend.read_in_order(entry.path)
        if buffer.size != entry.size:
            raise CorruptSnapshot(-1, [f"{entry.path}: {buffer.size} bytes, expected {entry.size}"])
        view = memoryview(buffer).cast("B")  # type: ignore[arg-type]
        algorithm = checksum_algorithm(entry.checksum)
        arrival = arrival_for(buffer.size, algorithm, parts)
        checksum = checksum_started(view, algorithm, parts, _verifiers(), arrival)

        def checked() -> str:
            try:
                return checksum()
            finally:
                read()

        return Started(buffer, checked, arrival)
