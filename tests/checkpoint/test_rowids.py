"""Row-id sets."""

from __future__ import annotations

import numpy as np
import pytest

from rolloutd.checkpoint.format import FormatError
from rolloutd.checkpoint.rowids import RowIdSet, sorted_unique


@pytest.mark.parametrize("n", [0, 1, 2, 3, 1000])
def test_sorted_unique_is_numpys_unique(n):
    ids = np.random.default_rng(n).integers(-5, 40, n)
    assert sorted_unique(ids).tolist() == np.unique(ids).tolist()


def test_row_id_set_ranges_and_membership():
    ids = RowIdSet.from_ids([5, 3, 4, 10, 11, 20, 4])
    assert ids.ranges == ((3, 6), (10, 12), (20, 21))
    assert len(ids) == 6
    assert ids.mask([2, 3, 5, 6, 11, 12, 20]).tolist() == [0, 1, 1, 0, 1, 0, 1]
    assert ids.ids().tolist() == [3, 4, 5, 10, 11, 20]
    assert ids.union(RowIdSet.from_ids([6, 7, 12])).ranges == ((3, 8), (10, 13), (20, 21))
    assert RowIdSet.from_json(ids.to_json()) == ids
    assert not RowIdSet.from_ids([])
    with pytest.raises(FormatError):
        RowIdSet(((5, 6), (6, 7)))
