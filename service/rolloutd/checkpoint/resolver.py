"""Resolving what ``--restore`` names (latest, a sequence, a tag) to the newest snapshot that
verifies, passing over (and reporting) each newer one that does not."""

from __future__ import annotations

import builtins
import contextlib
import logging
from collections.abc import Sequence
from dataclasses import dataclass

from rolloutd.checkpoint.backends import CorruptSnapshot
from rolloutd.checkpoint.reader import Reader, SnapshotNotFound
from rolloutd.checkpoint.segments import Snapshot
from rolloutd.domain.report import SkippedSnapshot

log = logging.getLogger(__name__)

LATEST = "latest"
"""The spec :meth:`Resolver.resolve` takes for the newest snapshot that verifies."""


@dataclass
class Resolution:
    """The snapshot a spec resolved to (``None`` when none verified) and each one passed over."""

    snapshot: Snapshot | None
    skipped: list[SkippedSnapshot]


class Resolver(Reader):
    """Picks the snapshot a restore spec names."""

    def resolve(
        self, spec: str | int = LATEST, *, verify: bool = True, before: int | None = None
    ) -> Resolution:
        """The newest snapshot selected by ``spec`` that verifies, and each newer one skipped.

        ``spec`` is :data:`LATEST`, a sequence (an int or a string of digits) or a tag. The newest
        snapshot it names is tried first, then each older one, whatever its tag: an older snapshot
        plus the acks journaled after it is a valid, earlier state. :class:`SnapshotNotFound` when
        the sequence or tag names no published snapshot; ``snapshot=None`` when nothing verifies
        (or the store is empty and ``spec`` is :data:`LATEST`). ``before`` tries only snapshots
        older than that sequence (restore's next try when one's rows do not verify);
        ``verify=False`` leaves the sample segments verifying (see :meth:`open`).
        """
        sequences = self.sequences()
        skipped: builtins.list[SkippedSnapshot] = []
        if isinstance(spec, int) or spec.isdigit():
            target = int(spec)
            if target not in sequences:
                raise SnapshotNotFound(f"no snapshot {target} in {self.url}")
        elif spec == LATEST:
            target = sequences[0] if sequences else -1
        else:
            target = self._find_tag(spec, sequences)
        if before is not None:
            target = min(target, before - 1)
        for sequence in (s for s in sequences if s <= target):
            try:
                return Resolution(self.open(self.load(sequence), verify=verify), skipped)
            except CorruptSnapshot as exc:
                log.warning("%s", exc)
                skipped.append(SkippedSnapshot(sequence, "; ".join(exc.problems)))
        return Resolution(None, skipped)

    def _find_tag(self, tag: str, sequences: Sequence[int]) -> int:
        for sequence in sequences:
            with contextlib.suppress(CorruptSnapshot):
                if self.load(sequence).tag == tag:
                    return sequence
        raise SnapshotNotFound(f"no snapshot tagged {tag!r} in {self.url}")
