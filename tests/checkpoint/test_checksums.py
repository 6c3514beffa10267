"""Checksums, whole and in parts, and the arrival of what they have read."""

from __future__ import annotations

import os
import zlib
from concurrent.futures import ThreadPoolExecutor

import pytest
from zlib_ng import zlib_ng

from rolloutd.checkpoint.checksums import (
    ARRIVAL_STEP,
    Arrival,
    ChecksumAlgorithm,
    Hasher,
    arrival_for,
    checksum_of,
    checksum_parts,
    checksum_started,
)
from rolloutd.checkpoint.format import FormatError
from rolloutd.checkpoint.manifest import FileEntry


def test_checksums_name_their_algorithm():
    assert checksum_of(b"rolloutd") == f"crc32:{zlib.crc32(b'rolloutd'):08x}"
    sha = checksum_of(b"", ChecksumAlgorithm.SHA256)
    assert sha == "sha256:e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"
    with pytest.raises(FormatError):
        FileEntry.from_json({"path": "x", "size": 1, "checksum": "md4:00"})


def test_a_checksum_in_parts_is_the_checksum_of_the_whole():
    data = memoryview(os.urandom(100_003))
    with ThreadPoolExecutor(3) as pool:
        for parts in (1, 2, 3, 7):
            assert checksum_parts(data, ChecksumAlgorithm.CRC32, parts, pool) == checksum_of(data)
        sha = checksum_parts(data, ChecksumAlgorithm.SHA256, 3, pool)
        assert sha == checksum_of(data, ChecksumAlgorithm.SHA256)
        flipped = bytearray(data)
        flipped[-1] ^= 1  # a bit flipped in the last part changes the combined value
        assert checksum_parts(memoryview(flipped), ChecksumAlgorithm.CRC32, 3, pool) != (
            checksum_of(data)
        )
    assert zlib_ng.crc32_combine(zlib.crc32(b"ab"), zlib.crc32(b"cde"), 3) == zlib.crc32(b"abcde")


def test_arrival_is_the_prefix_every_part_before_has_finished():
    data = memoryview(os.urandom(3 * ARRIVAL_STEP + 5))
    with ThreadPoolExecutor(3) as pool:
        for parts in (1, 3):
            arrival = arrival_for(len(data), ChecksumAlgorithm.CRC32, parts)
            result = checksum_started(data, ChecksumAlgorithm.CRC32, parts, pool, arrival)
            arrival.wait(len(data) + 1)  # beyond the end: returns once all of it arrived
            assert arrival.through() == len(data)
            assert result() == checksum_of(data)
    arrival = Arrival([10, 10, 10])
    arrival.advance(1, 10)  # a later part done first does not count
    assert arrival.through() == 0
    arrival.advance(0, 10)
    arrival.advance(2, 4)
    assert arrival.through() == 24


def test_a_waiter_wakes_when_the_part_it_needs_arrives():
    arrival = Arrival([100])
    with ThreadPoolExecutor(1) as pool:
        waiting = pool.submit(arrival.wait, 60)
        arrival.advance(0, 30)
        assert not waiting.done()  # 30 of the 60 bytes it waits for
        arrival.advance(0, 60)
        waiting.result(timeout=30)


def test_a_failing_checksum_still_reports_its_part_done(monkeypatch):
    def fail(self: Hasher, data: memoryview) -> None:
        raise OSError("read failed")

    monkeypatch.setattr(Hasher, "update", fail)
    data = memoryview(os.urandom(2 * ARRIVAL_STEP))
    arrival = arrival_for(len(data), ChecksumAlgorithm.CRC32, 2)
    with ThreadPoolExecutor(2) as pool:
        result = checksum_started(data, ChecksumAlgorithm.CRC32, 2, pool, arrival)
        arrival.wait(len(data))  # would hang if a part that raised never said it was done
        with pytest.raises(OSError, match="read failed"):
            result()
