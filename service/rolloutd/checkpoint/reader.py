"""Reading published snapshots: list manifests, load one, open every file it lists.

A snapshot exists exactly when its manifest does; opening it verifies each file once and holds
the verified bytes for decoding (segments.py), so a restore reads each file once.
"""

from __future__ import annotations

import builtins
import contextlib
import functools
import json
import logging
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pyarrow as pa

from rolloutd.checkpoint import ledger, partials, submissions
from rolloutd.checkpoint.backends import MANIFESTS, CorruptSnapshot, manifest_path, sequence_of
from rolloutd.checkpoint.format import FormatError
from rolloutd.checkpoint.manifest import FileEntry, Manifest
from rolloutd.checkpoint.rows import SegmentKind
from rolloutd.checkpoint.segments import Snapshot
from rolloutd.checkpoint.verifier import Verifier
from rolloutd.domain.partial import PartialSibling

log = logging.getLogger(__name__)


@functools.cache
def _openers() -> ThreadPoolExecutor:
    """Maps sample segments and starts their checksums: mapping a large file and asking for
    all of it ahead (see :meth:`Verifier._start`) takes milliseconds that restore spends
    decoding instead."""
    return ThreadPoolExecutor(1, thread_name_prefix="rolloutd-open")


class SnapshotNotFound(LookupError):
    """No published snapshot matches the requested sequence or tag."""


class Reader(Verifier):
    """Finds, loads and opens published snapshots."""

    @property
    def url(self) -> str:
        return self.backend.url

    def sequences(self) -> list[int]:
        """Sequences of every published manifest, newest first, readable or not (one listing)."""
        names = self.backend.listdir(MANIFESTS)
        found = (sequence_of(n) for n in names if n.endswith(".json"))
        return sorted((s for s in found if s is not None), reverse=True)

    def load(self, sequence: int) -> Manifest:
        """The manifest of ``sequence``; :class:`CorruptSnapshot` when it cannot be trusted."""
        try:
            data = self.backend.read(manifest_path(sequence)).to_pybytes()
        except FileNotFoundError:
            raise SnapshotNotFound(f"no snapshot {sequence} in {self.url}") from None
        try:
            manifest = Manifest.from_json(data)
        except FormatError as exc:
            raise CorruptSnapshot(sequence, [f"{manifest_path(sequence)}: {exc}"]) from exc
        if manifest.sequence != sequence:
            problem = f"{manifest_path(sequence)}: holds sequence {manifest.sequence}"
            raise CorruptSnapshot(sequence, [problem])
        return manifest

    def list(self) -> builtins.list[Manifest]:
        """Readable manifests, newest first; reads manifests only, never segments."""
        manifests = []
        for sequence in self.sequences():
            try:
                manifests.append(self.load(sequence))
            except CorruptSnapshot as exc:
                log.warning("%s", exc)
        return manifests

    def open(self, manifest: Manifest, *, verify: bool = True) -> Snapshot:
        """Read and verify every file of ``manifest`` once; :class:`CorruptSnapshot` if any fails.

        With ``verify=False`` the sample segments (nearly all the bytes) are still being read
        and checksummed on the verify threads when this returns; everything else has verified.
        The caller decodes meanwhile and must call :meth:`Snapshot.verify` before it uses rows.
        """
        problems = self.check_sizes(manifest, partials=False)  # read on its own: read_partials
        if problems:
            raise CorruptSnapshot(manifest.sequence, problems)
        # The sample segments start first: their read is the long pole, and a restore ends
        # ~1.5 ms after their last byte. The small files read and checked here meanwhile are
        # decoded long before that (64 MB quick snapshot, two runs of three restores: 35-41 ms,
        # and 40-52 ms with the small files asked for first; raw reads 28-30 ms).
        started = [(s, _openers().submit(self._start, s.file)) for s in manifest.segments]
        small = {g.file.path: self.backend.read(g.file.path) for g in manifest.groups}
        sidecar_buffer = self.backend.read(manifest.sidecar.path)
        try:
            group_segments = [
                (s, self.open_segment(s, SegmentKind.GROUPS, buffer=small[s.file.path]))
                for s in manifest.groups
            ]
            sidecar = self._parse_sidecar(
                self.read_verified(manifest.sidecar, buffer=sidecar_buffer), manifest.sidecar
            )
            submitted = submissions.read(self.backend, manifest.submissions)
            finalized = ledger.read(self.backend, manifest.ledger)
        except CorruptSnapshot as exc:
            raise CorruptSnapshot(manifest.sequence, exc.problems) from exc
        snapshot = Snapshot(
            manifest,
            sidecar,
            [],
            group_segments,
            submitted,
            finalized,
            started,
        )
        if verify:
            snapshot.verify()
        return snapshot

    @staticmethod
    def _parse_sidecar(buffer: pa.Buffer, entry: FileEntry) -> dict[str, Any]:
        try:
            state = json.loads(buffer.to_pybytes())
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise CorruptSnapshot(-1, [f"{entry.path}: not JSON: {exc}"]) from exc
        if not isinstance(state, dict):
            raise CorruptSnapshot(-1, [f"{entry.path}: not a JSON object"])
        return state

    def read_partials(self, manifest: Manifest) -> builtins.list[PartialSibling]:
        """The partial siblings ``manifest`` lists, verified; none when it lists no file.
        :class:`CorruptSnapshot` when the file is missing, truncated, or does not verify or
        decode (:meth:`open` leaves it out, so that only its tokens are lost)."""
        return self._partials_file(manifest)[0]

    def read_resumed(self, manifest: Manifest) -> dict[int, partials.ResumedRow]:
        """Row id -> where its sample was resumed, for the live rows of ``manifest`` that were."""
        return self._partials_file(manifest)[1]

    def _partials_file(
        self, manifest: Manifest
    ) -> tuple[builtins.list[PartialSibling], dict[int, partials.ResumedRow]]:
        entry = manifest.partials
        if entry is None:
            return [], {}
        try:
            problem = self._size_problem(entry)  # missing or truncated
            if problem is not None:
                raise CorruptSnapshot(-1, [problem])
            return partials.read(self.read_verified(entry), entry)
        except CorruptSnapshot as exc:
            raise CorruptSnapshot(manifest.sequence, exc.problems) from exc

    def _newest_acks_through(self) -> int:
        for sequence in self.sequences():
            with contextlib.suppress(CorruptSnapshot):
                return self.load(sequence).acks_through
        return 0
