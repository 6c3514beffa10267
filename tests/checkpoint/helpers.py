"""Rows, store locations and snapshot writing shared by the store, crash and inspect tests."""

from __future__ import annotations

import asyncio
import json
import time
from array import array
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import fsspec
import numpy as np

from rolloutd.checkpoint.checkpointer import Checkpointer, CheckpointerConfig
from rolloutd.checkpoint.journal import Journal
from rolloutd.checkpoint.manifest import FileEntry, Manifest, next_manifest
from rolloutd.checkpoint.restore import Granularity, restore
from rolloutd.checkpoint.rows import Row
from rolloutd.checkpoint.store import SnapshotStore
from rolloutd.domain.concurrency import ConcurrencyConfig
from rolloutd.domain.controller import Controller, ControllerConfig
from rolloutd.domain.group import Prompt, Sample
from rolloutd.domain.report import CheckpointReport, Outcome, RestoreReport, Trigger
from rolloutd.domain.sampler import Sampler
from tests.fakes import GatedEngine


def journal_write(journal: Journal, record: Mapping[str, Any]) -> int:
    """Journals ``record`` the way the service does (:meth:`Journal.enqueue` and its group-commit
    flush), from a test that has no event loop; durable when this returns its position."""

    async def write() -> int:
        position = await journal.enqueue(record)
        await journal.marked()  # the loop ends with this call: the mark must not be cut short
        return position

    return asyncio.run(write())


