"""The snapshot store, each test on a local directory and on S3 served by moto."""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import resource
import signal
import subprocess
from dataclasses import replace

import pyarrow as pa
import pytest

from rolloutd.checkpoint import segments
from rolloutd.checkpoint.backends import CorruptSnapshot, StoreError
from rolloutd.checkpoint.journal import CorruptJournal
from rolloutd.checkpoint.manifest import next_manifest
from rolloutd.checkpoint.reader import SnapshotNotFound
from rolloutd.checkpoint.resolver import LATEST
from rolloutd.checkpoint.retention import keep_tagged, plan_compaction
from rolloutd.checkpoint.rows import SAMPLE_SCHEMA, rows_to_batches, rows_to_table
from rolloutd.checkpoint.store import SnapshotStore
from tests.checkpoint.helpers import (
    Location,
    journal_write,
    live,
    make_rows,
    publish,
    read_rows,
    read_sidecar,
    verify,
    write_sidecar,
)


def test_round_trip(location: Location):
    store = location.open()
    rows = make_rows(0, 120)
    state = {"cursor": [0, 17], "ledger": {"3": "committed"}, "text": "\u00e9"}
    manifest = publish(store, None, rows, state=state, tag="t", trainer_step=5, acks_through=0)

    reopened = location.open()
    assert reopened.sequences() == [1]
    assert reopened.list() == [manifest]
    assert reopened.load(1) == manifest
    assert verify(reopened, manifest) == []
    resolution = reopened.resolve(LATEST)
    assert resolution.skipped == []
    assert resolution.snapshot is not None
    assert resolution.snapshot.manifest == manifest
    assert resolution.snapshot.rows() == rows
    assert resolution.snapshot.sidecar == state
    assert resolution.snapshot.table().equals(rows_to_table(rows))
    assert read_rows(reopened, manifest) == rows
    assert read_sidecar(reopened, manifest) == state


def test_file_url_is_the_local_directory(tmp_path):
    manifest = publish(SnapshotStore(f"file://{tmp_path}/store"), None, make_rows(0, 5))
    plain = SnapshotStore(str(tmp_path / "store"))
    assert plain.list() == [manifest]
    assert read_rows(plain, manifest) == make_rows(0, 5)


def test_empty_store_resolves_to_nothing(location: Location):
    store = location.open()
    assert store.sequences() == [] and store.list() == []
    resolution = store.resolve()
    assert resolution.snapshot is None and resolution.skipped == []
    with pytest.raises(SnapshotNotFound):
        store.resolve(3)
    with pytest.raises(SnapshotNotFound):
        store.load(3)


def test_segments_are_plain_arrow_ipc(location: Location):
    store = location.open()
    manifest = publish(store, None, make_rows(0, 10))
    data = location.read(manifest.segments[0].file.path)
    table = pa.ipc.open_file(pa.BufferReader(data)).read_all()
    assert table.schema == SAMPLE_SCHEMA
    assert table.column("row_id").to_pylist() == list(range(10))


def test_a_segment_reaches_the_sink_in_chunks_with_arrows_own_bytes(location: Location):
    """Arrow gathers its buffers before they reach the checksum and the sink: a handful of
    writes per segment, not one per column buffer, and the file is byte for byte what Arrow
    writes on its own."""
    store = location.open()
    rows = make_rows(0, 3000)
    writes: list[int] = []
    original = segments.SegmentWriter.write

    def counted(self: segments.SegmentWriter, data: object) -> int:
        writes.append(original(self, data))
        return writes[-1]

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(segments.SegmentWriter, "write", counted)
        manifest = publish(store, None, rows)
    expected = pa.BufferOutputStream()
    with pa.ipc.new_file(expected, SAMPLE_SCHEMA) as writer:
        for batch in rows_to_batches(rows):
            writer.write_batch(batch)
    data = location.read(manifest.segments[0].file.path)
    assert data == expected.getvalue().to_pybytes()
    assert sum(writes) == len(data) == manifest.segments[0].file.size
    assert len(writes) <= len(data) // segments.WRITE_CHUNK + 2


