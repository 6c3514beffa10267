"""Prompt files: a bad row is named by the number an editor shows, counted from 1."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rolloutd.dataset import DatasetError, load_prompts


def test_a_jsonl_problem_names_its_line_as_an_editor_counts_it(tmp_path: Path):
    path = tmp_path / "prompts.jsonl"
    path.write_text('{"prompt": "one"}\n\n{"id": "x"}\n')  # the blank line counts
    with pytest.raises(DatasetError, match=r"prompts\.jsonl: line 3 has neither 'prompt'"):
        load_prompts(str(path))
    path.write_text('{"prompt": "one"}\n{"prompt": \n')
    with pytest.raises(DatasetError, match=r"line 2 is not JSON"):
        load_prompts(str(path))


def test_a_parquet_problem_names_its_row_from_1(tmp_path: Path):
    path = tmp_path / "prompts.parquet"
    pq.write_table(pa.table({"prompt": ["one", "  "]}), path)
    with pytest.raises(DatasetError, match=r"prompts\.parquet: row 2: 'prompt' must be non-empty"):
        load_prompts(str(path))


def test_a_prompt_without_an_id_is_named_by_its_position_from_0(tmp_path: Path):
    path = tmp_path / "prompts.jsonl"
    path.write_text("\n".join(json.dumps({"prompt": p}) for p in ("a", "b")) + "\n")
    prompts, _ = load_prompts(str(path))
    assert [p.prompt_id for p in prompts] == ["0", "1"]


def test_a_rows_tools_are_a_list_of_objects_in_jsonl_and_parquet(tmp_path: Path):
    tools = [{"type": "function", "function": {"name": "calc"}}]
    path = tmp_path / "prompts.jsonl"
    path.write_text(json.dumps({"prompt": "a", "tools": tools}) + "\n" + '{"prompt": "b"}\n')
    prompts, _ = load_prompts(str(path))
    assert [list(p.tools) for p in prompts] == [tools, []]
    table = tmp_path / "prompts.parquet"
    pq.write_table(pa.table({"prompt": ["a", "b"], "tools": [tools, None]}), table)
    prompts, _ = load_prompts(str(table))
    assert [list(p.tools) for p in prompts] == [tools, []]
    for bad, problem in (
        ({"name": "calc"}, "must be a list of JSON objects"),
        ([{"name": "calc"}, "calc"], "item 1 must be a JSON object"),
        ([{"description": "x" * 100}], "121 bytes as JSON, more than limits.max_metadata_bytes=50"),
    ):
        path.write_text('{"prompt": "a"}\n' + json.dumps({"prompt": "b", "tools": bad}) + "\n")
        with pytest.raises(DatasetError, match=rf"line 2: 'tools' {problem}"):
            load_prompts(str(path), max_tools_bytes=50)
