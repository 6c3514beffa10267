"""Row-id sets: which rows a segment holds and which of them are no longer live."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from rolloutd.checkpoint.format import FormatError


def sorted_unique(ids: npt.ArrayLike) -> npt.NDArray[np.int64]:
    """``np.unique`` of int64 ids by a sort and a comparison: numpy 2's ``unique`` hashes
    first and took 7 ms for the 100k ids of a full snapshot (this: under 1 ms)."""
    values = np.sort(np.asarray(ids, dtype=np.int64), axis=None)
    if values.size < 2:
        return values
    return values[np.concatenate(([True], values[1:] != values[:-1]))]


@dataclass(frozen=True)
class RowIdSet:
    """A set of row ids as sorted, disjoint, non-adjacent half-open ranges ``[start, stop)``.

    Row ids are handed out in order, so the rows of a segment are a few ranges and the manifest
    stays small even at 100k rows; an arbitrary set still works, only less compactly.
    """

    ranges: tuple[tuple[int, int], ...] = ()

    def __post_init__(self) -> None:
        previous = None
        for start, stop in self.ranges:
            if start >= stop or (previous is not None and start <= previous):
                raise FormatError(f"row id ranges are not sorted, disjoint and non-empty: {self}")
            previous = stop

    @classmethod
    def from_ids(cls, ids: npt.ArrayLike) -> RowIdSet:
        values = sorted_unique(ids)
        if values.size == 0:
            return cls()
        breaks = np.flatnonzero(np.diff(values) != 1) + 1
        starts = values[np.concatenate(([0], breaks))]
        stops = values[np.concatenate((breaks - 1, [values.size - 1]))] + 1
        return cls(tuple(zip(starts.tolist(), stops.tolist(), strict=True)))

    def __len__(self) -> int:
        return sum(stop - start for start, stop in self.ranges)

    def __bool__(self) -> bool:
        return bool(self.ranges)

    def mask(self, ids: npt.ArrayLike) -> npt.NDArray[np.bool_]:
        """Membership of each id in ``ids``, vectorised."""
        values = np.asarray(ids, dtype=np.int64)
        if not self.ranges:
            return np.zeros(values.shape, dtype=np.bool_)
        bounds = np.asarray(self.ranges, dtype=np.int64)
        at = np.searchsorted(bounds[:, 0], values, side="right") - 1
        return (at >= 0) & (values < bounds[np.maximum(at, 0), 1])

    def ids(self) -> npt.NDArray[np.int64]:
        if not self.ranges:
            return np.zeros(0, dtype=np.int64)
        return np.concatenate([np.arange(a, b, dtype=np.int64) for a, b in self.ranges])

    def union(self, other: RowIdSet) -> RowIdSet:
        merged: list[tuple[int, int]] = []
        for start, stop in sorted(self.ranges + other.ranges):
            if merged and start <= merged[-1][1]:
                merged[-1] = (merged[-1][0], max(merged[-1][1], stop))
            else:
                merged.append((start, stop))
        return RowIdSet(tuple(merged))

    def to_json(self) -> list[list[int]]:
        return [[start, stop] for start, stop in self.ranges]

    @classmethod
    def from_json(cls, value: Any) -> RowIdSet:
        return cls(tuple((int(start), int(stop)) for start, stop in value))