def test_incremental_snapshots_share_segments(location: Location):
    store = location.open()
    first_rows, second_rows = make_rows(0, 100), make_rows(100, 50)
    first = publish(store, None, first_rows)
    second = publish(store, first, second_rows, removed=[3, 4, 120])

    assert second.segments[0].file == first.segments[0].file
    assert second.segments[0].removed.ids().tolist() == [3, 4]
    assert second.segments[1].removed.ids().tolist() == [120]
    assert second.written_bytes == second.segments[1].file.size + second.sidecar.size
    assert (second.new_rows, second.removed_rows, second.live_rows) == (50, 3, 147)
    assert read_rows(store, second) == live(first_rows + second_rows, [3, 4, 120])
    assert read_rows(store, first) == first_rows


def test_segment_without_live_rows_is_dropped(location: Location):
    store = location.open()
    first = publish(store, None, make_rows(0, 10))
    second = publish(store, first, make_rows(10, 5), removed=range(10))
    assert [s.written_by for s in second.segments] == [2]
    assert read_rows(store, second) == make_rows(10, 5)
    third = publish(store, second, removed=range(10, 15))
    assert third.segments == () and third.live_rows == 0
    assert store.resolve().snapshot.rows() == []  # type: ignore[union-attr]


def test_unpublished_snapshot_is_invisible(location: Location):
    store = location.open()
    first = publish(store, None, make_rows(0, 10))
    segment = store.write_segment(2, make_rows(10, 10))
    sidecar = write_sidecar(store, 2, {"x": 1})
    assert store.sequences() == [1]
    assert store.resolve().snapshot.manifest == first  # type: ignore[union-attr]
    second = next_manifest(first, sequence=2, created_at=0.0, sidecar=sidecar, new_segment=segment)
    store.publish(second)
    assert store.sequences() == [2, 1]
    with pytest.raises(ValueError, match="not after"):
        store.publish(replace(second, sequence=2))


