"""The live buffer seals committed rows into Arrow batches once enough of them wait as objects."""

from __future__ import annotations

from array import array
from dataclasses import replace

from rolloutd.checkpoint.segments import ArrowSealer
from rolloutd.domain.buffer import SEAL_ROWS, SEAL_VALUES, RolloutBuffer
from rolloutd.domain.group import Group, GroupMeta, KeptSamples, Prompt, Sample


def _commit(buf: RolloutBuffer, gid: int, size: int, tokens: int) -> list[Sample]:
    buf.add(Group(GroupMeta(gid, Prompt(f"p{gid}", "q"), None, size, 0, 0.0, gid)))
    samples = [
        Sample(
            i,
            array("i", range(gid, gid + tokens)),
            array("f", [-0.5] * tokens),
            f"answer {gid}.{i}",
            "stop",
            gid % 3,
            array("i", [7, gid]),
            gid * 31 + i,
            float(gid),
            gid + 0.5,
        )
        for i in range(size)
    ]
    for s in samples:
        buf.stage(gid, s)
    buf.commit(gid, float(gid))
    return samples


def test_rows_stay_objects_until_a_seal_is_due_then_every_committed_row_is_sealed():
    buf = RolloutBuffer(ArrowSealer())
    size = 8
    groups = SEAL_ROWS // size
    made = {gid: _commit(buf, gid, size, tokens=3) for gid in range(1, groups)}
    assert not any(isinstance(g.samples, KeptSamples) for g in buf.groups.values())
    made[groups] = _commit(buf, groups, size, tokens=3)  # SEAL_ROWS rows now wait
    assert all(isinstance(g.samples, KeptSamples) for g in buf.groups.values())
    assert {gid: g.ordered_samples() for gid, g in buf.groups.items()} == made
    state = buf.capture()
    assert not state.new_rows and len(state.new_sealed_ids) == SEAL_ROWS


def test_long_samples_are_sealed_after_fewer_rows():
    buf = RolloutBuffer(ArrowSealer())
    tokens = SEAL_VALUES // 16  # a row holds 2 x tokens values (+2 prompt ids): eight reach it
    _commit(buf, 1, 4, tokens)
    assert not isinstance(buf.groups[1].samples, KeptSamples)
    _commit(buf, 2, 4, tokens)
    assert all(isinstance(g.samples, KeptSamples) for g in buf.groups.values())


def test_without_a_sealer_rows_stay_objects():
    buf = RolloutBuffer()
    for gid in range(1, SEAL_ROWS // 8 + 2):
        _commit(buf, gid, 8, tokens=1)
    assert not any(isinstance(g.samples, KeptSamples) for g in buf.groups.values())


def test_a_group_with_a_resumed_sibling_stays_objects():
    """Where a sibling was resumed is not a column: sealing it would lose that record."""
    buf = RolloutBuffer(ArrowSealer())
    buf.add(Group(GroupMeta(1, Prompt("p1", "q"), None, 2, 0, 0.0, 1)))
    plain = Sample(0, array("i", [1]), array("f", [0.0]), "x", "stop", 0, array("i"), 0, 0.0, 0.0)
    buf.stage(1, plain)
    buf.stage(1, replace(plain, index=1, resumed_at=1))
    buf.commit(1, 0.0)
    _commit(buf, 2, 2, tokens=1)
    buf.seal()
    assert not isinstance(buf.groups[1].samples, KeptSamples)
    assert isinstance(buf.groups[2].samples, KeptSamples)
