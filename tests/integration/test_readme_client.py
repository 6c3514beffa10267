"""The README's client loop, run byte for byte against a real ``rolloutd serve``: it trains its
ten steps, checkpoints with tags, and ends by itself.

The snippet reads its endpoints from ``ENDPOINTS`` (default ``localhost:50051``, where
``make run`` serves); the test sets that variable to the service it started on a free port, so
that nothing in the snippet is rewritten.
"""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

import pytest

from rolloutd.checkpoint.store import SnapshotStore
from tests.integration.proc import ServeProcess

pytestmark = pytest.mark.process

README = Path(__file__).parents[2] / "README.md"


def client_snippet() -> str:
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    (snippet,) = [b for b in blocks if "RolloutClient(" in b]
    return snippet


def test_the_readme_loop_runs_as_written_and_ends(tmp_path: Path, monkeypatch) -> None:
    snippet = client_snippet()
    assert 'os.environ.get("ENDPOINTS", "localhost:50051")' in snippet
    serve = ServeProcess.synthetic(tmp_path / "ck", "--checkpoint-interval", "0", cwd=tmp_path)
    try:
        monkeypatch.setenv("ENDPOINTS", serve.wait_listening())
        out = io.StringIO()
        namespace: dict[str, object] = {"__name__": "__main__"}
        with contextlib.redirect_stdout(out):
            exec(compile(snippet, "README.md", "exec"), namespace)
    finally:
        assert serve.terminate() == 0, serve.output
    printed = out.getvalue()
    assert namespace["step"] == namespace["STEPS"] == 10
    assert [int(s) for s in re.findall(r"^step (\d+): \d+ groups$", printed, re.M)] == list(
        range(1, 11)
    )
    assert "prompt " in printed and "(trainer checkpoint 10)" in printed
    tags = {m.tag for m in SnapshotStore(str(tmp_path / "ck")).list()}
    assert {"step-5", "step-10"} <= tags