def test_truncated_segment_is_skipped_and_restore_falls_back(location: Location):
    store = location.open()
    first = publish(store, None, make_rows(0, 50))
    second = publish(store, first, make_rows(50, 50))
    path = second.segments[1].file.path
    location.truncate(path, second.segments[1].file.size // 2)

    problems = verify(store, second)
    assert len(problems) == 1 and path in problems[0] and "truncated" in problems[0]
    resolution = location.open().resolve()
    assert resolution.snapshot is not None
    assert resolution.snapshot.manifest == first
    assert [(s.sequence, path in s.reason) for s in resolution.skipped] == [(2, True)]
    assert "truncated" in resolution.skipped[0].reason
    with pytest.raises(CorruptSnapshot, match="truncated"):
        read_rows(store, second)


@pytest.mark.parametrize("part", ["new segment", "shared segment", "sidecar"])
def test_bit_flip_is_detected(location: Location, part: str):
    store = location.open()
    first = publish(store, None, make_rows(0, 50))
    second = publish(store, first, make_rows(50, 50), removed=[1])
    entry = {
        "new segment": second.segments[1].file,
        "shared segment": second.segments[0].file,
        "sidecar": second.sidecar,
    }[part]
    location.flip_bit(entry.path)

    assert [p.split(":")[0] for p in verify(store, second)] == [entry.path]
    assert "checksum" in verify(store, second)[0]
    resolution = store.resolve()
    if part == "shared segment":  # both snapshots list it: nothing verifies
        assert resolution.snapshot is None
        assert [s.sequence for s in resolution.skipped] == [2, 1]
    else:
        assert resolution.snapshot is not None and resolution.snapshot.manifest == first
        assert [s.sequence for s in resolution.skipped] == [2]
        assert "checksum" in resolution.skipped[0].reason


def test_damaged_manifest_is_skipped(location: Location):
    store = location.open()
    first = publish(store, None, make_rows(0, 10))
    publish(store, first, make_rows(10, 10))
    location.flip_bit("manifests/00000000000000000002.json", 40)
    assert store.sequences() == [2, 1]
    assert [m.sequence for m in store.list()] == [1]
    with pytest.raises(CorruptSnapshot):
        store.load(2)
    resolution = store.resolve()
    assert resolution.snapshot is not None and resolution.snapshot.manifest == first
    assert resolution.skipped[0].sequence == 2 and "manifest" in resolution.skipped[0].reason


def test_missing_file_is_reported(location: Location):
    store = location.open()
    manifest = publish(store, None, make_rows(0, 10))
    location.fs().rm(location.full(manifest.sidecar.path))
    assert store.check_sizes(manifest) == [f"{manifest.sidecar.path}: missing"]
    assert store.resolve().skipped[0].reason == f"{manifest.sidecar.path}: missing"


def test_resolve_by_sequence_and_tag(location: Location):
    store = location.open()
    m1 = publish(store, None, make_rows(0, 5), tag="step-10", trainer_step=10)
    m2 = publish(store, m1, make_rows(5, 5))
    m3 = publish(store, m2, make_rows(10, 5), tag="step-20", trainer_step=20)
    assert store.resolve(2).snapshot.manifest == m2  # type: ignore[union-attr]
    assert store.resolve("2").snapshot.manifest == m2  # type: ignore[union-attr]
    assert store.resolve("step-10").snapshot.manifest == m1  # type: ignore[union-attr]
    assert store.resolve("step-20").snapshot.manifest == m3  # type: ignore[union-attr]
    with pytest.raises(SnapshotNotFound, match="step-30"):
        store.resolve("step-30")
    location.flip_bit(m2.sidecar.path)
    resolution = store.resolve(2)  # falls back to an older snapshot, whatever its tag
    assert resolution.snapshot.manifest == m1  # type: ignore[union-attr]
    assert [s.sequence for s in resolution.skipped] == [2]


def _stored(location: Location) -> set[str]:
    return {f"{d}/{n}" for d in ("segments", "sidecars") for n in location.listdir(d)}


def test_retention_keeps_latest_and_tagged(location: Location):
    store = location.open()
    manifests = []
    parent = None
    for i in range(6):
        tag, step = (f"step-{i}", i) if i in (1, 3) else ("", None)
        rows = make_rows(i * 10, 10)
        parent = publish(store, parent, rows, removed=[i * 10 - 1], tag=tag, trainer_step=step)
        manifests.append(parent)

    result = store.retire(keep_latest=2, keep=keep_tagged(min_trainer_step=2))
    assert sorted(result.kept) == [4, 5, 6]
    assert result.retired == (3, 2, 1)
    assert store.sequences() == [6, 5, 4]
    referenced = {e.path for m in manifests[3:] for e in m.files()}
    assert _stored(location) == referenced
    assert location.listdir("trash") == []
    for manifest in manifests[3:]:
        assert verify(store, manifest) == []
    # segment 1 is listed by every kept snapshot, so it is still there
    assert manifests[0].segments[0].file.path in referenced
    assert read_rows(store, manifests[5])[:9] == make_rows(0, 9)

    result = store.retire(keep_latest=1, keep=keep_tagged())
    assert sorted(result.kept) == [4, 6]
    with pytest.raises(ValueError):
        store.retire(keep_latest=0)


def test_retire_collects_leftovers_but_not_a_snapshot_in_progress(location: Location):
    store = location.open()
    first = publish(store, None, make_rows(0, 10))
    orphan = store.write_segment(2, make_rows(10, 10))  # a crashed attempt at snapshot 2
    second = publish(store, first, make_rows(10, 10))
    in_progress = store.write_segment(3, make_rows(20, 10))
    store.retire(keep_latest=2)
    stored = _stored(location)
    assert orphan.file.path not in stored
    assert in_progress.file.path in stored
    assert {e.path for e in second.files()} | {e.path for e in first.files()} <= stored


def test_retire_deletes_nothing_while_a_kept_manifest_is_unreadable(location: Location):
    store = location.open()
    first = publish(store, None, make_rows(0, 10))
    second = publish(store, first, make_rows(10, 10), removed=range(10))
    third = publish(store, second, make_rows(20, 10))
    location.flip_bit("manifests/00000000000000000003.json", 40)
    before = _stored(location)
    result = store.retire(keep_latest=1)
    assert result.deleted_files == 0 and _stored(location) == before
    assert 3 in store.sequences()
    assert store.resolve().snapshot.manifest == second  # type: ignore[union-attr]
    assert third.sequence not in result.kept


def test_journal_is_ordered_durable_and_pruned(location: Location):
    store = location.open()
    positions = [journal_write(store.journal, {"lease": f"l{i}", "step": i}) for i in range(1, 6)]
    assert positions == [1, 2, 3, 4, 5]
    reopened = location.open()
    assert reopened.journal.position == 5
    assert [e.record["lease"] for e in reopened.journal.read(0)] == ["l1", "l2", "l3", "l4", "l5"]
    assert [e.position for e in reopened.journal.read(3)] == [4, 5]

    first = publish(reopened, None, make_rows(0, 5), acks_through=3)
    for i in range(6, 9):
        journal_write(reopened.journal, {"lease": f"l{i}"})
    second = publish(reopened, first, make_rows(5, 5), acks_through=7)
    reopened.retire(keep_latest=2)
    assert [e.position for e in reopened.journal.read(first.acks_through)] == [4, 5, 6, 7, 8]
    reopened.retire(keep_latest=1)
    assert [e.position for e in reopened.journal.read(second.acks_through)] == [8]
    with pytest.raises(CorruptJournal, match="missing"):
        reopened.journal.read(0)

    # positions continue after everything was pruned and the process restarted
    third = publish(reopened, second, acks_through=8)
    reopened.retire(keep_latest=1)
    again = location.open()
    assert again.journal.position == 8
    assert journal_write(again.journal, {"lease": "l9"}) == 9
    assert [e.record for e in again.journal.read(third.acks_through)] == [{"lease": "l9"}]


def journal_files(location: Location) -> list[str]:
    return [n for n in location.listdir("journal") if n.endswith(".jsonl")]


def test_journal_ignores_a_torn_tail(tmp_path):
    location = Location(str(tmp_path / "store"))
    store = location.open()
    journal_write(store.journal, {"n": 1})
    journal_write(store.journal, {"n": 2})
    (name,) = journal_files(location)
    with open(os.path.join(location.url, "journal", name), "ab") as f:
        f.write(b'{"position":3,"rec')  # the process died inside write(2)
    reopened = location.open()
    assert reopened.journal.position == 2
    assert journal_write(reopened.journal, {"n": 3}) == 3
    assert [e.record["n"] for e in reopened.journal.read()] == [1, 2, 3]


def test_journal_damage_before_the_tail_is_an_error(tmp_path):
    location = Location(str(tmp_path / "store"))
    store = location.open()
    for n in range(3):
        journal_write(store.journal, {"n": n})
    (name,) = journal_files(location)
    path = os.path.join(location.url, "journal", name)
    with open(path, "rb") as f:
        lines = f.read().split(b"\n")
    lines[1] = b"\0" * len(lines[1])
    with open(path, "wb") as f:
        f.write(b"\n".join(lines))
    with pytest.raises(CorruptJournal, match="repair-journal"):
        store.journal.read()
    location.open()  # damage is left to the replay that needs what it held


def test_journal_reads_records_written_before_they_were_framed(tmp_path):
    location = Location(str(tmp_path / "store"))
    legacy = b"".join(
        json.dumps({"position": n, "record": {"n": n}}, separators=(",", ":")).encode() + b"\n"
        for n in (1, 2)
    )
    (tmp_path / "store" / "journal").mkdir(parents=True)
    location.write(f"journal/{1:020d}-{0:020d}-0000.jsonl", legacy)
    store = location.open()
    assert store.journal.position == 2
    assert journal_write(store.journal, {"n": 3}) == 3
    assert [e.record["n"] for e in store.journal.read()] == [1, 2, 3]
    assert store.journal.check().problems == []


def test_a_changed_byte_in_the_journal_is_found_and_set_aside(location: Location):
    store = location.open()
    for n in range(3):
        journal_write(store.journal, {"n": n})
    first = journal_files(location)[0]
    location.flip_bit(f"journal/{first}", 30)  # inside the first record's payload
    with pytest.raises(CorruptJournal, match=r"offset 0 hold no whole record \(checksum"):
        location.open().journal.read()
    [problem] = location.open().journal.check().problems
    assert f"journal/{first}" in problem

    moved, kept, cut = location.open().journal.repair() or ((), -1, -1)
    assert moved[0] == f"journal/{first}" and (kept, cut) == (0, 2)
    assert location.listdir("journal-damaged")[0] == first
    reopened = location.open()
    assert reopened.journal.read() == [] and reopened.journal.check().problems == []
    assert journal_write(reopened.journal, {"n": 3}) == 1
    assert [e.record for e in location.open().journal.read()] == [{"n": 3}]


def test_a_torn_tail_is_logged_and_reported_lost_when_it_was_acknowledged(tmp_path, caplog):
    location = Location(str(tmp_path / "store"))
    store = location.open()
    for n in range(3):
        journal_write(store.journal, {"n": n})
    [name] = journal_files(location)
    data = location.read(f"journal/{name}")
    location.write(f"journal/{name}", data[:-10])
    with caplog.at_level(logging.WARNING, logger="rolloutd.checkpoint.journal"):
        assert [e.record["n"] for e in location.open().journal.read()] == [0, 1]
    start = data.rindex(b"\n", 0, len(data) - 1) + 1
    torn = f"journal/{name}: {len(data) - 10 - start} bytes at offset {start} hold no whole"
    assert any(torn in r.getMessage() and "torn tail" in r.getMessage() for r in caplog.records)
    assert any(
        r.levelno == logging.ERROR and "positions 3 to 3 were acknowledged" in r.getMessage()
        for r in caplog.records
    )
    assert location.open().journal.check().problems == [
        "journal: positions 3 to 3 were acknowledged (journal/acknowledged) but are not in the "
        "journal"
    ]


def test_compaction_merges_segments_and_drops_removed_rows(location: Location):
    store = location.open()
    parent = None
    all_rows, removed = [], []
    for i in range(6):
        rows = make_rows(i * 20, 20)
        gone = [i * 20 - 3, i * 20 - 7] if i else []
        parent = publish(store, parent, rows, removed=gone)
        all_rows += rows
        removed += gone
    assert parent is not None and len(parent.segments) == 6
    expected = live(all_rows, removed)

    compacted = store.compact(parent)
    assert compacted.sequence == parent.sequence
    (merged,) = compacted.segments
    assert merged.rows == len(expected) and not merged.removed and merged.written_by == 6
    next_ = next_manifest(
        compacted, sequence=7, created_at=0.0, sidecar=parent.sidecar, removed=[0]
    )
    store.publish(next_)
    assert verify(store, next_) == []
    assert read_rows(store, next_) == expected[1:]
    store.retire(keep_latest=1)
    assert _stored(location) == {merged.file.path, parent.sidecar.path}


def test_plan_compaction_picks_the_smallest_segments(location: Location):
    store = location.open()
    parent = publish(store, None, make_rows(0, 200))
    for i in range(1, 6):
        parent = publish(store, parent, make_rows(200 + i * 10, i))
    assert plan_compaction(parent, max_segments=8) == ()
    chosen = plan_compaction(parent, max_segments=4)
    assert len(chosen) == 6 - 2 + 1
    assert parent.segments[0] not in chosen
    compacted = store.compact(parent, chosen)
    assert len(compacted.segments) == 2
    assert store.open(compacted).rows() == read_rows(store, parent)
    stranger = replace(chosen[0], file=replace(chosen[0].file, path="segments/nope.arrow"))
    with pytest.raises(ValueError, match="lists"):
        store.compact(parent, [stranger])


def test_compaction_of_a_corrupt_segment_raises(location: Location):
    store = location.open()
    first = publish(store, None, make_rows(0, 20))
    second = publish(store, first, make_rows(20, 20))
    location.flip_bit(first.segments[0].file.path)
    with pytest.raises(CorruptSnapshot) as caught:
        store.compact(second)
    assert isinstance(caught.value, OSError)


def test_sha256_checksums(location: Location):
    from rolloutd.checkpoint.checksums import ChecksumAlgorithm

    store = SnapshotStore(location.url, location.options, checksum=ChecksumAlgorithm.SHA256)
    manifest = publish(store, None, make_rows(0, 10))
    assert all(e.checksum.startswith("sha256:") for e in manifest.files())
    assert verify(location.open(), manifest) == []  # the reader follows the manifest


# --- I/O errors surface as OSError ------------------------------------------------------------


def test_store_under_a_regular_file_raises_oserror(tmp_path):
    (tmp_path / "file").write_text("not a directory")
    with pytest.raises(NotADirectoryError):
        SnapshotStore(str(tmp_path / "file" / "store"))  # opening lists the journal
    store = SnapshotStore(str(tmp_path / "store"))
    os.rename(tmp_path / "file", tmp_path / "store")  # the directory is replaced under the store
    with pytest.raises(NotADirectoryError):
        store.write_segment(1, make_rows(0, 5))
    with pytest.raises(NotADirectoryError):
        write_sidecar(store, 1, {})
    with pytest.raises(NotADirectoryError):
        journal_write(store.journal, {"x": 1})
    with pytest.raises(NotADirectoryError):
        store.resolve()


def test_file_size_limit_raises_oserror_and_leaves_no_file(tmp_path):
    """RLIMIT_FSIZE fails writes with EFBIG even for root, like a full disk does with ENOSPC."""
    store = SnapshotStore(str(tmp_path / "store"))
    first = publish(store, None, make_rows(0, 5))
    rows = make_rows(5, 2000, max_tokens=400)
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    previous = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (256 << 10, hard))
    try:
        with pytest.raises(OSError) as caught:
            store.write_segment(2, rows)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, previous)
    assert caught.value.errno == errno.EFBIG
    assert os.listdir(tmp_path / "store" / "tmp") == []
    assert store.resolve().snapshot.manifest == first  # type: ignore[union-attr]


