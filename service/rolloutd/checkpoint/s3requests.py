"""Conditional S3 requests through s3fs: the one place rolloutd uses s3fs's private request call.

The store's claim (claim.py) is a compare-and-swap on one object, and needs from S3 what no public
s3fs or fsspec method gives with the same meaning:

* the object's bytes *and* the ETag of those very bytes, from one GET (``cat_file`` drops the
  ETag; ``info`` then ``cat_file`` are two requests that may see two versions);
* a put conditional on ``If-Match: <ETag>`` or ``If-None-Match: *`` that returns the new ETag
  (``pipe_file`` returns nothing its documentation promises).

s3fs's client (``set_session``) would give both, but bypass what s3fs adds to every request
(``s3_additional_kwargs`` such as server-side encryption, requester pays, its retries and its
translation of errors to ``OSError``), so the claim would behave unlike every other store request.
These requests therefore go through ``S3FileSystem._call_s3`` / ``call_s3``, which do all of that.
pyproject.toml bounds s3fs to the releases this was checked against, and
tests/checkpoint/test_s3requests.py fails when an s3fs release changes the call.
"""

from __future__ import annotations

from typing import Any

from fsspec.asyn import sync


class PreconditionFailed(Exception):
    """The object is not the version the condition named (another writer got there first)."""


def get(fs: Any, bucket: str, key: str) -> tuple[bytes, str] | None:
    """The object's bytes and their ETag, from one GET; None when there is no such object."""

    async def one_get() -> tuple[bytes, str]:
        r = await fs._call_s3("get_object", Bucket=bucket, Key=key)
        async with r["Body"] as body:
            return await body.read(), str(r["ETag"])

    try:
        return sync(fs.loop, one_get)
    except FileNotFoundError:
        return None


def put(fs: Any, bucket: str, key: str, data: bytes, expected: str | None) -> str:
    """Puts ``data`` if the object is still the version whose ETag is ``expected`` (None: if
    there is no object); returns the new ETag. :class:`PreconditionFailed` otherwise."""
    condition = {"IfNoneMatch": "*"} if expected is None else {"IfMatch": expected}
    try:
        r = fs.call_s3("put_object", Bucket=bucket, Key=key, Body=data, **condition)
    except OSError as exc:
        if _precondition_failed(exc):
            raise PreconditionFailed from exc
        raise
    return str(r["ETag"])


def delete(fs: Any, bucket: str, key: str) -> None:
    """Deletes the object, unconditionally (S3 has no conditional delete everywhere)."""
    fs.call_s3("delete_object", Bucket=bucket, Key=key)


def _precondition_failed(exc: OSError) -> bool:
    """s3fs turns a failed condition into an ``OSError`` caused by boto's error, which names it."""
    from botocore.exceptions import ClientError

    cause = exc.__cause__
    return isinstance(cause, ClientError) and cause.response.get("Error", {}).get("Code") in (
        "PreconditionFailed",
        "ConditionalRequestConflict",
    )
