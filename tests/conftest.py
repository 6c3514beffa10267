from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import fsspec
import pytest
from moto.server import ThreadedMotoServer

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("OTEL_SDK_DISABLED", "true")
# vLLM's services in tests start without compiling the model (8-60 s a start on two cores; the
# tiny model decodes no faster compiled). The default, compiled, start is what `make run` does:
# tests/integration/test_make_run.py runs it without this (newcomer_env drops ROLLOUTD_*).
os.environ.setdefault("ROLLOUTD_ENGINE__VLLM__ENFORCE_EAGER", "true")


@pytest.fixture
def tmp_checkpoints(tmp_path):
    return str(tmp_path / "checkpoints")


@pytest.fixture(scope="session")
def tiny_model_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An ``engine.cache_dir`` holding the tiny model, built once for the session (a build takes
    6-7 CPU seconds, more than half a minute on two busy cores); tests only read it."""
    from rolloutd.engines.tiny_model import ensure_tiny_model

    cache = tmp_path_factory.mktemp("tiny-model-cache")
    ensure_tiny_model(cache)
    return cache


@pytest.fixture(scope="session")
def tiny_model(tiny_model_cache: Path) -> Path:
    """The session's tiny model (seed 0, the default spec)."""
    from rolloutd.engines.tiny_model import ensure_tiny_model

    return ensure_tiny_model(tiny_model_cache)


BUCKET = "rolloutd-test"


@pytest.fixture(scope="session")
def s3_options() -> Iterator[dict[str, object]]:
    """A moto S3 server on a free port of 127.0.0.1, with one bucket; its fsspec options. One for
    the whole session: moto keeps its buckets in process, so a second server would see them."""
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    options: dict[str, object] = {
        "endpoint_url": f"http://{host}:{port}",
        "key": "testing",
        "secret": "testing",
    }
    fsspec.filesystem("s3", **options, skip_instance_cache=True).mkdir(BUCKET)
    yield options
    server.stop()


_EXIT_STATUS: list[int] = []


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    _EXIT_STATUS.append(int(exitstatus))


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config: pytest.Config) -> None:
    """Once the summary is printed and every plugin is done, a session that imported Triton (vLLM
    does, even where it disables it) ends without Python's finalization: there, nanobind's
    teardown of Triton's module prints dozens of lines of leak reports after the summary. This is
    what ``rolloutd serve`` does too (``rolloutd.cli._end_process``)."""
    import sys

    if "triton" in sys.modules and _EXIT_STATUS:
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        os._exit(_EXIT_STATUS[-1])