@contextlib.contextmanager
def _immutable(path):
    if subprocess.run(["chattr", "+i", str(path)], capture_output=True).returncode:
        pytest.skip("chattr +i is not available here")
    try:
        yield
    finally:
        subprocess.run(["chattr", "-i", str(path)], check=True)


def test_read_only_directory_raises_permission_error(tmp_path):
    """An immutable directory refuses new entries even to root (chmod does not)."""
    store = SnapshotStore(str(tmp_path / "store"))
    first = publish(store, None, make_rows(0, 5))
    with _immutable(tmp_path / "store" / "tmp"):
        with pytest.raises(PermissionError):
            store.write_segment(2, make_rows(5, 5))
        with pytest.raises(PermissionError):
            write_sidecar(store, 2, {})
    with _immutable(tmp_path / "store" / "manifests"):
        sidecar = write_sidecar(store, 2, {})
        second = next_manifest(first, sequence=2, created_at=0.0, sidecar=sidecar)
        with pytest.raises(PermissionError):
            store.publish(second)
    assert store.sequences() == [1]


def test_full_filesystem_raises_enospc(tmp_path):
    mount = tmp_path / "tiny"
    mount.mkdir()
    if subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount)], capture_output=True
    ).returncode:
        pytest.skip("cannot mount a tmpfs here")
    try:
        store = SnapshotStore(str(mount / "store"))
        first = publish(store, None, make_rows(0, 5))
        with pytest.raises(OSError) as caught:
            store.write_segment(2, make_rows(5, 3000, max_tokens=400))
        assert caught.value.errno == errno.ENOSPC
        assert store.resolve().snapshot.manifest == first  # type: ignore[union-attr]
        assert os.listdir(mount / "store" / "tmp") == []
    finally:
        subprocess.run(["umount", str(mount)], check=True)


@pytest.mark.s3
def test_unreachable_object_store_raises_oserror():
    options = {
        "endpoint_url": "http://127.0.0.1:9",
        "key": "k",
        "secret": "s",
        "config_kwargs": {"connect_timeout": 1, "retries": {"max_attempts": 1}},
        "skip_instance_cache": True,
    }
    with pytest.raises(StoreError):
        SnapshotStore("s3://nowhere/prefix", options)
