"""Room on the staging disk: what one update reserves, others cannot take."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest

from rolloutd.domain.errors import ResourceExhausted
from rolloutd.weights import staging
from rolloutd.weights.staging import StagingArea

KIB = 2**10
FREE = 1000 * KIB


@pytest.fixture
def area(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> StagingArea:
    """A disk with FREE bytes free, less what the area's files take."""
    area = StagingArea(tmp_path / "staging")

    def usage(path: Any) -> Any:
        used = sum(p.stat().st_blocks * 512 for p in (tmp_path / "staging").rglob("*"))
        return shutil._ntuple_diskusage(2 * FREE, used, FREE - used)  # type: ignore[attr-defined]

    monkeypatch.setattr(staging.shutil, "disk_usage", usage)
    return area


def test_concurrent_updates_cannot_all_pass_the_free_space_check(area: StagingArea) -> None:
    """Three pushes of 400 KiB on 1000 KiB free all passed before, then all ran out."""
    first = area.new(400 * KIB)
    second = area.new(400 * KIB)
    with pytest.raises(ResourceExhausted, match="reserved by other updates"):
        area.new(400 * KIB)
    area.discard(second)
    third = area.new(400 * KIB)
    area.promote(first, 1)
    area.new(150 * KIB)
    assert third.exists()


def test_bytes_already_written_are_not_counted_twice(area: StagingArea) -> None:
    directory = area.new(600 * KIB)
    (directory / "a.safetensors").write_bytes(b"\0" * (300 * KIB))
    # 700 KiB free less the 300 KiB still promised: 400 KiB fit, 450 do not.
    with pytest.raises(ResourceExhausted):
        area.new(450 * KIB)
    area.new(390 * KIB)
