"""The weights store: one anchor and the chain after it; a catch-up plan, or the missing link."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from rolloutd.weights.delta import make_delta
from rolloutd.weights.store import ChainBroken, WeightsStore
from tests.weights.helpers import write_model


def _publish_chain(store: WeightsStore, tmp_path: Path, versions: range) -> None:
    rng = np.random.default_rng(0)
    weights = {"w": rng.standard_normal(64).astype(np.float32)}
    for v in versions:
        new = {"w": weights["w"] + np.float32(v)}
        path = tmp_path / f"{v}.delta"
        make_delta(weights, new, path, base_version=v - 1, version=v)
        store.publish_delta(path)
        weights = new


def test_plans_from_the_served_version_or_the_anchor(tmp_path: Path) -> None:
    store = WeightsStore(str(tmp_path / "store"))
    assert store.plan(0) is None
    store.publish_anchor(2, write_model(tmp_path / "m", seed=0))
    _publish_chain(store, tmp_path, range(3, 6))
    assert store.latest() == 5
    from_served = store.plan(3)
    assert from_served is not None
    assert (from_served.anchor, [d[0] for d in from_served.deltas]) == (None, [4, 5])
    from_anchor = store.plan(1)
    assert from_anchor is not None
    assert (from_anchor.anchor, [d[0] for d in from_anchor.deltas]) == (2, [3, 4, 5])
    assert from_anchor.anchor_url == f"{store.url}/anchors/v2"
    assert store.plan(5) is None and store.plan(7) is None


def test_a_gap_names_the_missing_version(tmp_path: Path) -> None:
    store = WeightsStore(str(tmp_path / "store"))
    store.publish_anchor(2, write_model(tmp_path / "m", seed=0))
    _publish_chain(store, tmp_path, range(3, 6))
    (tmp_path / "store" / "deltas" / "v4-from-v3.delta").unlink()
    with pytest.raises(ChainBroken, match="from v2 \\(the anchor\\) to v5 is missing v4"):
        store.plan(2)


def test_a_new_anchor_retires_the_older_one_and_its_chain(tmp_path: Path) -> None:
    store = WeightsStore(str(tmp_path / "store"))
    store.publish_anchor(2, write_model(tmp_path / "m", seed=0))
    _publish_chain(store, tmp_path, range(3, 6))
    store.publish_anchor(4, write_model(tmp_path / "m4", seed=4))
    assert (store.anchors(), store.deltas()) == ([4], {5: 4})
