"""``rolloutd serve``'s allocator settings, in a fresh interpreter each (they are process-wide)."""

from __future__ import annotations

import platform
import subprocess
import sys

import pytest

CHURN = """
import resource, sys
from rolloutd import cli
if sys.argv[1] == "keep":
    cli._keep_freed_memory()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(10):
    queued = [b"x" * 2**20 for _ in range(32)]  # a push's queue of 1 MiB chunks, then drained
    del queued
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def page_faults(mode: str) -> int:
    out = subprocess.run(
        [sys.executable, "-c", CHURN, mode], capture_output=True, text=True, check=True
    )
    return int(out.stdout)


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's allocator settings")
def test_chunks_reuse_freed_pages_instead_of_faulting_in_new_ones():
    default, kept = page_faults("default"), page_faults("keep")
    # 10 rounds of 32 MiB: each round faults its 8,192 pages in again by default, once when kept.
    assert default > 40_000, default
    assert kept < default / 4, (kept, default)


def _trainer_token(argv: list[str]) -> str | None:
    from rolloutd import cli

    parser = cli._parser()
    args = parser.parse_args(["trainer", *argv])
    return cli._trainer_token(args, parser)


def test_the_trainer_takes_its_token_from_a_file_or_the_environment(tmp_path, monkeypatch):
    """Not only from the command line, which `ps` shows every user of the machine."""
    monkeypatch.delenv("ROLLOUTD_AUTH__TOKEN", raising=False)
    assert _trainer_token([]) is None
    monkeypatch.setenv("ROLLOUTD_AUTH__TOKEN", "from-env\n")
    assert _trainer_token([]) == "from-env"
    (tmp_path / "token").write_text("from-file\n")
    assert _trainer_token(["--token-file", str(tmp_path / "token")]) == "from-file"
    assert _trainer_token(["--token", "from-flag"]) == "from-flag"
    for argv in (
        ["--token-file", str(tmp_path / "missing")],
        ["--token", "a", "--token-file", "b"],
    ):
        with pytest.raises(SystemExit):
            _trainer_token(argv)
