"""The buffer's change log: what changed since the last snapshot's capture (docs/design.md,
"Checkpoints and restore").

A checkpoint's exclusive hold does pointer work proportional to what changed, never to what is
buffered: rows (staged samples) added, rows removed, and groups whose metadata changed are
recorded here as they happen, and a capture swaps the lists out. Immutable samples and the
frozen metadata of changed groups are shared by reference (a change replaces a group's
``GroupMeta``, never edits it).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass

from rolloutd.domain.group import Group, GroupMeta, Sample

Row = tuple[int, int, Sample]
"""(row_id, group_id, sample)"""


@dataclass(frozen=True)
class Changes:
    """What a capture takes: the changes since the previous one."""

    new_rows: Collection[Row]
    """Rows staged since the previous capture and still live (a view: no copy under the hold)."""
    removed_rows: list[int]
    groups: dict[int, GroupMeta | None]
    """Group id -> its metadata now, or None if it was removed."""
    new_sealed: Sequence[object]
    """The sealed rows among which ``new_sealed_ids`` are (the buffer's ``SealedRows``)."""
    new_sealed_ids: Collection[int]


class ChangeLog:
    """Rows added and removed and groups changed since the last :meth:`take`."""

    def __init__(self) -> None:
        self._new_rows: dict[int, Row] = {}
        """Rows staged since the last capture, by row id. A row removed before it was captured is
        dropped from here and never reported, so without checkpoints this stays bounded by the
        live rows instead of holding every sample ever generated."""
        self._removed_rows: list[int] = []
        """Captured rows removed since the last capture."""
        self._sealed_new: list[object] = []
        self._sealed_new_ids: set[int] = set()
        """Rows staged since the last capture and sealed since, still live: ``_new_rows`` for
        sealed rows (a row is in one or the other)."""
        self._dirty: dict[int, Group | None] = {}
        self._uncaptured_groups: set[int] = set()
        """Groups added since the last capture; their removal leaves nothing to report."""

    def row_added(self, row: Row) -> None:
        self._new_rows[row[0]] = row

    def row_removed(self, row_id: int) -> None:
        if self._new_rows.pop(row_id, None) is not None:
            return
        if row_id in self._sealed_new_ids:
            self._sealed_new_ids.remove(row_id)
        else:
            self._removed_rows.append(row_id)

    def row_sealed(self, row_id: int) -> bool:
        """A row now lives in sealed columns; True when it was not captured yet (the caller
        then hands the sealed batch to :meth:`sealed`)."""
        if self._new_rows.pop(row_id, None) is None:
            return False
        self._sealed_new_ids.add(row_id)
        return True

    def sealed(self, batch: object) -> None:
        self._sealed_new.append(batch)

    def group_added(self, group: Group) -> None:
        self._dirty[group.group_id] = group
        self._uncaptured_groups.add(group.group_id)

    def group_changed(self, group: Group) -> None:
        self._dirty[group.group_id] = group

    def group_removed(self, group_id: int) -> None:
        if group_id in self._uncaptured_groups:
            self._uncaptured_groups.discard(group_id)
            del self._dirty[group_id]
        else:
            self._dirty[group_id] = None

    def take(self) -> Changes:
        """The changes since the last take, handed over; O(changes)."""
        new_rows, self._new_rows = self._new_rows, {}
        sealed, self._sealed_new = self._sealed_new, []
        sealed_ids, self._sealed_new_ids = self._sealed_new_ids, set()
        self._uncaptured_groups.clear()
        removed, self._removed_rows = self._removed_rows, []
        dirty, self._dirty = self._dirty, {}
        return Changes(
            new_rows.values(),
            removed,
            {gid: None if g is None else g.meta for gid, g in dirty.items()},
            sealed,
            sealed_ids,
        )

    def put_back(self, changes: Changes, groups: dict[int, Group]) -> None:
        """Changes taken for a snapshot that failed, so the next take includes them
        (``groups``: the buffer's groups now)."""
        self._new_rows = {**{row[0]: row for row in changes.new_rows}, **self._new_rows}
        self._sealed_new[:0] = changes.new_sealed
        self._sealed_new_ids.update(changes.new_sealed_ids)
        self._removed_rows[:0] = changes.removed_rows
        for gid in changes.groups:
            self._dirty.setdefault(gid, groups.get(gid))
