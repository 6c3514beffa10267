"""Which paths and URLs UpdateWeights may name (weights.allowed_urls, weights.local_root)."""

from __future__ import annotations

from pathlib import Path

import pytest

from rolloutd.domain.errors import InvalidArgument
from rolloutd.weights.policy import SourcePolicy


def refused(policy: SourcePolicy, path: str) -> str:
    with pytest.raises(InvalidArgument) as info:
        policy.check(path)
    assert info.value.field == "weights_path"
    return str(info.value)


@pytest.mark.parametrize(
    "url",
    ["http://127.0.0.1:9/w/", "ftp://host/w", "github://o:r@main/", "hf://m", "s3://bucket/w",
     "file:///tmp/w", "simplecache::s3://bucket/w"],
)  # fmt: skip
def test_no_url_is_allowed_by_default(url: str) -> None:
    assert "weights.allowed_urls is empty" in refused(SourcePolicy(), url)


def test_a_url_must_be_under_an_allowed_prefix_at_a_path_boundary() -> None:
    policy = SourcePolicy(allowed_urls=("s3://bucket/weights/", "https://models.internal/w"))
    for url in ["s3://bucket/weights/step-3", "s3://bucket/weights", "https://models.internal/w/x"]:
        policy.check(url)
    for url in [
        "s3://bucket/weights-evil/x",
        "s3://bucket/other/x",
        "s3://bucket2/weights/x",
        "https://models.internal/w@evil.example/x",
        "https://models.internal/wx",
        "http://models.internal/w/x",
    ]:
        assert "under no prefix of weights.allowed_urls" in refused(policy, url), url


@pytest.mark.parametrize(
    "url",
    ["s3://bucket/weights/../secrets", "s3://bucket/weights/./x/..", "s3://bucket/weights/a\nb",
     "s3://bucket/weights/x::s3://other/y", "s3://bucket/weights\\..\\x"],
)  # fmt: skip
def test_a_url_cannot_climb_out_of_its_prefix(url: str) -> None:
    policy = SourcePolicy(allowed_urls=("s3://bucket/weights/",))
    assert "segments" in refused(policy, url)


def test_local_paths_must_be_under_the_local_root(tmp_path: Path) -> None:
    root = tmp_path / "root"
    (root / "step-1").mkdir(parents=True)
    (tmp_path / "outside").mkdir()
    (root / "escape").symlink_to(tmp_path / "outside")
    policy = SourcePolicy(local_root=str(root))
    policy.check(str(root / "step-1"))
    for path in [tmp_path / "outside", root / "escape", root / ".." / "outside", Path("/etc")]:
        assert "must be under weights.local_root" in refused(policy, str(path)), path
    SourcePolicy().check("/anywhere")  # unset: any local path
