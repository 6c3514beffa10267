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
controller's rule).

What else must hold, whatever a caller sends:

- a path or URL is checked against ``weights.allowed_urls`` / ``weights.local_root``
  (:mod:`rolloutd.weights.policy`) before anything is read;
- one update runs at a time (any source), its blocking work on the updater's own small pool; a
  transfer ends within ``weights.transfer_timeout_s`` (``DEADLINE_EXCEEDED``), and a full staging
  disk is ``RESOURCE_EXHAUSTED`` (:mod:`rolloutd.weights.pool` holds these rules);
- a push that sends nothing for ``weights.push_idle_timeout_s`` ends too (``DEADLINE_EXCEEDED``).
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

from rolloutd.domain.errors import DeadlineExceeded, FailedPrecondition, InvalidArgument
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
from rolloutd.weights.fetch import Source, remote_errors, remote_failure
from rolloutd.weights.layout import ModelLayout, WeightsRejected, check_headers, weights_file
from rolloutd.weights.policy import SourcePolicy, is_url
from rolloutd.weights.pool import UpdatePool
from rolloutd.weights.receive import PushChunk, PushHeader, PushReceiver
from rolloutd.weights.staging import FileSpec, StagingArea, check_specs, disk_full, verify_files
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
        policy: SourcePolicy | None = None,
        transfer_timeout_s: float = 1800.0,
        push_idle_timeout_s: float = 60.0,
    ) -> None:
        """``served_dir``: the full weights the engine starts with (the model directory), the
        base of a first delta; ``store``: where :meth:`catch_up` looks for newer versions;
        ``policy``: the paths and URLs ``UpdateWeights`` may name (default: local paths only)."""
        self._target = target
        self._policy = policy or SourcePolicy()
        self._push_idle_timeout_s = push_idle_timeout_s
        self._pool = UpdatePool(transfer_timeout_s)
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

    def close(self) -> None:
        """Stops the pool (without waiting for a transfer that hangs on the network)."""
        self._pool.close()

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
            work = self._update_delta(attempt, weights_path)
        else:
            work = self._update(attempt, weights_path)
        return await self._reported(
            attempt, self._pool.one_at_a_time(f"the update to v{version}", work)
        )

    async def push(self, messages: AsyncIterator[PushHeader | PushChunk]) -> UpdateResult:
        """``PushWeights``: a header, then chunks, written to staging, checked, then loaded."""
        messages = self._paced(messages, self._pool.deadline())
        first = await anext(messages, None)
        if not isinstance(first, PushHeader):
            raise InvalidArgument("header", "the first message of a push must be its header")
        attempt = _Attempt(first.version, WeightsSource.PUSH, WeightsTimeline(), time.time_ns())
        if first.base_version is not None:
            attempt.kind, attempt.base_version = WeightsKind.DELTA, first.base_version
        work = self._push(attempt, first, messages)
        return await self._reported(
            attempt, self._pool.one_at_a_time(f"the push of v{first.version}", work)
        )

    async def _paced(
        self, messages: AsyncIterator[PushHeader | PushChunk], deadline: float
    ) -> AsyncIterator[PushHeader | PushChunk]:
        """``messages``, ended with DEADLINE_EXCEEDED when one takes longer than
        ``push_idle_timeout_s`` or the push passes its transfer ``deadline``."""
        loop = asyncio.get_running_loop()
        while True:
            idle = loop.time() + self._push_idle_timeout_s
            bound = asyncio.timeout_at(min(idle, deadline))
            try:
                async with bound:
                    message = await anext(messages)
            except StopAsyncIteration:
                return
            except TimeoutError:
                if not bound.expired():
                    raise
                if idle <= deadline:
                    raise DeadlineExceeded(
                        "push: no message for weights.push_idle_timeout_s "
                        f"({self._push_idle_timeout_s:g} s); the push was abandoned"
                    ) from None
                raise DeadlineExceeded(
                    "push: the stream took longer than weights.transfer_timeout_s "
                    f"({self._pool.transfer_timeout_s:g} s) and was abandoned"
                ) from None
            yield message

    async def catch_up(self) -> UpdateResult | None:
        """Brings the engine to the weights store's newest version (anchor + chain), before the
        service admits work; None when there is no store or nothing newer in it. A gap in the
        chain raises :class:`~rolloutd.weights.store.ChainBroken` naming the missing version."""
        if self._store is None:
            return None
        current = self._target.policy_version
        plan = await self._pool.run(self._store.plan, current)
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
        work = self._catch_up(attempt, plan)
        return await self._reported(
            attempt, self._pool.one_at_a_time(f"the catch-up to v{plan.target}", work)
        )

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
        self._policy.check(weights_path)
        if attempt.source is WeightsSource.PATH:
            return await self._load_in_place(attempt, weights_path)
        deadline = self._pool.deadline()
        source = Source(weights_path, self._storage_options)
        specs = await self._pool.transfer(deadline, source, source.files)
        attempt.files, attempt.bytes = len(specs), sum(s.size for s in specs)
        staged = self._staging.new(attempt.bytes)
        try:
            with attempt.timeline.phase(WeightsPhase.TRANSFER):
                await self._pool.transfer(
                    deadline, source, source.copy, specs, staged, self._concurrency
                )
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
        receiver = PushReceiver(tuple(specs), staged, executor=self._pool.executor)
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
                    await self._pool.run(verify_files, staged, specs, self._concurrency)
                [spec] = specs
                return await self._apply_and_load(attempt, staged / spec.name)
            return await self._verify_and_load(attempt, staged, specs)
        finally:
            self._staging.discard(staged)

    async def _update_delta(self, attempt: _Attempt, weights_path: str) -> UpdateResult:
        self._check_version(attempt.version)
        self._policy.check(weights_path)
        assert attempt.base_version is not None
        self._check_base(attempt.base_version)
        if attempt.source is WeightsSource.PATH:
            return await self._apply_and_load(attempt, Path(weights_path))
        staged = self._staging.new(0)
        try:
            with attempt.timeline.phase(WeightsPhase.TRANSFER):
                file = staged / weights_path.rstrip("/").rsplit("/", 1)[-1]
                await self._pool.transfer(
                    self._pool.deadline(),
                    None,
                    _fetch_file,
                    weights_path,
                    file,
                    self._storage_options,
                )
            return await self._apply_and_load(attempt, file)
        finally:
            self._staging.discard(staged)

    async def _apply_and_load(self, attempt: _Attempt, file: Path) -> UpdateResult:
        """Decodes the delta ``file`` against the served weights into a staged directory (every
        resulting tensor checked), then loads the tensors that changed."""
        assert attempt.base_version is not None
        with attempt.timeline.phase(WeightsPhase.DECODE):
            size, header = await self._pool.run(_read_delta, file)
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
            out = self._staging.new(await self._pool.run(_safetensors_bytes, base))
            try:
                applied = await self._pool.run(delta.apply_delta, file, base, out)
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
            deadline = self._pool.deadline()
            if plan.anchor_url is not None:
                source = Source(plan.anchor_url, self._storage_options)
                specs = await self._pool.transfer(deadline, source, source.files)
                anchor = self._staging.new(sum(s.size for s in specs))
                work.append(anchor)
                with attempt.timeline.phase(WeightsPhase.TRANSFER):
                    attempt.bytes += await self._pool.transfer(
                        deadline, source, source.copy, specs, anchor, self._concurrency
                    )
                with attempt.timeline.phase(WeightsPhase.VERIFY):
                    await self._pool.run(verify_files, anchor, specs, self._concurrency)
                    await self._pool.run(self._check_tensors, self._staging.files(anchor, specs))
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
                    await self._pool.transfer(
                        deadline, None, _fetch_file, url, file, self._storage_options
                    )
                with attempt.timeline.phase(WeightsPhase.DECODE):
                    size, header = await self._pool.run(_read_delta, file)
                    attempt.bytes += size
                    if (header.base_version, header.version) != (base_version, version):
                        raise WeightsRejected(
                            url, f"holds the delta from v{header.base_version} to v{header.version}"
                        )
                    out = self._staging.new(await self._pool.run(_safetensors_bytes, base))
                    work.append(out)
                    await self._pool.run(delta.apply_delta, file, base, out, url)
                changed += header.changed
                base = out
            attempt.files = len(await self._pool.run(_safetensors_in, base))
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
            await self._pool.run(verify_files, staged, specs, self._concurrency)
            await self._pool.run(self._check_tensors, self._staging.files(staged, specs))
        return await self._load_staged(attempt, staged, None)

    async def _load_in_place(self, attempt: _Attempt, weights_path: str) -> UpdateResult:
        directory = Path(weights_path)
        if self._layout is not None:
            with attempt.timeline.phase(WeightsPhase.VERIFY):
                files = await self._pool.run(_safetensors_in, directory)
                attempt.files = len(files)
                attempt.bytes = sum(p.stat().st_size for p in files.values())
                await self._pool.run(self._check_tensors, files)
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
    """The ``*.safetensors`` files of ``directory``, each a regular file inside it."""
    files = (
        {p.name: weights_file(p, directory) for p in sorted(directory.glob("*.safetensors"))}
        if directory.is_dir()
        else {}
    )
    if not files:
        raise WeightsRejected("weights_path", "not a directory with *.safetensors files")
    return files


def _safetensors_bytes(directory: Path) -> int:
    return sum(p.stat().st_size for p in directory.glob("*.safetensors"))


def _fetch_file(url: str, dest: Path, storage_options: Mapping[str, Any]) -> None:
    """Copies one file (a delta) from an fsspec URL."""
    try:
        fs, path = fsspec.core.url_to_fs(url, **storage_options)
    except (ValueError, ImportError) as exc:
        logger.warning("weights from %s: %r", url, exc)
        raise WeightsRejected("weights_path", "its protocol cannot be read") from None
    try:
        fs.get_file(path, str(dest))
    except FileNotFoundError:
        raise WeightsRejected("weights_path", "does not exist") from None
    except OSError as exc:
        if (full := disk_full(exc)) is not None:
            raise full from exc
        raise remote_failure("copying the delta", url, exc) from None
    except remote_errors() as exc:
        raise remote_failure("copying the delta", url, exc) from None


def _read_delta(file: Path) -> tuple[int, delta.DeltaHeader]:
    weights_file(file, file.parent, "not a delta file")
    return file.stat().st_size, delta.read_header(file)
