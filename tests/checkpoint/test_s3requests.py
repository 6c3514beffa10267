"""The conditional S3 requests the store's claim is built on (s3requests.py), which use s3fs's
private request call: these fail when an s3fs release changes it, before a claim misbehaves."""

from __future__ import annotations

import inspect
import uuid

import fsspec
import pytest
from s3fs import S3FileSystem

from rolloutd.checkpoint import s3requests
from tests.conftest import BUCKET


def test_s3fs_still_has_the_request_call_the_claim_uses():
    call = S3FileSystem._call_s3
    assert inspect.iscoroutinefunction(call)
    params = list(inspect.signature(call).parameters.values())
    assert [p.name for p in params[:2]] == ["self", "method"]
    assert [p.kind for p in params[2:]] == [
        inspect.Parameter.VAR_POSITIONAL,
        inspect.Parameter.VAR_KEYWORD,
    ]
    assert callable(S3FileSystem.call_s3)  # its blocking twin


@pytest.mark.s3
def test_a_put_holds_only_against_the_version_it_names(s3_options):
    fs = fsspec.filesystem("s3", **s3_options, skip_instance_cache=True)
    key = f"{uuid.uuid4().hex}/lock.json"
    assert s3requests.get(fs, BUCKET, key) is None

    first = s3requests.put(fs, BUCKET, key, b"one", None)
    assert s3requests.get(fs, BUCKET, key) == (b"one", first)
    with pytest.raises(s3requests.PreconditionFailed):
        s3requests.put(fs, BUCKET, key, b"two", None)  # there is an object already
    with pytest.raises(s3requests.PreconditionFailed):
        s3requests.put(fs, BUCKET, key, b"two", '"0000"')  # not the version there

    second = s3requests.put(fs, BUCKET, key, b"two", first)
    assert second != first
    assert s3requests.get(fs, BUCKET, key) == (b"two", second)
    with pytest.raises(s3requests.PreconditionFailed):
        s3requests.put(fs, BUCKET, key, b"three", first)  # a version that has been replaced

    s3requests.delete(fs, BUCKET, key)
    assert s3requests.get(fs, BUCKET, key) is None
