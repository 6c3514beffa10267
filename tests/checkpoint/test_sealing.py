"""The live buffer seals committed rows into Arrow batches once enough of them wait as objects."""

from __future__ import annotations

from array import array
from dataclasses import replace

from rolloutd.checkpoint.segments import ArrowSealer
from rolloutd.domain.buffer import SEAL_HELD_ROWS, SEAL_HELD_VALUES, SEAL_ROWS, RolloutBuffer
from rolloutd.domain.group import Group, GroupMeta, GroupState, KeptSamples, Prompt, Sample


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
    buf.finish(gid)
    buf.commit(gid, float(gid))
    return samples


def _sealed(buf: RolloutBuffer) -> list[int]:
    return [gid for gid, g in buf.groups.items() if isinstance(g.samples, KeptSamples)]


def test_the_oldest_rows_are_sealed_once_the_buffer_holds_too_many_as_objects():
    buf = RolloutBuffer(ArrowSealer())
    size = 8
    held = SEAL_HELD_ROWS // size
    made = {gid: _commit(buf, gid, size, tokens=3) for gid in range(1, held)}
    buf.remove(1, GroupState.EVICTED)  # a group that leaves is no longer held
    made[held] = _commit(buf, held, size, tokens=3)
    assert not _sealed(buf)
    made[held + 1] = _commit(buf, held + 1, size, tokens=3)  # SEAL_HELD_ROWS rows held now
    oldest = list(range(2, 2 + SEAL_ROWS // size))
    assert _sealed(buf) == oldest  # one batch of the oldest, whole groups
    del made[1]
    assert {gid: g.ordered_samples() for gid, g in buf.groups.items()} == made
    state = buf.capture()
    assert len(state.new_rows) == (held - len(oldest)) * size
    assert len(state.new_sealed_ids) == SEAL_ROWS


def test_long_samples_are_sealed_after_fewer_rows():
    buf = RolloutBuffer(ArrowSealer())
    tokens = SEAL_HELD_VALUES // 16  # a row holds 2 x tokens values (+2 prompt ids): eight reach it
    _commit(buf, 1, 4, tokens)
    assert not _sealed(buf)
    _commit(buf, 2, 4, tokens)
    assert _sealed(buf) == [1]  # the oldest group alone holds SEAL_VALUES


def test_without_a_sealer_rows_stay_objects():
    buf = RolloutBuffer()
    for gid in range(1, SEAL_HELD_ROWS // 8 + 2):
        _commit(buf, gid, 8, tokens=1)
    assert not any(isinstance(g.samples, KeptSamples) for g in buf.groups.values())


def test_a_group_with_a_resumed_sibling_stays_objects():
    """Where a sibling was resumed is not a column: sealing it would lose that record."""
    buf = RolloutBuffer(ArrowSealer())
    buf.add(Group(GroupMeta(1, Prompt("p1", "q"), None, 2, 0, 0.0, 1)))
    plain = Sample(0, array("i", [1]), array("f", [0.0]), "x", "stop", 0, array("i"), 0, 0.0, 0.0)
    buf.stage(1, plain)
    buf.stage(1, replace(plain, index=1, resumed_at=1))
    buf.finish(1)
    buf.commit(1, 0.0)
    _commit(buf, 2, 2, tokens=1)
    buf.seal()
    assert not isinstance(buf.groups[1].samples, KeptSamples)
    assert isinstance(buf.groups[2].samples, KeptSamples)