def make_rows(start: int, count: int, *, group_size: int = 4, max_tokens: int = 48) -> list[Row]:
    """Rows ``start .. start+count`` with varied lengths (some empty), text and floats."""
    rng = np.random.default_rng(start)
    rows: list[Row] = []
    for row_id in range(start, start + count):
        n = int(rng.integers(0, max_tokens))
        tokens = array("i", rng.integers(-(2**31), 2**31 - 1, n, dtype=np.int64).tolist())
        logprobs = array("f", (-rng.random(n, dtype=np.float32)).tolist())
        prompt = array("i", range(row_id % 7))
        sample = Sample(
            index=row_id % group_size,
            token_ids=tokens,
            logprobs=logprobs,
            text=f"answer {row_id} \u00e9\u4e2d" * (row_id % 3),
            finish_reason="stop" if row_id % 2 else "length",
            policy_version=row_id // 10,
            prompt_token_ids=prompt,
            seed=row_id * 7919,
            started_at=1_700_000_000.0 + row_id,
            finished_at=1_700_000_000.5 + row_id,
        )
        rows.append((row_id, row_id // group_size, sample))
    return rows


@dataclass
class Location:
    """Where a test store lives: a local directory or an S3 prefix on the moto server."""

    url: str
    options: dict[str, Any] = field(default_factory=dict)

    @property
    def local(self) -> bool:
        return "://" not in self.url

    def open(self) -> SnapshotStore:
        return SnapshotStore(self.url, self.options)

    def fs(self) -> fsspec.AbstractFileSystem:
        if self.local:
            return fsspec.filesystem("file")
        return fsspec.filesystem("s3", **self.options, skip_instance_cache=True)

    def full(self, path: str) -> str:
        return f"{self.url.removeprefix('s3://')}/{path}"

    def read(self, path: str) -> bytes:
        return bytes(self.fs().cat_file(self.full(path)))

    def write(self, path: str, data: bytes) -> None:
        self.fs().pipe_file(self.full(path), data)

    def listdir(self, prefix: str) -> list[str]:
        fs = self.fs()
        full = self.full(prefix)
        if not fs.exists(full):
            return []
        return sorted(p.rsplit("/", 1)[-1] for p in fs.ls(full, detail=False))

    def truncate(self, path: str, keep: int) -> None:
        self.write(path, self.read(path)[:keep])

    def flip_bit(self, path: str, offset: int | None = None) -> None:
        data = bytearray(self.read(path))
        at = len(data) // 2 if offset is None else offset
        data[at] ^= 0x10
        self.write(path, bytes(data))


def publish(
    store: SnapshotStore,
    parent: Manifest | None,
    rows: Sequence[Row] = (),
    *,
    removed: Sequence[int] = (),
    state: dict[str, Any] | None = None,
    tag: str = "",
    trainer_step: int | None = None,
    acks_through: int = 0,
) -> Manifest:
    """One checkpoint as the checkpointer writes it: segment, sidecar, manifest, publication."""
    sequence = parent.sequence + 1 if parent else 1
    segment = store.write_segment(sequence, rows) if rows else None
    sidecar = write_sidecar(store, sequence, state or {"sequence": sequence})
    manifest = next_manifest(
        parent,
        sequence=sequence,
        created_at=time.time(),
        sidecar=sidecar,
        new_segment=segment,
        removed=removed,
        acks_through=acks_through,
        tag=tag,
        trainer_step=trainer_step,
        fingerprint={"model": "tiny", "group_size": 4},
    )
    store.publish(manifest)
    return manifest


def live(rows: Sequence[Row], removed: Sequence[int] = ()) -> list[Row]:
    gone = set(removed)
    return [row for row in rows if row[0] not in gone]


def write_sidecar(store: SnapshotStore, sequence: int, state: Mapping[str, Any]) -> FileEntry:
    """Write a JSON-able ``state`` as the sidecar of snapshot ``sequence``."""
    data = json.dumps(state, separators=(",", ":"), allow_nan=False).encode()
    return store.write_sidecar_json(sequence, data)


def read_rows(store: SnapshotStore, manifest: Manifest) -> list[Row]:
    """Live rows of a snapshot, verified as they are read."""
    return store.open(manifest).rows()


def read_sidecar(store: SnapshotStore, manifest: Manifest) -> dict[str, Any]:
    """The sidecar of a snapshot, verified as it is read."""
    return store.open(manifest).sidecar


def verify(store: SnapshotStore, manifest: Manifest) -> list[str]:
    """Problems with ``manifest``'s files (every file re-read and checksummed); [] if none."""
    return [p for entry in manifest.files() for p in store.verify_file(entry)]


NODE_FINGERPRINT = {"model": "tiny", "group_size": 2}


class StoreNode:
    """A controller over ``prompts`` with an instant engine, its store (at ``location``) and
    checkpointer, as one process has them."""

    def __init__(
        self,
        location: Location,
        prompts: Sequence[Prompt],
        *,
        max_in_flight: int,
        buffer_capacity: int,
        keep_latest: int,
        concurrency: ConcurrencyConfig | None = None,
    ) -> None:
        self.location = location
        self.store = location.open()
        self.controller = Controller(
            ControllerConfig(
                group_size=2,
                max_in_flight=max_in_flight,
                buffer_capacity=buffer_capacity,
                reap_interval_s=0.02,
                concurrency=concurrency,
            ),
            GatedEngine(auto=True),
            Sampler(list(prompts), seed=1, epochs=1),
            journal=self.store.journal,
        )
        self.checkpointer = Checkpointer(
            self.controller,
            self.store,
            self.store.journal,
            CheckpointerConfig(keep_latest=keep_latest),
            NODE_FINGERPRINT,
        )

    async def checkpoint(self) -> CheckpointReport:
        report = await self.checkpointer.checkpoint(Trigger.ON_DEMAND)
        assert report.outcome is Outcome.COMPLETED, report
        return report

    async def restore(self) -> RestoreReport:
        return await restore(
            self.controller,
            self.store,
            self.checkpointer,
            "latest",
            NODE_FINGERPRINT,
            Granularity.SIBLING,
        )


def publish_earlier_layout(
    node: StoreNode, sequence: int, edit: Callable[[dict[str, Any]], None], **emptied: Any
) -> Manifest:
    """Snapshot ``sequence`` published again as the next one, as an earlier version wrote it:
    its sidecar JSON changed by ``edit``, the manifest fields named in ``emptied`` set to them."""
    manifest = node.store.load(sequence)
    data = json.loads(node.location.read(manifest.sidecar.path))
    edit(data)
    legacy = replace(
        manifest,
        sequence=sequence + 1,
        sidecar=node.store.write_sidecar_json(sequence + 1, json.dumps(data).encode()),
        **emptied,
    )
    node.store.publish(legacy)
    return legacy
