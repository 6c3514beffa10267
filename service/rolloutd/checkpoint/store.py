"""Snapshot store: publish, resolve, open and verify snapshots (manifests and their files).

Layout under the root (a directory, ``file://`` URL or any fsspec URL such as ``s3://bucket/pre``)::

    manifests/<sequence>.json            a snapshot exists exactly when its manifest does
    segments/<sequence>-<token>.arrow    Arrow IPC file of sample rows, shared by later snapshots
    sidecars/<sequence>-<token>.json     controller state of one snapshot
    partials/<sequence>-<token>.arrow    tokens of siblings still generating (partials.py)
    submissions/<sequence>-<token>.jsonl submitted prompts, shared by later snapshots (submissions.py)
    ledger/<sequence>-<token>.arrow      finalized leases, shared by later snapshots (ledger.py)
    journal/                             acks, leases, submissions, id reservations (journal.py)
    trash/, tmp/                         retention (retention.py), files being written (backends.py)

Invariants:

* Files are immutable once they have their final name; ``<sequence>`` is the snapshot that wrote the
  file and ``<token>`` is random, so a crashed attempt's leftovers never collide with a retry.
* :meth:`SnapshotStore.publish` makes every file of a manifest durable before the manifest itself
  (fsync of files, directories and the manifest, then a rename; on an object store every file is
  complete before the manifest is put), so a crash leaves either the new snapshot or none of it.
* One process writes a store at a time: it holds the store's claim (claim.py), and a process
  that lost it is fenced before it writes.

Every I/O failure is an :class:`OSError` (see backends.py); a file that exists but does not verify
raises :class:`CorruptSnapshot`. The checkpointer and restore see the store through the narrow
:class:`SnapshotWriter` and :class:`SnapshotReader` protocols.

:class:`SnapshotStore` composes the store's jobs, one module each: verifying files (verifier.py),
reading snapshots (reader.py), resolving a restore spec (resolver.py), writing and publishing
(writer.py), and retention (retention.py).
"""

from __future__ import annotations

import builtins
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any, Protocol

from rolloutd.checkpoint import partials
from rolloutd.checkpoint.backends import open_backend
from rolloutd.checkpoint.checksums import ChecksumAlgorithm
from rolloutd.checkpoint.claim import StoreClaim
from rolloutd.checkpoint.journal import Journal
from rolloutd.checkpoint.manifest import (
    FileEntry,
    LedgerEntry,
    Manifest,
    SegmentEntry,
    SubmissionsEntry,
)
from rolloutd.checkpoint.resolver import Resolution, Resolver
from rolloutd.checkpoint.retention import Retention, RetireResult
from rolloutd.checkpoint.rows import Row, SegmentKind
from rolloutd.domain.buffer import SealedRows
from rolloutd.domain.group import GroupMeta, Prompt
from rolloutd.domain.partial import PartialSibling


class SnapshotWriter(Protocol):
    """What the checkpointer needs: write a snapshot's files, publish it, keep the store bounded."""

    def sequences(self) -> builtins.list[int]: ...
    def list(self) -> builtins.list[Manifest]: ...
    def write_segment(
        self,
        sequence: int,
        rows: Sequence[Row],
        sealed: Sequence[SealedRows] = (),
        sealed_ids: Collection[int] = (),
    ) -> SegmentEntry: ...
    def write_groups(self, sequence: int, metas: Sequence[GroupMeta]) -> SegmentEntry: ...
    def write_sidecar_json(self, sequence: int, data: bytes) -> FileEntry: ...
    def write_partials(
        self,
        sequence: int,
        siblings: Sequence[PartialSibling],
        resumed: Mapping[int, partials.ResumedRow],
    ) -> FileEntry: ...
    def compact(
        self, manifest: Manifest, segments: Sequence[SegmentEntry], kind: SegmentKind = ...
    ) -> Manifest: ...
    def write_submissions(
        self, sequence: int, parent: Sequence[SubmissionsEntry], prompts: Sequence[Prompt]
    ) -> tuple[SubmissionsEntry, ...]: ...
    def write_ledger(
        self, sequence: int, parent: Sequence[LedgerEntry], finalized: Mapping[str, int]
    ) -> tuple[LedgerEntry, ...]: ...
    def publish(self, manifest: Manifest) -> None: ...
    def retire(self, keep_latest: int, keep: Callable[[Manifest], bool]) -> RetireResult: ...


class SnapshotReader(Protocol):
    """What restore and the inspect command need: find, verify and open published snapshots."""

    @property
    def url(self) -> str: ...

    def sequences(self) -> builtins.list[int]: ...
    def list(self) -> builtins.list[Manifest]: ...
    def load(self, sequence: int) -> Manifest: ...
    def check_sizes(self, manifest: Manifest) -> builtins.list[str]: ...
    def verify_file(self, entry: FileEntry) -> builtins.list[str]: ...
    def resolve(
        self, spec: str | int = ..., *, verify: bool = ..., before: int | None = ...
    ) -> Resolution: ...
    @property
    def journal(self) -> Journal: ...

    def read_partials(self, manifest: Manifest) -> builtins.list[PartialSibling]: ...
    def read_resumed(self, manifest: Manifest) -> dict[int, partials.ResumedRow]: ...


class SnapshotStore(Retention, Resolver):
    """Snapshots of the rollout buffer in a directory or an fsspec URL; see the module docstring.

    Opening a store writes nothing, so a read-only location fails at the first write (an
    ``OSError`` the checkpointer reports as ``io_error``); it lists the journal and reads the newest
    manifest to continue ack positions, so an unreachable location raises ``OSError`` here.
    """

    def __init__(
        self,
        url: str,
        storage_options: Mapping[str, Any] | None = None,
        *,
        checksum: ChecksumAlgorithm = ChecksumAlgorithm.CRC32,
        lock_timeout_s: float = 30.0,
    ) -> None:
        self.backend = open_backend(url, storage_options or {})
        self._checksum = checksum
        self.claim = StoreClaim(self.backend, lock_timeout_s)
        """The one-writer claim (claim.py): a serving process acquires it before restoring;
        publication, retention and journal writes check it first."""
        self.journal = Journal(
            self.backend, floor=self._newest_acks_through(), guard=self.claim.check
        )
