"""The weights store: the newest full version (the anchor) and the chain of deltas after it.

A trainer that sends deltas also publishes here (a directory or an fsspec URL, ``weights.store``),
so that a replica that missed updates — restored from an older snapshot, or new — can catch up
before it admits work. Layout::

    anchors/v<N>/                     *.safetensors and SHA256SUMS (written last: an anchor
                                      without it is still being written and is ignored)
    deltas/v<N>-from-v<B>.delta       the delta that turns version B into version N

What must hold: a replica catches up only through an unbroken chain, from the version it serves
or from the anchor, to the newest version in the store; a missing link is refused with the
version that is missing. Publishing an anchor removes older anchors and the deltas it makes
unnecessary (those up to its version), so the store holds one full copy and the deltas after it.
"""

from __future__ import annotations

import hashlib
import logging
import re
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import fsspec

from rolloutd.domain.errors import FailedPrecondition
from rolloutd.weights.delta import SUFFIX
from rolloutd.weights.delta import read_header as read_delta_header
from rolloutd.weights.fetch import SUMS_FILE

logger = logging.getLogger(__name__)

_ANCHOR = re.compile(r"v(\d+)")
_DELTA = re.compile(r"v(\d+)-from-v(\d+)" + re.escape(SUFFIX))


class ChainBroken(FailedPrecondition):
    """The store cannot bring the served weights to its newest version."""


@dataclass(frozen=True)
class CatchUp:
    """How to reach ``target``: from the anchor (when ``anchor`` is set) or from the version
    served, through ``deltas`` in order (each ``(version, base, url)``)."""

    target: int
    anchor: int | None
    anchor_url: str | None
    deltas: tuple[tuple[int, int, str], ...]


class WeightsStore:
    def __init__(self, url: str, storage_options: Mapping[str, Any] | None = None) -> None:
        self.url = url.rstrip("/")
        self._fs, root = fsspec.core.url_to_fs(url, **dict(storage_options or {}))
        self._root = root.rstrip("/")

    def _path(self, *parts: str) -> str:
        return "/".join([self._root, *parts])

    def _url(self, *parts: str) -> str:
        return "/".join([self.url, *parts])

    # -- reading ---------------------------------------------------------------------------------

    def _names(self, folder: str) -> list[str]:
        try:
            self._fs.invalidate_cache(self._path(folder))
            return [p.rstrip("/").rsplit("/", 1)[-1] for p in self._fs.ls(self._path(folder))]
        except FileNotFoundError:
            return []

    def anchors(self) -> list[int]:
        """Complete anchors (their SHA256SUMS written), oldest first."""
        found = []
        for name in self._names("anchors"):
            m = _ANCHOR.fullmatch(name)
            if m and self._fs.exists(self._path("anchors", name, SUMS_FILE)):
                found.append(int(m.group(1)))
        return sorted(found)

    def deltas(self) -> dict[int, int]:
        """Version -> base version of every delta in the store."""
        out: dict[int, int] = {}
        for name in self._names("deltas"):
            m = _DELTA.fullmatch(name)
            if m and int(m.group(2)) < int(m.group(1)):
                out[int(m.group(1))] = int(m.group(2))
        return out

    def latest(self) -> int | None:
        anchors, deltas = self.anchors(), self.deltas()
        versions = [*anchors[-1:], *deltas]
        return max(versions) if versions else None

    def plan(self, served: int) -> CatchUp | None:
        """How to go from ``served`` to the newest version; None when already there (or ahead).
        Raises :class:`ChainBroken` naming the missing version when the chain has a gap."""
        anchors, deltas = self.anchors(), self.deltas()
        anchor = anchors[-1] if anchors else None
        versions = [*anchors[-1:], *deltas]
        if not versions or max(versions) <= served:
            return None
        target = max(versions)
        chain: list[tuple[int, int, str]] = []
        version = target
        while version != served and version != anchor:
            base = deltas.get(version)
            if base is None:
                start = f"v{anchor} (the anchor)" if anchor is not None else f"v{served}"
                raise ChainBroken(
                    f"weights store {self.url}: the chain from {start} to v{target} is missing "
                    f"v{version} (no anchor and no delta for it)"
                )
            chain.append((version, base, self._url("deltas", _delta_name(version, base))))
            version = base
        from_anchor = version != served
        return CatchUp(
            target=target,
            anchor=anchor if from_anchor else None,
            anchor_url=self._url("anchors", f"v{anchor}") if from_anchor else None,
            deltas=tuple(reversed(chain)),
        )

    # -- publishing (the trainer's side) ---------------------------------------------------------

    def publish_anchor(self, version: int, directory: str | Path) -> None:
        """Uploads the safetensors files of ``directory`` as the anchor ``version`` (SHA256SUMS
        last), then removes older anchors and the deltas up to ``version``."""
        source = Path(directory)
        files = sorted(source.glob("*.safetensors"))
        if not files:
            raise ValueError(f"{source} holds no *.safetensors files")
        folder = self._path("anchors", f"v{version}")
        self._fs.makedirs(folder, exist_ok=True)
        sums = []
        for path in files:
            self._fs.put_file(str(path), f"{folder}/{path.name}")
            sums.append(f"{_sha256(path)}  {path.name}\n")
        self._put_bytes("".join(sums).encode(), f"{folder}/{SUMS_FILE}")
        for old in self.anchors():
            if old < version:
                self._fs.rm(self._path("anchors", f"v{old}"), recursive=True)
        for delta, base in self.deltas().items():
            if delta <= version:
                self._fs.rm(self._path("deltas", _delta_name(delta, base)))
        logger.info("weights store %s: anchor v%d published", self.url, version)

    def publish_delta(self, path: str | Path) -> str:
        """Uploads the delta file at ``path`` under the name its header gives; returns its URL."""
        header = read_delta_header(Path(path))
        name = _delta_name(header.version, header.base_version)
        self._put_bytes(Path(path).read_bytes(), self._path("deltas", name))
        return self._url("deltas", name)

    def _put_bytes(self, data: bytes, path: str) -> None:
        """Writes ``path`` whole or not at all: a temporary name, then a move."""
        parent = path.rsplit("/", 1)[0]
        self._fs.makedirs(parent, exist_ok=True)
        temporary = f"{parent}/.{uuid.uuid4().hex}.partial"
        self._fs.pipe_file(temporary, data)
        self._fs.mv(temporary, path)


def _delta_name(version: int, base: int) -> str:
    return f"v{version}-from-v{base}{SUFFIX}"


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(8 << 20):
            h.update(block)
    return h.hexdigest()
