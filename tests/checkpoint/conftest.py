"""Store locations: every store test runs on a local directory and on S3 (moto's server mode)."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import fsspec
import pytest
from moto.server import ThreadedMotoServer

from tests.checkpoint.helpers import Location

BUCKET = "rolloutd-test"


@pytest.fixture(scope="session")
def s3_options() -> Iterator[dict[str, object]]:
    """A moto S3 server on a free port of 127.0.0.1, with one bucket; its fsspec options."""
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


@pytest.fixture(params=["local", pytest.param("s3", marks=pytest.mark.s3)])
def location(request: pytest.FixtureRequest, tmp_path) -> Location:
    if request.param == "local":
        return Location(str(tmp_path / "store"))
    options = request.getfixturevalue("s3_options")
    return Location(f"s3://{BUCKET}/{uuid.uuid4().hex}", dict(options))
