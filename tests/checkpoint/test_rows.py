"""Sample rows to Arrow and back."""

from __future__ import annotations

import dataclasses
from array import array

import numpy as np
import pyarrow as pa

from rolloutd.checkpoint.rows import SAMPLE_SCHEMA, rows_to_batches, rows_to_table, table_to_rows
from tests.checkpoint.helpers import make_rows


def test_rows_round_trip_exactly():
    rows = make_rows(0, 200)
    table = rows_to_table(rows)
    assert table.schema == SAMPLE_SCHEMA
    assert table.num_rows == 200
    back = table_to_rows(table)
    assert back == rows
    for (_, _, sample), (_, _, original) in zip(back, rows, strict=True):
        assert sample.token_ids.typecode == "i" and sample.logprobs.typecode == "f"
        assert sample.prompt_token_ids.typecode == "i"
        assert sample.token_ids is not original.token_ids


def test_columns_hold_the_sample_values():
    rows = make_rows(10, 5)
    table = rows_to_table(rows)
    assert table.column("row_id").to_pylist() == [r[0] for r in rows]
    assert table.column("group_id").to_pylist() == [r[1] for r in rows]
    assert table.column("token_ids").to_pylist() == [list(r[2].token_ids) for r in rows]
    expected = np.concatenate([np.frombuffer(r[2].logprobs, np.float32) for r in rows])
    assert np.array_equal(table.column("logprobs").combine_chunks().values.to_numpy(), expected)
    assert table.column("text").to_pylist() == [r[2].text for r in rows]


def test_batches_are_bounded_by_rows_and_values():
    rows = make_rows(0, 100, max_tokens=40)
    by_rows = list(rows_to_batches(rows, batch_rows=16))
    assert [b.num_rows for b in by_rows] == [16] * 6 + [4]
    by_values = list(rows_to_batches(rows, batch_values=100))

    def values(batch):
        names = ("token_ids", "logprobs", "prompt_token_ids")
        return sum(len(batch.column(name).values) for name in names)

    assert all(values(b) <= 100 or b.num_rows == 1 for b in by_values)
    assert sum(b.num_rows for b in by_values) == 100
    assert table_to_rows(pa.Table.from_batches(by_values)) == rows
    assert [b.num_rows for b in rows_to_batches(rows, batch_values=1)] == [1] * 100


def test_sliced_and_combined_tables_decode():
    rows = make_rows(0, 50)
    table = rows_to_table(rows, batch_rows=7)
    assert table_to_rows(table.slice(5, 30)) == rows[5:35]
    assert table_to_rows(table.combine_chunks()) == rows


def test_empty_lists_and_no_rows():
    rows = make_rows(0, 30)
    empty = [r for r in rows if len(r[2].token_ids) == 0]
    assert empty, "the fixture should include a sample without tokens"
    assert table_to_rows(rows_to_table(empty)) == empty
    assert rows_to_table([]).num_rows == 0


def test_segment_file_opens_with_plain_pyarrow(tmp_path):
    rows = make_rows(0, 20)
    path = tmp_path / "seg.arrow"
    with pa.ipc.new_file(str(path), SAMPLE_SCHEMA) as writer:
        for batch in rows_to_batches(rows):
            writer.write_batch(batch)
    table = pa.ipc.open_file(str(path)).read_all()
    assert table.column("row_id").to_pylist() == list(range(20))


def test_samples_share_no_memory_with_the_table():
    rows = make_rows(0, 3, max_tokens=5)
    rows = [(0, 0, dataclasses.replace(rows[0][2], token_ids=array("i", [1, 2, 3])))]
    back = table_to_rows(rows_to_table(rows))
    back[0][2].token_ids[0] = 9
    assert rows[0][2].token_ids[0] == 1
