"""The README's client snippet, run as written against a real service until the dataset is done."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from rolloutd.checkpoint.store import SnapshotStore
from tests.integration.proc import ServeProcess

pytestmark = pytest.mark.process

README = Path(__file__).parents[2] / "README.md"
PROMPTS = 100


def _client_snippet() -> str:
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    (snippet,) = [b for b in blocks if "RolloutClient(" in b]
    return snippet


def test_the_readme_loop_consumes_an_exhausted_dataset_and_stops(tmp_path: Path) -> None:
    dataset = tmp_path / "prompts.jsonl"
    dataset.write_text(
        "".join(
            json.dumps({"id": f"q{i}", "prompt": f"question {i}"}) + "\n" for i in range(PROMPTS)
        )
    )
    serve = ServeProcess.synthetic(
        tmp_path / "ck", "--dataset", str(dataset), "--epochs", "1", "--group-size", "2",
        "--checkpoint-interval", "0", cwd=tmp_path,
    )  # fmt: skip
    try:
        address = serve.wait_listening()
        snippet, endpoints = re.subn(
            r"^ENDPOINTS = .*$", f"ENDPOINTS = [{address!r}]", _client_snippet(), flags=re.M
        )
        assert endpoints == 1, "the snippet names its endpoints in one ENDPOINTS line"
        seen: list[str] = []
        saved: list[int] = []
        namespace = {
            "train_on": lambda groups: seen.extend(g.prompt_id for g in groups),
            "save_trainer_checkpoint": saved.append,
        }
        exec(compile(snippet, "README.md", "exec"), namespace)
    finally:
        assert serve.terminate() == 0, serve.output
    assert sorted(seen) == sorted(f"q{i}" for i in range(PROMPTS))
    assert namespace["step"] >= 1 and saved
    tags = {m.tag for m in SnapshotStore(str(tmp_path / "ck")).list()}
    assert {f"step-{s}" for s in saved} <= tags
