"""The snapshot format: its version, and the error of anything that does not follow it.

A snapshot is a manifest (manifest.py) that lists immutable files: Arrow IPC *segments* holding
sample rows and group metadata (rows.py, groups.py), one JSON *sidecar* holding controller state,
JSON Lines *submissions pieces* holding the submitted prompts (submissions.py), and Arrow IPC
*ledger pieces* holding the finalized-lease ledger (ledger.py). Segments use the IPC file format,
uncompressed, so ``pyarrow.ipc.open_file``, ``polars.read_ipc`` and duckdb open them as they are.
Snapshots are incremental: a segment written by one snapshot is listed again by later ones, each
listing also the ids of its rows that are no longer live (rowids.py). Every file is listed with
its size and a checksum (checksums.py).
"""

from __future__ import annotations

FORMAT_VERSION = 6
"""Version of the manifest and segment layout; readers refuse a newer one. Format 6 adds each
prompt's tools to the group columns (an episode's chat template is rendered with them; the
partials file, format 2, holds episodes' records and their samples' spans). Format 5 adds each
group's source and generation settings to the group columns (:data:`GROUP_SCHEMA`); format 4
had the finishing stage's scores without them (:data:`GROUP_SCHEMA_V4`), format 3 neither
(:data:`GROUP_SCHEMA_V3`), format 2 kept group metadata as one JSON string
per group (:data:`GROUP_SCHEMA_V2`) and format 1 in the sidecar. All are still read: a snapshot
taken after an upgrade lists the group segments of earlier ones until compaction rewrites
them."""


class FormatError(ValueError):
    """A manifest or segment does not follow this format (or comes from a newer one)."""
