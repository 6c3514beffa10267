"""Weight updates from anywhere: a local directory, an fsspec URL, or a push over gRPC.

Every update goes the same way:

1. **transfer** — a URL is copied, a push is received, into a private staging directory (a local
   directory is used in place);
2. **verify** — sizes and checksums (while the staged files are made durable), then the
   safetensors headers against the served model;
3. **pause / load / resume** — the controller bumps the policy version and the engine swaps the
   weights (it times these three phases itself).

A delta (:mod:`rolloutd.weights.delta`) takes one more step between 1 and 3: **decode** applies
it to the served weights into a new staged directory and checks every resulting tensor's
checksum. A delta for another base than the served version is refused before it is fetched, and
again under the load lock; the engine then loads only the tensors that changed.

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

import fsspec

from rolloutd.domain.errors import FailedPrecondition, InvalidArgument, Unavailable
from rolloutd.domain.weights import (
    NullWeightsObserver,
    WeightsKind,
    WeightsObserver,
    WeightsPhase,
    WeightsReport,
    WeightsSource,
    WeightsTimeline,
)
from rolloutd.weights import delta
from rolloutd.weights.fetch import Source, is_url
from rolloutd.weights.layout import ModelLayout, WeightsRejected, check_headers
from rolloutd.weights.receive import PushChunk, PushHeader, PushReceiver
from rolloutd.weights.staging import FileSpec, StagingArea, check_specs, verify_files
from rolloutd.weights.store import CatchUp, WeightsStore

logger = logging.getLogger(__name__)


class WeightsTarget(Protocol):
    """What the updater needs from the controller."""

    @property
    def policy_version(self) -> int: ...

    async def update_weights(
        self,
        version: int,
        weights_path: str,
        *,
        timeline: WeightsTimeline | None = None,
        only: tuple[str, ...] | None = None,
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
    kind: WeightsKind = WeightsKind.FULL
    base_version: int | None = None
    density: float | None = None


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
        served_dir: Path | None = None,
        store: WeightsStore | None = None,
    ) -> None:
        """``served_dir``: the full weights the engine starts with (the model directory), the
        base of a first delta; ``store``: where :meth:`catch_up` looks for newer versions."""
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
        self._base = served_dir
        """A directory holding the served version's weights in full: what a delta applies to."""
        self._store = store

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
        self._base = self._served
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

    def _check_base(self, base_version: int) -> None:
        """A delta applies to the served version only (FAILED_PRECONDITION naming both)."""
        current = self._target.policy_version
        if base_version != current:
            raise FailedPrecondition(
                f"base_version: the delta applies to v{base_version} but v{current} is served"
            )
        if self._base is None:
            raise FailedPrecondition(
                f"base_version: the full weights of v{current} are not on this service's disk "
                "(the engine has no safetensors model directory); send full weights"
            )

    async def update(
        self, version: int, weights_path: str, base_version: int | None = None
    ) -> UpdateResult:
        """``UpdateWeights``: a local directory (checked, loaded in place) or an fsspec URL; with
        ``base_version``, a delta file there."""
        if not weights_path:
            raise InvalidArgument("weights_path", "must not be empty")
        source = WeightsSource.URL if is_url(weights_path) else WeightsSource.PATH
        attempt = _Attempt(version, source, WeightsTimeline(), time.time_ns())
        if base_version is not None:
            attempt.kind, attempt.base_version = WeightsKind.DELTA, base_version
            return await self._reported(attempt, self._update_delta(attempt, weights_path))
        return await self._reported(attempt, self._update(attempt, weights_path))

    async def push(self, messages: AsyncIterator[PushHeader | PushChunk]) -> UpdateResult:
        """``PushWeights``: a header, then chunks, written to staging, checked, then loaded."""
        first = await anext(messages, None)
        if not isinstance(first, PushHeader):
            raise InvalidArgument("header", "the first message of a push must be its header")
        attempt = _Attempt(first.version, WeightsSource.PUSH, WeightsTimeline(), time.time_ns())
        if first.base_version is not None:
            attempt.kind, attempt.base_version = WeightsKind.DELTA, first.base_version
        return await self._reported(attempt, self._push(attempt, first, messages))

    async def catch_up(self) -> UpdateResult | None:
        """Brings the engine to the weights store's newest version (anchor + chain), before the
        service admits work; None when there is no store or nothing newer in it. A gap in the
        chain raises :class:`~rolloutd.weights.store.ChainBroken` naming the missing version."""
        if self._store is None:
            return None
        current = self._target.policy_version
        plan = await asyncio.to_thread(self._store.plan, current)
        if plan is None:
            logger.info("weights store %s: v%d is the newest", self._store.url, current)
            return None
        logger.info(
            "weights store %s: catching up from v%d to v%d (%s%d deltas)",
            self._store.url, current, plan.target,
            "" if plan.anchor is None else f"anchor v{plan.anchor} + ", len(plan.deltas),
        )  # fmt: skip
        attempt = _Attempt(plan.target, WeightsSource.STORE, WeightsTimeline(), time.time_ns())
        attempt.kind = WeightsKind.FULL if plan.anchor is not None else WeightsKind.DELTA
        attempt.base_version = None if plan.anchor is not None else current
        return await self._reported(attempt, self._catch_up(attempt, plan))

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
        if attempt.base_version is not None:
            self._check_base(attempt.base_version)
        specs = check_specs(
            header.files,
            need_sha256=True,
            suffix=delta.SUFFIX if attempt.base_version is not None else ".safetensors",
        )
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
            if attempt.base_version is not None:
                with attempt.timeline.phase(WeightsPhase.VERIFY):
                    await asyncio.to_thread(verify_files, staged, specs, self._concurrency)
                [spec] = specs
                return await self._apply_and_load(attempt, staged / spec.name)
            return await self._verify_and_load(attempt, staged, specs)
        finally:
            self._staging.discard(staged)

    async def _update_delta(self, attempt: _Attempt, weights_path: str) -> UpdateResult:
        self._check_version(attempt.version)
        assert attempt.base_version is not None
        self._check_base(attempt.base_version)
        if attempt.source is WeightsSource.PATH:
            return await self._apply_and_load(attempt, Path(weights_path))
        staged = self._staging.new(0)
        try:
            with attempt.timeline.phase(WeightsPhase.TRANSFER):
                file = staged / weights_path.rstrip("/").rsplit("/", 1)[-1]
                await asyncio.to_thread(_fetch_file, weights_path, file, self._storage_options)
            return await self._apply_and_load(attempt, file)
        finally:
            self._staging.discard(staged)

    async def _apply_and_load(self, attempt: _Attempt, file: Path) -> UpdateResult:
        """Decodes the delta ``file`` against the served weights into a staged directory (every
        resulting tensor checked), then loads the tensors that changed."""
        assert attempt.base_version is not None
        with attempt.timeline.phase(WeightsPhase.DECODE):
            size, header = await asyncio.to_thread(_read_delta, file)
            attempt.files, attempt.bytes = 1, size
            attempt.density = header.density
            if (header.base_version, header.version) != (attempt.base_version, attempt.version):
                raise WeightsRejected(
                    file.name,
                    f"the delta turns v{header.base_version} into v{header.version}, the request "
                    f"says v{attempt.base_version} into v{attempt.version}",
                )
            base = self._base
            assert base is not None
            out = self._staging.new(await asyncio.to_thread(_safetensors_bytes, base))
            try:
                applied = await asyncio.to_thread(delta.apply_delta, file, base, out)
            except BaseException:
                self._staging.discard(out)
                raise
        try:
            return await self._load_staged(attempt, out, applied.changed_tensors)
        finally:
            self._staging.discard(out)

    async def _catch_up(self, attempt: _Attempt, plan: CatchUp) -> UpdateResult:
        """Fetches the anchor (when the plan starts there) and every delta, applies them in turn
        (each checked), and loads the result once."""
        assert self._store is not None
        self._check_version(plan.target)
        work: list[Path] = []
        try:
            base = self._base
            if plan.anchor_url is not None:
                source = Source(plan.anchor_url, self._storage_options)
                specs = await asyncio.to_thread(source.files)
                anchor = self._staging.new(sum(s.size for s in specs))
                work.append(anchor)
                with attempt.timeline.phase(WeightsPhase.TRANSFER):
                    attempt.bytes += await asyncio.to_thread(
                        source.copy, specs, anchor, self._concurrency
                    )
                with attempt.timeline.phase(WeightsPhase.VERIFY):
                    await asyncio.to_thread(verify_files, anchor, specs, self._concurrency)
                    await asyncio.to_thread(self._check_tensors, self._staging.files(anchor, specs))
                base = anchor
            if base is None:
                raise FailedPrecondition(
                    f"weights store {self._store.url}: no anchor, and the served weights are not "
                    "on this service's disk to apply its deltas to"
                )
            changed = 0
            for version, base_version, url in plan.deltas:
                folder = self._staging.new(0)
                work.append(folder)
                file = folder / f"v{version}{delta.SUFFIX}"
                with attempt.timeline.phase(WeightsPhase.TRANSFER):
                    await asyncio.to_thread(_fetch_file, url, file, self._storage_options)
                with attempt.timeline.phase(WeightsPhase.DECODE):
                    size, header = await asyncio.to_thread(_read_delta, file)
                    attempt.bytes += size
                    if (header.base_version, header.version) != (base_version, version):
                        raise WeightsRejected(
                            url, f"holds the delta from v{header.base_version} to v{header.version}"
                        )
                    out = self._staging.new(await asyncio.to_thread(_safetensors_bytes, base))
                    work.append(out)
                    await asyncio.to_thread(delta.apply_delta, file, base, out, url)
                changed += header.changed
                base = out
            attempt.files = len(await asyncio.to_thread(_safetensors_in, base))
            if plan.deltas and plan.anchor is None:
                attempt.density = changed / max(1, len(plan.deltas) * header.elements)
            return await self._load_staged(attempt, base, None)
        finally:
            for folder in work:
                self._staging.discard(folder)

    async def _load_staged(
        self, attempt: _Attempt, staged: Path, only: tuple[str, ...] | None
    ) -> UpdateResult:
        """Promotes a checked staged directory to ``v<version>`` and loads it (``only`` these
        tensors when given), under the load lock; a delta's base must still be served."""
        async with self._load_lock:
            self._check_version(attempt.version)
            if attempt.base_version is not None:
                self._check_base(attempt.base_version)
            kept = self._staging.promote(staged, attempt.version)
            try:
                result = await self._load(attempt, kept, only)
            except BaseException:
                self._staging.discard(kept)
                raise
            self._served = self._base = kept
            self._retire()
            return result

    async def _verify_and_load(
        self, attempt: _Attempt, staged: Path, specs: list[FileSpec]
    ) -> UpdateResult:
        with attempt.timeline.phase(WeightsPhase.VERIFY):
            await asyncio.to_thread(verify_files, staged, specs, self._concurrency)
            await asyncio.to_thread(self._check_tensors, self._staging.files(staged, specs))
        return await self._load_staged(attempt, staged, None)

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
            self._served, self._base = None, directory
            self._retire()
            return result

    def _check_tensors(self, files: Mapping[str, Path]) -> None:
        if self._layout is None:
            check_headers(files)
        else:
            self._layout.check(files)

    async def _load(
        self, attempt: _Attempt, directory: Path, only: tuple[str, ...] | None = None
    ) -> UpdateResult:
        evicted = await self._target.update_weights(
            attempt.version, str(directory), timeline=attempt.timeline, only=only
        )
        result = UpdateResult(self._target.policy_version, evicted, _report(attempt))
        logger.info(
            "policy v%d serves (%s %s, %d files, %.1f MB%s): %s",
            attempt.version,
            attempt.source.value,
            attempt.kind.value,
            attempt.files,
            attempt.bytes / 1e6,
            "" if attempt.density is None else f", density {attempt.density:.2%}",
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
        kind=attempt.kind,
        base_version=attempt.base_version,
        density=attempt.density,
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


def _safetensors_bytes(directory: Path) -> int:
    return sum(p.stat().st_size for p in directory.glob("*.safetensors"))


def _fetch_file(url: str, dest: Path, storage_options: Mapping[str, Any]) -> None:
    """Copies one file (a delta) from an fsspec URL."""
    try:
        fs, path = fsspec.core.url_to_fs(url, **storage_options)
    except (ValueError, ImportError) as exc:
        raise WeightsRejected("weights_path", f"{url}: {exc}") from None
    try:
        fs.get_file(path, str(dest))
    except FileNotFoundError:
        raise WeightsRejected("weights_path", f"{url} does not exist") from None
    except OSError as exc:
        raise Unavailable(f"weights_path: copying {url} failed: {exc}") from exc


def _read_delta(file: Path) -> tuple[int, delta.DeltaHeader]:
    if not file.is_file():
        raise WeightsRejected("weights_path", f"{file}: not a delta file")
    return file.stat().st_size, delta.read_header(file)
