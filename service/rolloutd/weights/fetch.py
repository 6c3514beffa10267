"""Weights from an fsspec URL (``s3://bucket/prefix``, ``file:///dir``) copied into staging.

The source lists its ``*.safetensors`` files. Optional companions make the copy checkable:

- ``SHA256SUMS`` (``sha256sum`` output, ``<hex>  <name>`` per line): each listed file must exist
  and match its checksum;
- ``model.safetensors.index.json`` (Hugging Face's shard index): each file its ``weight_map``
  names must exist.

Files are copied as byte ranges on a pool of threads (several ranges of one large file at once,
which is what makes object storage fast), each range written at its offset. Sizes are checked
against the listing afterwards; checksums in :func:`rolloutd.weights.staging.verify_files`.

Errors tell the caller what failed (listing, reading a file, copying), never what the remote end
answered: that would let a caller probe what the service can reach (open ports, hosts, buckets).
The service's log has the details. :meth:`Source.abandon` makes a copy stop at its next range
(one a stalled connection holds ends when the connection does).
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import fsspec

from rolloutd.domain.errors import Unavailable
from rolloutd.weights.layout import WeightsRejected
from rolloutd.weights.policy import is_url
from rolloutd.weights.staging import FileSpec, check_specs, disk_full

logger = logging.getLogger(__name__)

PART_BYTES = 16 * 2**20
"""Size of one ranged read."""

SUMS_FILE = "SHA256SUMS"
INDEX_FILE = "model.safetensors.index.json"


__all__ = ["Source", "is_url", "remote_errors", "remote_failure"]


def remote_failure(what: str, url: str, exc: BaseException) -> Unavailable:
    """``UNAVAILABLE`` saying ``what`` failed; the remote end's answer goes to the log only."""
    logger.warning("weights from %s: %s failed: %r", url, what, exc)
    return Unavailable(f"weights_path: {what} failed (the service log has the details)")


def remote_errors() -> tuple[type[BaseException], ...]:
    """Remote-side errors that are not ``OSError``: botocore's (s3) and aiohttp's (http), when
    installed."""
    found: list[type[BaseException]] = []
    try:
        from botocore.exceptions import BotoCoreError, ClientError

        found += [BotoCoreError, ClientError]
    except ImportError:
        pass
    try:
        from aiohttp import ClientError as HttpClientError

        found.append(HttpClientError)
    except ImportError:
        pass
    return tuple(found)


class Source:
    """One fsspec URL holding new weights."""

    def __init__(self, url: str, storage_options: Mapping[str, Any]) -> None:
        self.url = url
        try:
            self._fs, root = fsspec.core.url_to_fs(url, **storage_options)
        # fsspec's answers to an unknown scheme, and to one whose package is not installed.
        except (ValueError, ImportError) as exc:
            logger.warning("weights from %s: %r", url, exc)
            raise WeightsRejected("weights_path", "its protocol cannot be read") from None
        self._root = root.rstrip("/")
        self._errors: tuple[type[BaseException], ...] = (OSError, *remote_errors())
        self._abandoned = threading.Event()

    def abandon(self) -> None:
        """Stops a copy in progress at its next range."""
        self._abandoned.set()

    def _path(self, name: str) -> str:
        return f"{self._root}/{name}"

    def files(self) -> list[FileSpec]:
        """The files to copy, with their sizes and (from SHA256SUMS) checksums."""
        try:
            self._fs.invalidate_cache(self._root)
            entries = self._fs.ls(self._root, detail=True)
        except FileNotFoundError:
            raise WeightsRejected("weights_path", "does not exist") from None
        except self._errors as exc:
            raise remote_failure("listing the URL", self.url, exc) from None
        sizes = {
            e["name"].rstrip("/").rsplit("/", 1)[-1]: int(e["size"])
            for e in entries
            if e.get("type") == "file"
        }
        sums = self._sums() if SUMS_FILE in sizes else {}
        expected = set(sums) | (self._indexed() if INDEX_FILE in sizes else set())
        for name in sorted(expected - set(sizes)):
            raise WeightsRejected(name, "is listed in the URL's index but missing from it")
        names = sorted(n for n in sizes if n.endswith(".safetensors"))
        if not names:
            raise WeightsRejected("weights_path", "holds no *.safetensors files")
        return check_specs((FileSpec(n, sizes[n], sums.get(n)) for n in names), need_sha256=False)

    def _read_text(self, name: str) -> str:
        try:
            return bytes(self._fs.cat_file(self._path(name))).decode()
        except self._errors as exc:
            raise remote_failure(f"reading {name}", self.url, exc) from None

    def _sums(self) -> dict[str, str]:
        sums: dict[str, str] = {}
        for number, line in enumerate(self._read_text(SUMS_FILE).splitlines(), 1):
            if not line.strip():
                continue
            digest, sep, name = line.partition(" ")
            if not sep or len(digest) != 64:
                raise WeightsRejected(SUMS_FILE, f"line {number} is not '<sha256>  <file name>'")
            name = name.strip().lstrip("*")
            if name.endswith(".safetensors"):
                sums[name] = digest.lower()
        return sums

    def _indexed(self) -> set[str]:
        try:
            index = json.loads(self._read_text(INDEX_FILE))
            return {str(v) for v in index["weight_map"].values()}
        except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as exc:
            raise WeightsRejected(INDEX_FILE, f"is not a safetensors index ({exc!r})") from None

    def copy(self, specs: list[FileSpec], dest: Path, concurrency: int) -> int:
        """Copies every file into ``dest`` in ranges on ``concurrency`` threads; returns bytes."""
        total = sum(s.size for s in specs)
        started = time.monotonic()
        fds = {
            s.name: os.open(dest / s.name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            for s in specs
        }
        parts = [
            (s.name, offset, min(offset + PART_BYTES, s.size))
            for s in specs
            for offset in range(0, s.size, PART_BYTES)
        ]

        def copy_part(part: tuple[str, int, int]) -> int:
            name, start, end = part
            if self._abandoned.is_set():
                raise TimeoutError("the copy was abandoned")
            data = self._fs.cat_file(self._path(name), start=start, end=end)
            if len(data) != end - start:
                raise WeightsRejected(
                    name, f"reading bytes {start}..{end} gave {len(data)} (changed while copied?)"
                )
            os.pwrite(fds[name], data, start)
            return len(data)

        try:
            with ThreadPoolExecutor(max(1, concurrency)) as pool:
                done = 0
                next_report = total / 4
                for n in pool.map(copy_part, parts):
                    done += n
                    if done >= next_report and done < total:
                        logger.info(
                            "weights from %s: %.0f of %.0f MB copied",
                            self.url,
                            done / 1e6,
                            total / 1e6,
                        )
                        next_report += total / 4
        except FileNotFoundError:
            raise WeightsRejected("weights_path", "a file vanished from the URL") from None
        except OSError as exc:
            if (full := disk_full(exc)) is not None:
                raise full from exc
            raise remote_failure("copying from the URL", self.url, exc) from None
        except self._errors as exc:
            raise remote_failure("copying from the URL", self.url, exc) from None
        finally:
            for fd in fds.values():
                os.close(fd)
        seconds = time.monotonic() - started
        logger.info(
            "weights from %s: %d files, %.1f MB in %.2f s (%.0f MB/s)",
            self.url, len(specs), total / 1e6, seconds, total / 1e6 / max(seconds, 1e-9),
        )  # fmt: skip
        return total
