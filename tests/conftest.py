from __future__ import annotations

import os

import pytest

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("OTEL_SDK_DISABLED", "true")


@pytest.fixture
def tmp_checkpoints(tmp_path):
    return str(tmp_path / "checkpoints")
