"""Local staging of new weights: private directories that are loaded, kept or removed whole.

Layout under ``weights.staging_dir``::

    incoming/<random>/   files being copied or received; removed on any failure, and at start-up
    v<version>/          weights the engine served, kept so that a restarted service restores
                         the policy version its snapshot records

What must hold: the engine only ever reads a directory whose every file was verified; a refused
or failed update leaves no directory behind; the served version's directory stays, and so does
every version a published (or publishing) snapshot may record; the others are removed.

Room on the disk is reserved: a new directory is refused unless its bytes fit in the free space
less what the directories still being filled were promised and have not written yet, so updates
that overlap (a delta's decode next to its download, a catch-up's chain) cannot all pass the
check and then all run out. A write that still meets a full disk is ``RESOURCE_EXHAUSTED``
(:func:`disk_full`), not an unknown error.
"""

from __future__ import annotations

import errno
import hashlib
import logging
import os
import re
import shutil
import tempfile
from collections.abc import Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from rolloutd.domain.errors import ResourceExhausted
from rolloutd.weights.layout import WeightsRejected

logger = logging.getLogger(__name__)

_NAME = r"[A-Za-z0-9][A-Za-z0-9._-]{0,200}"
_SHA256 = re.compile(r"[0-9a-f]{64}")
_HASH_BLOCK = 8 * 2**20


@dataclass(frozen=True)
class FileSpec:
    """One file of new weights as its sender declares it."""

    name: str
    size: int
    sha256: str | None = None
    """Lowercase hex; None when the source gives no checksum (an fsspec URL without SHA256SUMS)."""


def check_specs(
    specs: Iterable[FileSpec], *, need_sha256: bool, suffix: str = ".safetensors"
) -> list[FileSpec]:
    """Refuses names that could leave the staging directory or that the engine would not read
    (``suffix``: ``.delta`` for a delta, which is one file), duplicate names, and malformed
    checksums."""
    out: list[FileSpec] = []
    seen: set[str] = set()
    pattern = re.compile(_NAME + re.escape(suffix))
    for spec in specs:
        if not pattern.fullmatch(spec.name):
            raise WeightsRejected(
                f"file {spec.name!r}", f"must be a plain file name ending in {suffix}"
            )
        if spec.name in seen:
            raise WeightsRejected(spec.name, "is declared twice")
        seen.add(spec.name)
        if spec.sha256 is None:
            if need_sha256:
                raise WeightsRejected(spec.name, "sha256 must be given")
        elif not _SHA256.fullmatch(spec.sha256):
            raise WeightsRejected(spec.name, "sha256 must be 64 lowercase hexadecimal digits")
        out.append(spec)
    if not out:
        raise WeightsRejected("files", f"must name at least one {suffix} file")
    if suffix != ".safetensors" and len(out) != 1:
        raise WeightsRejected("files", f"a delta is one {suffix} file, {len(out)} were declared")
    return out


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb", buffering=0) as f:
        while block := f.read(_HASH_BLOCK):
            h.update(block)
    return h.hexdigest()


def verify_files(directory: Path, specs: Iterable[FileSpec], concurrency: int) -> int:
    """Checks every staged file's size, and its SHA-256 where one was declared, and makes the
    files durable; returns the bytes.

    Files are hashed on ``concurrency`` threads (hashlib releases the GIL on large blocks) while
    another one fsyncs them: the disk writes them back while the CPU reads them from the page
    cache. They must be durable because a snapshot records the version they hold once loaded,
    and a crash of the machine must not leave it pointing at missing or partly written weights.
    """
    specs = list(specs)
    for spec in specs:
        path = directory / spec.name
        if not path.is_file():
            raise WeightsRejected(spec.name, "was declared but never arrived")
        size = path.stat().st_size
        if size != spec.size:
            raise WeightsRejected(spec.name, f"is {size} bytes, {spec.size} were declared")
    hashed = [s for s in specs if s.sha256 is not None]
    with ThreadPoolExecutor(max(1, min(concurrency, len(hashed) or 1)) + 1) as pool:
        synced = pool.submit(_sync_files, directory, specs)
        digests = list(pool.map(lambda s: sha256_of(directory / s.name), hashed))
        synced.result()
    for spec, digest in zip(hashed, digests, strict=True):
        if digest != spec.sha256:
            raise WeightsRejected(
                spec.name,
                f"SHA-256 is {digest}, {spec.sha256} was declared (corrupted in transit?)",
            )
    return sum(s.size for s in specs)


def _sync_files(directory: Path, specs: Iterable[FileSpec]) -> None:
    for spec in specs:
        fd = os.open(directory / spec.name, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    _sync_directory(directory)


def _sync_directory(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


_FULL = (errno.ENOSPC, errno.EDQUOT)


def disk_full(exc: OSError) -> ResourceExhausted | None:
    """The error to raise instead of ``exc`` when it says the staging disk is full."""
    if exc.errno not in _FULL:
        return None
    return ResourceExhausted("weights: the disk of weights.staging_dir is full; retry later")


def _written(directory: Path) -> int:
    try:
        return sum(p.stat().st_blocks * 512 for p in directory.iterdir())
    except FileNotFoundError:
        return 0


class StagingArea:
    """The staging directory of one service; see the module docstring."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root)
        self._incoming = self.root / "incoming"
        self._reserved: dict[Path, int] = {}
        """Directories being filled -> the bytes promised to them."""

    def prepare(self) -> None:
        """Creates the area and removes what an earlier process left half-done."""
        self._incoming.mkdir(parents=True, exist_ok=True)
        for leftover in self._incoming.iterdir():
            logger.info("removing unfinished staged weights %s", leftover)
            shutil.rmtree(leftover, ignore_errors=True)

    def new(self, total_bytes: int) -> Path:
        """A private directory for an update of ``total_bytes``; refused when the disk lacks room."""
        self._incoming.mkdir(parents=True, exist_ok=True)
        promised = sum(max(0, n - _written(d)) for d, n in self._reserved.items())
        free = shutil.disk_usage(self._incoming).free - promised
        if total_bytes > free:
            raise ResourceExhausted(
                f"weights: {total_bytes} bytes do not fit in the {max(free, 0)} free bytes of "
                f"weights.staging_dir ({promised} of its free bytes are reserved by other "
                "updates)"
            )
        directory = Path(tempfile.mkdtemp(prefix="w-", dir=self._incoming))
        self._reserved[directory] = total_bytes
        return directory

    def discard(self, directory: Path) -> None:
        self._reserved.pop(directory, None)
        shutil.rmtree(directory, ignore_errors=True)

    def promote(self, directory: Path, version: int) -> Path:
        """Moves verified files to ``v<version>`` (what the engine will load from), replacing
        what an earlier refused attempt at the same version may have left; the rename is made
        durable before the engine (and so any later snapshot) sees the new directory."""
        self._reserved.pop(directory, None)
        target = self.root / f"v{version}"
        if target.exists():
            shutil.rmtree(target)
        os.replace(directory, target)
        _sync_directory(self.root)
        return target

    def retire(self, current: Path | None, floor: int | None) -> None:
        """Removes kept versions a restart cannot need: every ``v<N>`` but ``current`` and, when a
        snapshot may record one, those from version ``floor`` on."""
        for old in self.root.glob("v*"):
            version = old.name[1:]
            if old == current or not old.is_dir() or not version.isdigit():
                continue
            if floor is None or int(version) < floor:
                shutil.rmtree(old, ignore_errors=True)

    def files(self, directory: Path, specs: Iterable[FileSpec]) -> Mapping[str, Path]:
        return {s.name: directory / s.name for s in specs}
