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
