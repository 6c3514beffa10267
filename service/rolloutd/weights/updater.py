"""Weight updates from anywhere: a local directory, an fsspec URL, or a push over gRPC.

Every update goes the same way:

1. **transfer** — a URL is copied, a push is received, into a private staging directory (a local
   directory is used in place);
2. **verify** — sizes and checksums (while the staged files are made durable), then the
   safetensors headers against the served model;
3. **pause / load / resume** — the controller bumps the policy version and the engine swaps the
   weights (it times these three phases itself).

Nothing reaches the engine before step 2 passed, so refused weights leave the old ones serving
and the policy version where it was. A failure inside the engine makes the service not-ready (the
controller's rule). Loads run one at a time; transfers may overlap.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from rolloutd.domain.errors import InvalidArgument
from rolloutd.domain.weights import (
    NullWeightsObserver,
    WeightsObserver,
    WeightsPhase,
    WeightsReport,
    WeightsSource,
    WeightsTimeline,
)
from rolloutd.weights.fetch import Source, is_url
from rolloutd.weights.layout import ModelLayout, WeightsRejected, check_headers
from rolloutd.weights.receive import PushChunk, PushHeader, PushReceiver
from rolloutd.weights.staging import FileSpec, StagingArea, check_specs, verify_files

logger = logging.getLogger(__name__)


class WeightsTarget(Protocol):
    """What the updater needs from the controller."""

    @property
    def policy_version(self) -> int: ...

    async def update_weights(
        self, version: int, weights_path: str, *, timeline: WeightsTimeline | None = None
    ) -> int: ...


@dataclass(frozen=True)
class UpdateResult:
    policy_version: int
    evicted_groups: int
    report: WeightsReport


@dataclass
class _Attempt:
    """What one update knows so far, for its report."""

    version: int
    source: WeightsSource
    timeline: WeightsTimeline
    started_ns: int
    files: int = 0
    bytes: int = 0


class WeightsUpdater:
    def __init__(
        self,
        target: WeightsTarget,
        staging: StagingArea,
        layout: ModelLayout | None,
        *,
        storage_options: Mapping[str, Any],
        concurrency: int,
        observer: WeightsObserver | None = None,
    ) -> None:
        self._target = target
        self._staging = staging
        self._layout = layout
        self._storage_options = dict(storage_options)
        self._concurrency = concurrency
        self._observer = observer or NullWeightsObserver()
        self._load_lock = asyncio.Lock()
        self._served: Path | None = None
        self._restorable: int | None = None
        """Policy version at the start of the latest completed snapshot: what it records is at
        least this version, so staged versions from here on must stay for a restore."""
        self._snapshotting: list[int] = []
        """The same for snapshots being written."""

    def snapshot_started(self) -> int:
        """A snapshot is being taken: the staged version it records must survive later updates.
        Returns the token to give :meth:`snapshot_ended`."""
        version = self._target.policy_version
        self._snapshotting.append(version)
        return version

    def snapshot_ended(self, token: int, *, published: bool) -> None:
        self._snapshotting.remove(token)
        if published:
            self._restorable = token
        self._retire()

    def restored(self, weights_path: str) -> None:
        """The service restored a snapshot whose weights the engine now serves from
        ``weights_path``: they must stay."""
        self._served = Path(weights_path)
        self._restorable = self._target.policy_version

    def _retire(self) -> None:
        floors = [*self._snapshotting, *([] if self._restorable is None else [self._restorable])]
        self._staging.retire(self._served, min(floors) if floors else None)

    def _check_version(self, version: int) -> None:
        current = self._target.policy_version
        if version <= current:
            raise InvalidArgument(
                "version", f"must be greater than the current policy version {current}"
            )

    async def update(self, version: int, weights_path: str) -> UpdateResult:
        """``UpdateWeights``: a local directory (checked, loaded in place) or an fsspec URL."""
        if not weights_path:
            raise InvalidArgument("weights_path", "must not be empty")
        source = WeightsSource.URL if is_url(weights_path) else WeightsSource.PATH
        attempt = _Attempt(version, source, WeightsTimeline(), time.time_ns())
        return await self._reported(attempt, self._update(attempt, weights_path))

    async def push(self, messages: AsyncIterator[PushHeader | PushChunk]) -> UpdateResult:
        """``PushWeights``: a header, then chunks, written to staging, checked, then loaded."""
        first = await anext(messages, None)
        if not isinstance(first, PushHeader):
            raise InvalidArgument("header", "the first message of a push must be its header")
        attempt = _Attempt(first.version, WeightsSource.PUSH, WeightsTimeline(), time.time_ns())
        return await self._reported(attempt, self._push(attempt, first, messages))

    async def _reported(self, attempt: _Attempt, work: Awaitable[UpdateResult]) -> UpdateResult:
        """Runs ``work`` and reports the attempt, whatever its outcome."""
        error: BaseException | None = None
        try:
            return await work
        except BaseException as exc:
            error = exc
            raise
        finally:
            self._observer.weights_updated(_report(attempt, error))

    async def _update(self, attempt: _Attempt, weights_path: str) -> UpdateResult:
        self._check_version(attempt.version)
        if attempt.source is WeightsSource.PATH:
            return await self._load_in_place(attempt, weights_path)
        source = Source(weights_path, self._storage_options)
        specs = await asyncio.to_thread(source.files)
        attempt.files, attempt.bytes = len(specs), sum(s.size for s in specs)
        staged = self._staging.new(attempt.bytes)
        try:
            with attempt.timeline.phase(WeightsPhase.TRANSFER):
                await asyncio.to_thread(source.copy, specs, staged, self._concurrency)
            return await self._verify_and_load(attempt, staged, specs)
        finally:
            self._staging.discard(staged)

    async def _push(
        self, attempt: _Attempt, header: PushHeader, messages: AsyncIterator[PushHeader | PushChunk]
    ) -> UpdateResult:
        self._check_version(header.version)
        specs = check_specs(header.files, need_sha256=True)
        attempt.files, attempt.bytes = len(specs), sum(s.size for s in specs)
        staged = self._staging.new(attempt.bytes)
        receiver = PushReceiver(tuple(specs), staged)
        try:
            with attempt.timeline.phase(WeightsPhase.TRANSFER):
                try:
                    async for message in messages:
                        if isinstance(message, PushHeader):
                            raise InvalidArgument("header", "a push has exactly one header")
                        await receiver.write(message)
                    await receiver.finish()
                finally:
                    await receiver.close()
            return await self._verify_and_load(attempt, staged, specs)
        finally:
            self._staging.discard(staged)

    async def _verify_and_load(
        self, attempt: _Attempt, staged: Path, specs: list[FileSpec]
    ) -> UpdateResult:
        with attempt.timeline.phase(WeightsPhase.VERIFY):
            await asyncio.to_thread(verify_files, staged, specs, self._concurrency)
            await asyncio.to_thread(self._check_tensors, self._staging.files(staged, specs))
        async with self._load_lock:
            self._check_version(attempt.version)
            kept = self._staging.promote(staged, attempt.version)
            try:
                result = await self._load(attempt, kept)
            except BaseException:
                self._staging.discard(kept)
                raise
            self._served = kept
            self._retire()
            return result

    async def _load_in_place(self, attempt: _Attempt, weights_path: str) -> UpdateResult:
        directory = Path(weights_path)
        if self._layout is not None:
            with attempt.timeline.phase(WeightsPhase.VERIFY):
                files = await asyncio.to_thread(_safetensors_in, directory)
                attempt.files = len(files)
                attempt.bytes = sum(p.stat().st_size for p in files.values())
                await asyncio.to_thread(self._check_tensors, files)
        async with self._load_lock:
            result = await self._load(attempt, directory)
            self._served = None
            self._retire()
            return result

    def _check_tensors(self, files: Mapping[str, Path]) -> None:
        if self._layout is None:
            check_headers(files)
        else:
            self._layout.check(files)

    async def _load(self, attempt: _Attempt, directory: Path) -> UpdateResult:
        evicted = await self._target.update_weights(
            attempt.version, str(directory), timeline=attempt.timeline
        )
        result = UpdateResult(self._target.policy_version, evicted, _report(attempt))
        logger.info(
            "policy v%d serves (%s, %d files, %.1f MB): %s",
            attempt.version,
            attempt.source.value,
            attempt.files,
            attempt.bytes / 1e6,
            ", ".join(f"{k} {v:.3f} s" for k, v in attempt.timeline.seconds().items()),
        )
        return result


def _report(attempt: _Attempt, error: BaseException | None = None) -> WeightsReport:
    """The attempt as reported so far (``error``: why it was refused or failed)."""
    return WeightsReport(
        version=attempt.version,
        source=attempt.source,
        started_ns=attempt.started_ns,
        ended_ns=time.time_ns(),
        phases=tuple(attempt.timeline.phases),
        files=attempt.files,
        bytes=attempt.bytes,
        error=error,
    )


def _safetensors_in(directory: Path) -> dict[str, Path]:
    files = (
        {p.name: p for p in sorted(directory.glob("*.safetensors"))} if directory.is_dir() else {}
    )
    if not files:
        raise WeightsRejected(
            "weights_path", f"{directory}: not a directory with *.safetensors files"
        )
    return files
