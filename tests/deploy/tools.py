"""Finding the command-line tools the deployment tests run (installed by the dev extra or apt)."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).parents[2]


def tool(name: str, install: str) -> str:
    """The tool's path, from the virtualenv first, else PATH; skips the test when it is missing."""
    beside_python = Path(sys.executable).parent / name
    if beside_python.exists():
        return str(beside_python)
    found = shutil.which(name)
    if found is None:
        pytest.skip(f"{name} is not installed ({install})")
    return found
