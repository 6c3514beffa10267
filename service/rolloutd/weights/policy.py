"""Which weights an ``UpdateWeights`` call may name: URLs under ``weights.allowed_urls``, local
paths under ``weights.local_root``.

What must hold: the service connects nowhere and reads no directory that a request names before
it passed here. A URL matches a prefix only at a ``/`` boundary (``s3://bucket`` does not allow
``s3://bucket-2/``), never through ``.`` or ``..`` segments, and never as one of fsspec's chained
URLs (``simplecache::s3://...``), whose first part would pick another protocol. A local path is
compared with symlinks resolved. Refusals name the setting, not what lies behind the URL.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

from rolloutd.domain.errors import InvalidArgument

_UNSAFE = re.compile(r"::|\\|[\x00-\x20\x7f]")
"""Chained URLs, backslashes, whitespace and control characters: never part of an allowed URL."""


def is_url(path: str) -> bool:
    return "://" in path


@dataclass(frozen=True)
class SourcePolicy:
    allowed_urls: tuple[str, ...] = ()
    local_root: str | None = None
    """Unset: any local path."""

    def check(self, weights_path: str) -> None:
        """Refuses (``INVALID_ARGUMENT`` naming the setting) a path this service may not read."""
        if is_url(weights_path):
            self._check_url(weights_path)
        elif self.local_root is not None:
            root = os.path.realpath(self.local_root)
            if not Path(os.path.realpath(weights_path)).is_relative_to(root):
                raise InvalidArgument(
                    "weights_path", "local weights must be under weights.local_root"
                )

    def _check_url(self, url: str) -> None:
        if not self.allowed_urls:
            raise InvalidArgument(
                "weights_path",
                "URLs are refused: weights.allowed_urls is empty (local directories under "
                "weights.local_root only)",
            )
        segments = url.split("://", 1)[1].split("/")
        if _UNSAFE.search(url) or "." in segments or ".." in segments:
            raise InvalidArgument(
                "weights_path", "the URL has '.' or '..' segments, '::', or control characters"
            )
        if not any(_under(url, prefix) for prefix in self.allowed_urls):
            raise InvalidArgument(
                "weights_path", "the URL is under no prefix of weights.allowed_urls"
            )


def _under(url: str, prefix: str) -> bool:
    base = prefix.rstrip("/")
    return url == base or url.startswith(base + "/")
