"""Checkpoints as the checkpointer writes them, run in a subprocess that test_crash.py kills.

``python -m tests.checkpoint.crash_worker URL OPTIONS_JSON COUNT`` writes COUNT checkpoints
(0: until killed). Snapshot ``k`` adds rows ``20k .. 20k+19`` and removes row ``20k - 5``, and
journals one ack first, so what any snapshot must hold is known from its sequence alone.
"""

from __future__ import annotations

import json
import sys
import time

from rolloutd.checkpoint.manifest import Manifest, next_manifest
from rolloutd.checkpoint.retention import plan_compaction
from rolloutd.checkpoint.rows import Row
from rolloutd.checkpoint.store import SnapshotStore
from tests.checkpoint.helpers import journal_write, make_rows, write_sidecar

ROWS = 20
MAX_SEGMENTS = 2


def added(sequence: int) -> list[Row]:
    return make_rows(sequence * ROWS, ROWS)


def removed(sequence: int) -> list[int]:
    return [sequence * ROWS - 5] if sequence > 1 else []


def expected_rows(sequence: int) -> list[Row]:
    gone = {r for k in range(1, sequence + 1) for r in removed(k)}
    rows = [row for k in range(1, sequence + 1) for row in added(k)]
    return [row for row in rows if row[0] not in gone]


def checkpoint_once(store: SnapshotStore) -> Manifest:
    """One checkpoint after the newest snapshot that verifies; retention keeps two."""
    resolution = store.resolve()
    parent = resolution.snapshot.manifest if resolution.snapshot else None
    sequences = store.sequences()
    sequence = (sequences[0] if sequences else 0) + 1
    if parent is not None and parent.sequence != sequence - 1:
        raise AssertionError(f"newest snapshot {sequence - 1} did not verify: {resolution}")
    acks_through = journal_write(store.journal, {"sequence": sequence})
    segment = store.write_segment(sequence, added(sequence))
    sidecar = write_sidecar(store, sequence, {"sequence": sequence, "pad": "x" * 5000})
    manifest = next_manifest(
        parent,
        sequence=sequence,
        created_at=time.time(),
        sidecar=sidecar,
        new_segment=segment,
        removed=removed(sequence),
        acks_through=acks_through,
    )
    chosen = plan_compaction(manifest, MAX_SEGMENTS)
    if chosen:
        manifest = store.compact(manifest, chosen)
    store.publish(manifest)
    store.retire(keep_latest=2)
    return manifest


def main(argv: list[str]) -> None:
    url, options, count = argv[0], json.loads(argv[1]), int(argv[2])
    store = SnapshotStore(url, options)
    done = 0
    while count == 0 or done < count:
        checkpoint_once(store)
        done += 1


if __name__ == "__main__":
    main(sys.argv[1:])
