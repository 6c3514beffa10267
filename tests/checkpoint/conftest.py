"""Store locations: every store test runs on a local directory and on S3 (moto's server mode)."""

from __future__ import annotations

import uuid

import pytest

from tests.checkpoint.helpers import Location
from tests.conftest import BUCKET


@pytest.fixture(params=["local", pytest.param("s3", marks=pytest.mark.s3)])
def location(request: pytest.FixtureRequest, tmp_path) -> Location:
    if request.param == "local":
        return Location(str(tmp_path / "store"))
    options = request.getfixturevalue("s3_options")
    return Location(f"s3://{BUCKET}/{uuid.uuid4().hex}", dict(options))
