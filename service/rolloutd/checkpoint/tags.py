"""What names a snapshot: ``latest``, a sequence number (digits) or a tag, read the same way by
``--restore``, ``rolloutd checkpoints show`` and the admin API.

A tag that reads as one of the others would be unreachable (``Checkpoint{tag:"5"}`` creates a
snapshot that ``--restore 5`` does not find), so such tags are refused where snapshots are made:
all digits, ``latest`` and ``none``.
"""

from __future__ import annotations

from rolloutd.checkpoint.reader import SnapshotNotFound
from rolloutd.checkpoint.resolver import LATEST
from rolloutd.checkpoint.store import SnapshotReader

MAX_TAG_LENGTH = 128
NONE = "none"
"""``--restore none``: start fresh, whatever the store holds."""
RESERVED = frozenset({LATEST, NONE})


def tag_problem(tag: str) -> str | None:
    """Why ``tag`` cannot name a snapshot, or None when it can (the empty tag means untagged)."""
    if len(tag) > MAX_TAG_LENGTH:
        return f"must be at most {MAX_TAG_LENGTH} characters"
    if tag.isdigit():
        return f"{tag!r} reads as a sequence number; use a name with a letter, e.g. 'step-{tag}'"
    if tag in RESERVED:
        return f"{tag!r} is a reserved word of --restore; choose another name"
    return None


def sequence_of(store: SnapshotReader, spec: str) -> int:
    """The sequence ``spec`` names, without verifying the snapshot; ``SnapshotNotFound`` if none."""
    sequences = store.sequences()
    if spec == LATEST:
        if not sequences:
            raise SnapshotNotFound(f"no snapshot in {store.url}")
        return sequences[0]
    if spec.isdigit():
        if int(spec) not in sequences:
            raise SnapshotNotFound(f"no snapshot {int(spec)} in {store.url}")
        return int(spec)
    for manifest in store.list():
        if manifest.tag == spec:
            return manifest.sequence
    raise SnapshotNotFound(f"no snapshot tagged {spec!r} in {store.url}")
