"""Checkpoint benchmark: the exclusive hold, checkpoint phases, bytes per delta, save and restore
throughput against this disk, and a naive pickle-the-buffer baseline, all measured in one run.

A real ``Controller`` holds 1k, 10k and 100k buffered rows of realistic size; samples are built
directly and staged through the buffer inside barrier mutations (no engine runs). Every figure
about the checkpointer comes from the ``CheckpointReport`` of a real ``Checkpointer`` writing to a
real ``SnapshotStore`` in a temporary directory on this disk (real fsync and rename).

1. Hold: many checkpoints per buffer size, each after a small delta that goes through the
   controller's API (new groups admitted, staged and committed; old ones leased, acked through the
   ack journal and finalized). Two series: a *fixed* delta (the same rows at every size: the
   delta between checkpoints depends on generation rate and interval, not on buffer capacity; this
   series gives ``hold_p99_ms_by_rows``) and a delta of 1% of the buffered rows.
2. Bytes written per checkpoint against the delta at the largest size (about 100, 1k, 10k rows).
3. Save throughput: a full first snapshot (segment bytes / ``buffer_save`` + ``commit``) and
   restore throughput (a fresh controller restored from it, bytes read / restore time), each
   rep followed by this disk's raw sequential write (``os.write`` of 8 MiB chunks + ``fsync``) of
   as many bytes, and a raw read (``os.read``, 8 MiB chunks) of the snapshot's own files: the same
   bytes. Both reads start cold: every file is dropped from the page cache with
   ``posix_fadvise(DONTNEED)`` first. The host may still cache the virtual disk, favouring the
   second read of the same bytes, so repetitions alternate which read goes first (restore first
   in a quick run's single repetition).
4. Naive baseline: the whole buffer pickled and written (``pickle.dump`` + ``fsync`` + rename)
   while holding the same barrier exclusively, which is what a trainer-side checkpoint of an
   in-memory replay buffer does.

Python's garbage collector may run inside a hold; each collection is logged with ``gc.callbacks``
and holds it overlapped are counted (they stay in the figures).
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import gc
import os
import pickle
import random
import shutil
import tempfile
import time
from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import common
import numpy as np

from rolloutd.checkpoint.checkpointer import Checkpointer, CheckpointerConfig
from rolloutd.checkpoint.restore import Granularity, restore
from rolloutd.checkpoint.segments import ArrowSealer
from rolloutd.checkpoint.store import SnapshotStore
from rolloutd.domain.controller import Controller, ControllerConfig
from rolloutd.domain.encoder import AS_IS
from rolloutd.domain.group import Group, GroupMeta, Prompt, Sample
from rolloutd.domain.journal import AckRecord
from rolloutd.domain.ledger import ACKED_LEASES_REMEMBERED
from rolloutd.domain.mutation import MutationKind
from rolloutd.domain.report import (
    CheckpointPhase,
    CheckpointReport,
    Outcome,
    RowKind,
    SizePart,
    Trigger,
)
from rolloutd.domain.sampler import Sampler
from rolloutd.engines.synthetic import SyntheticEngine

NAME = "checkpoint"
FINGERPRINT = {"model": "bench", "group_size": 8, "dataset": "synthetic", "seed": 0}
CHUNK = 8 << 20
"""Raw disk figures use ``os.write``/``os.read`` of this many bytes at a time."""
VOCAB = 151_000


@dataclass(frozen=True)
class Plan:
    """What one run measures; :data:`FULL` and :data:`QUICK` are the two used."""

    sizes: tuple[int, ...] = (1_000, 10_000, 100_000)
    """Buffered rows (finished samples) per measured buffer."""
    group_size: int = 8
    tokens: tuple[int, int] = (512, 2048)
    """Generated tokens per sample, uniform; each with a float32 logprob."""
    prompt_tokens: tuple[int, int] = (64, 256)
    prompt_chars: tuple[int, int] = (200, 800)
    chars_per_token: int = 4
    """Decoded completion text kept with each sample, about 4 characters per token (English BPE)."""
    fixed_delta_groups: int = 12
    """Groups admitted (and as many finalized) before each checkpoint of the fixed-delta series."""
    hold_checkpoints: int = 200
    pct_delta: float = 0.01
    pct_checkpoints: int = 60
    throughput_reps: int = 3
    naive_reps: tuple[int, ...] = (10, 5, 3)
    """Naive baseline repetitions per size, in the order of ``sizes``."""
    delta_groups: tuple[int, ...] = (12, 125, 1250)
    """Deltas (in groups) of the bytes-versus-delta series at the largest size."""
    delta_reps: int = 5


FULL = Plan()
QUICK = Plan(
    tokens=(16, 64),
    prompt_tokens=(8, 32),
    prompt_chars=(20, 80),
    hold_checkpoints=30,
    pct_checkpoints=10,
    naive_reps=(3, 2, 1),
    delta_reps=3,
)
QUICK_CHANGES = (
    "--quick: samples of 16-64 tokens instead of 512-2048 (rows ~30x smaller) and prompts of "
    "20-80 characters instead of 200-800, 30 instead of 200 fixed-delta checkpoints and 10 "
    "instead of 60 1%-delta checkpoints per size, 3 instead of 5 checkpoints per delta in the "
    "bytes-versus-delta series, fewer naive repetitions; with rows this small, save throughput "
    "is dominated by per-file fsync latency and restore throughput by the fixed work per group "
    "and per file, not bandwidth"
)


# --- workload ---------------------------------------------------------------------------------


class SampleFactory:
    """Finished samples of realistic size, each with its own buffers, cut from random pools."""

    def __init__(self, plan: Plan, seed: int = 0) -> None:
        self.plan = plan
        self._rng = random.Random(seed)
        gen = np.random.default_rng(seed)
        self._pool = 1 << 20
        self._tokens = memoryview(gen.integers(3, VOCAB, size=self._pool, dtype=np.int32).tobytes())
        self._logprobs = memoryview(
            (-gen.exponential(0.7, size=self._pool)).astype(np.float32).tobytes()
        )
        letters = np.frombuffer(b"abcdefghijklmnopqrstuvwxyz     ", dtype=np.uint8)
        self._text = gen.choice(letters, size=self._pool).tobytes().decode()

    def _ints(self, n: int) -> array[int]:
        start = self._rng.randrange(self._pool - n) * 4
        out = array("i")
        out.frombytes(self._tokens[start : start + 4 * n])
        return out

    def _floats(self, n: int) -> array[float]:
        start = self._rng.randrange(self._pool - n) * 4
        out = array("f")
        out.frombytes(self._logprobs[start : start + 4 * n])
        return out

    def text(self, n: int) -> str:
        start = self._rng.randrange(len(self._text) - n)
        return self._text[start : start + n]

    def sample(self, index: int) -> Sample:
        plan, rng = self.plan, self._rng
        n = rng.randint(*plan.tokens)
        now = time.time()
        return Sample(
            index=index,
            token_ids=self._ints(n),
            logprobs=self._floats(n),
            text=self.text(n * plan.chars_per_token),
            finish_reason="stop" if n < plan.tokens[1] else "length",
            policy_version=0,
            prompt_token_ids=self._ints(rng.randint(*plan.prompt_tokens)),
            seed=rng.randrange(2**31 - 1),
            started_at=now - 30.0,
            finished_at=now,
        )

    def samples(self, groups: int) -> list[Sample]:
        """``groups`` groups' worth of samples, sibling indices in order."""
        gs = self.plan.group_size
        return [self.sample(i % gs) for i in range(groups * gs)]

    def prompts(self, n: int) -> list[Prompt]:
        return [
            Prompt(f"prompt-{i}", self.text(self._rng.randint(*self.plan.prompt_chars)))
            for i in range(n)
        ]


def row_bytes(samples: Sequence[Sample]) -> float:
    """Mean payload bytes per sample (token ids, logprobs, prompt ids, text)."""
    total = sum(
        4 * (len(s.token_ids) + len(s.logprobs) + len(s.prompt_token_ids)) + len(s.text)
        for s in samples
    )
    return total / len(samples)


# --- one node: controller + store + checkpointer ------------------------------------------------


class Node:
    """A controller, a store in ``root`` and a checkpointer, wired as the server wires them."""

    def __init__(self, root: Path, plan: Plan, prompts: Sequence[Prompt]) -> None:
        self.root = root
        self.plan = plan
        self.store = SnapshotStore(str(root))
        self.journal = self.store.journal
        self.controller = Controller(
            ControllerConfig(
                group_size=plan.group_size,
                buffer_capacity=1 << 30,
                max_fetch_groups=1 << 20,
                rewind_window=8,
            ),
            SyntheticEngine(),
            Sampler(prompts, seed=0),
            journal=self.journal,
            sealer=ArrowSealer(),
        )
        self.checkpointer = Checkpointer(
            self.controller, self.store, self.journal, CheckpointerConfig(), FINGERPRINT
        )
        self.step = 0

    async def admit(self, samples: Sequence[Sample], batch_groups: int = 512) -> None:
        """Admit, stage and commit groups holding ``samples`` through the buffer's API, each step
        inside a barrier mutation of its kind, as the controller's own loops do."""
        ctl, gs = self.controller, self.plan.group_size
        rooms = ctl.rooms
        for lo in range(0, len(samples), batch_groups * gs):
            chunk = samples[lo : lo + batch_groups * gs]
            groups: list[Group] = []
            async with ctl.barrier.mutation(MutationKind.ADMIT):
                for _ in range(len(chunk) // gs):
                    admission = rooms.sampler.next()
                    assert admission is not None
                    if not rooms.ids.reserved:  # journaled before issued, as admission does
                        await rooms.ids.reserve()
                    gid = rooms.ids.issue()
                    group = Group(
                        GroupMeta(
                            group_id=gid,
                            prompt=admission.prompt,
                            position=admission.position,
                            group_size=gs,
                            policy_version=ctl.policy_version,
                            admitted_at=rooms.clock(),
                            seed=gid * 104_729 % (2**31 - 1),
                        )
                    )
                    rooms.buffer.add(group)
                    rooms.accounting.admitted()
                    groups.append(group)
            async with ctl.barrier.mutation(MutationKind.STAGE_SAMPLE):
                for i, sample in enumerate(chunk):
                    rooms.buffer.stage(groups[i // gs].group_id, sample)
            async with ctl.barrier.mutation(MutationKind.COMMIT_GROUP):
                now = rooms.clock()
                for group in groups:
                    rooms.buffer.finish(group.group_id)
                    rooms.buffer.commit(group.group_id, now)
                    rooms.accounting.committed(
                        rooms.sampler.source_name(group.meta.position), group.generated_tokens
                    )

    async def consume(self, groups: int) -> None:
        """A trainer step: lease the oldest ``groups`` ready groups, ack them (journaled), and
        finalize through this step, which removes their rows from the buffer."""
        ctl = self.controller
        self.step += 1
        got = await ctl.fetch_encoded(groups, 0, "bench", AS_IS)
        assert got is not None and len(got[1]) == groups
        await ctl.ack(got[0].lease_id, self.step)
        await ctl.finalize(self.step)

    async def churn(self, factory: SampleFactory, groups: int) -> None:
        await self.admit(factory.samples(groups))
        await self.consume(groups)

    async def checkpoint(self) -> CheckpointReport:
        report = await self.checkpointer.checkpoint(Trigger.ON_DEMAND)
        if report.outcome is not Outcome.COMPLETED:
            raise RuntimeError(
                f"checkpoint {report.outcome.value}/{report.reason.value}: {report.error}"
            )
        return report

    def compacted(self, report: CheckpointReport) -> bool:
        """Whether the checkpoint also compacted segments (its manifest says so)."""
        assert report.sequence is not None
        manifest = self.store.load(report.sequence)
        written = [s for s in manifest.segments if s.written_by == report.sequence]
        return len(written) > 1 or any(s.rows != report.rows[RowKind.NEW] for s in written)

    @property
    def rows(self) -> int:
        return sum(len(g.samples) for g in self.controller.rooms.buffer.groups.values())


# --- measuring --------------------------------------------------------------------------------


class GcLog:
    """Every garbage collection with its wall-clock span, to find the holds one fell into."""

    def __init__(self) -> None:
        self.spans: list[tuple[int, int, int]] = []
        self._start = 0

    def __call__(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._start = time.time_ns()
        else:
            self.spans.append((self._start, time.time_ns(), info["generation"]))

    def within(self, start_ns: int, end_ns: int) -> list[tuple[int, int, int]]:
        return [s for s in self.spans if s[0] < end_ns and s[1] > start_ns]


GC = GcLog()


class LoopLag:
    """How late a 1 ms timer wakes on the event loop: the longest the loop could serve nothing.

    A checkpoint's synchronous work on the loop thread (the hold, and anything else not handed to
    a worker thread) delays every RPC and mutation by as much, whether or not the barrier is held.
    """

    def __init__(self) -> None:
        self.wakes: list[tuple[int, float]] = []
        self._task: asyncio.Task[None] | None = None

    async def _run(self) -> None:
        while True:
            before = time.perf_counter()
            await asyncio.sleep(0.001)
            self.wakes.append((time.time_ns(), time.perf_counter() - before - 0.001))

    def start(self) -> None:
        self._task = asyncio.create_task(self._run())

    async def stop(self) -> None:
        assert self._task is not None
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task

    def worst(self, start_ns: int, end_ns: int) -> float:
        """The longest stall that ended within ``[start_ns, end_ns]`` (plus one tick), seconds."""
        late = [lag for at, lag in self.wakes if start_ns <= at <= end_ns + 2_000_000]
        return max(late, default=0.0)


def phase_s(report: CheckpointReport, phase: CheckpointPhase) -> float:
    return next(p.seconds for p in report.phases if p.phase is phase)


@dataclass
class Series:
    """Checkpoints of one kind: hold, per-phase and total seconds, rows and bytes of each, and
    (when a :class:`LoopLag` watched) the longest event-loop stall during each."""

    lag: LoopLag | None = None
    reports: list[CheckpointReport] = field(default_factory=list)
    compacted: list[bool] = field(default_factory=list)
    manifest_bytes: list[int] = field(default_factory=list)

    def add(self, report: CheckpointReport, node: Node) -> None:
        self.reports.append(report)
        self.compacted.append(node.compacted(report))
        assert report.sequence is not None
        self.manifest_bytes.append(len(node.store.load(report.sequence).to_json()))

    def holds_s(self) -> list[float]:
        return [phase_s(r, CheckpointPhase.EXCLUSIVE_HOLD) for r in self.reports]

    def gc_holds(self) -> list[bool]:
        out = []
        for r in self.reports:
            hold = next(p for p in r.phases if p.phase is CheckpointPhase.EXCLUSIVE_HOLD)
            out.append(bool(GC.within(hold.start_ns, hold.end_ns)))
        return out

    def figures(self) -> dict[str, Any]:
        holds = self.holds_s()
        gc_hit = self.gc_holds()
        clean = [h for h, hit in zip(holds, gc_hit, strict=True) if not hit]
        segments = [r.size_bytes[SizePart.SEGMENTS] for r in self.reports]
        plain = [b for b, c in zip(segments, self.compacted, strict=True) if not c] or segments
        out = {
            "checkpoints": len(self.reports),
            "hold_ms": common.summary(holds, 1e3),
            "holds_with_gc": sum(gc_hit),
            "hold_p99_ms_without_gc": common.percentile(clean, 99) * 1e3 if clean else None,
            "duration_ms": common.summary([r.seconds for r in self.reports], 1e3),
            "phase_ms": {
                p.value: common.summary([phase_s(r, p) for r in self.reports], 1e3)
                for p in CheckpointPhase
            },
            "new_rows": common.median([r.rows[RowKind.NEW] for r in self.reports]),
            "removed_rows": common.median([r.rows[RowKind.REMOVED] for r in self.reports]),
            "live_rows": common.median([r.rows[RowKind.LIVE] for r in self.reports]),
            "bytes": {
                part.value: common.summary([r.size_bytes[part] for r in self.reports])
                for part in SizePart
            },
            "manifest_bytes": common.summary(self.manifest_bytes),
            "compactions": sum(self.compacted),
            "segment_bytes_p50_without_compaction": common.median(plain),
            "segment_bytes_mean_with_compaction": sum(segments) / len(segments),
        }
        collections = [s for r in self.reports for s in GC.within(r.started_ns, r.ended_ns)]
        out["gc_during_checkpoints"] = {
            "collections": len(collections),
            "full_collections": sum(1 for s in collections if s[2] == 2),
            "longest_ms": max(((s[1] - s[0]) / 1e6 for s in collections), default=0.0),
        }
        if self.lag is not None:
            stalls = [self.lag.worst(r.started_ns, r.ended_ns) for r in self.reports]
            out["loop_stall_ms"] = common.summary(stalls, 1e3)
        return out


def release_memory() -> None:
    """Collect garbage and hand freed heap back to the OS.

    A restore decodes on a worker thread, whose malloc arena keeps the freed rows of one
    repetition; the next may run on another thread and arena, so without this the process grows
    by a snapshot per repetition (a restore happens once per process in the service).
    """
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def drop_cache(root: Path) -> None:
    """Drop every file under ``root`` from the page cache (they are clean: all were fsynced)."""
    for path in root.rglob("*"):
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def raw_write(path: Path, size: int, payload: bytes) -> float:
    """Seconds to write ``size`` bytes sequentially in 8 MiB chunks and fsync them."""
    view = memoryview(payload)
    started = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        left = size
        while left:
            left -= os.write(fd, view[: min(left, CHUNK)])
        os.fsync(fd)
    finally:
        os.close(fd)
    return time.perf_counter() - started


def raw_read(paths: Sequence[Path], root: Path) -> float:
    """Seconds to read ``paths`` one after the other in 8 MiB chunks, from a cold page cache
    (everything under ``root`` is dropped from it first)."""
    drop_cache(root)
    started = time.perf_counter()
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            while os.read(fd, CHUNK):
                pass
        finally:
            os.close(fd)
    return time.perf_counter() - started


def full_collection_s() -> float:
    """Seconds one full garbage collection takes now: the longest pause the collector can
    impose with what is buffered (a restore freezes what it built, so it is not scanned)."""
    started = time.perf_counter()
    gc.collect()
    return time.perf_counter() - started


def payload_bytes(samples: Sequence[Sample]) -> float:
    return row_bytes(samples) * len(samples)


def naive_checkpoint(node: Node, path: Path) -> tuple[float, float, int]:
    """Pickle the whole buffer to ``path`` (fsync, rename); returns (pickle+write s, fsync s, bytes).

    Runs while the caller holds the barrier exclusively: everything here is hold time."""
    tmp = path.with_suffix(".partial")
    started = time.perf_counter()
    with open(tmp, "wb") as f:
        pickle.dump(node.controller.rooms.buffer, f, protocol=pickle.HIGHEST_PROTOCOL)
        f.flush()
        written = time.perf_counter()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
    os.fsync(fd)
    os.close(fd)
    return written - started, time.perf_counter() - written, os.stat(path).st_size


async def naive_hold(node: Node, path: Path) -> dict[str, float]:
    barrier = node.controller.barrier
    async with barrier.exclusive():
        started = time.perf_counter()
        dump_s, fsync_s, size = naive_checkpoint(node, path)
        hold_s = time.perf_counter() - started
    return {"hold_s": hold_s, "pickle_write_s": dump_s, "fsync_s": fsync_s, "bytes": size}


async def full_snapshot_rep(
    root: Path,
    plan: Plan,
    prompts: Sequence[Prompt],
    samples: Sequence[Sample],
    payload: bytes,
    raw_read_first: bool,
) -> dict[str, Any]:
    """A full first snapshot of ``samples`` and a raw write of as many bytes; then a cold
    restore of the snapshot into a fresh controller and a cold raw read of the snapshot's own
    files (the same bytes), in the order ``raw_read_first`` says: whichever reads second may
    find them in the virtual disk's host cache, so repetitions alternate."""
    store_dir = root / "store"
    # The benchmark's own samples leave the collector's view, and the buffer gets fresh ones as
    # generation makes them: the live pause below is then the buffer's, as in a service.
    gc.freeze()
    node = Node(store_dir, plan, prompts)
    await node.admit([replace(s) for s in samples])
    report = await node.checkpoint()
    segment_bytes = report.size_bytes[SizePart.SEGMENTS]
    save_s = phase_s(report, CheckpointPhase.BUFFER_SAVE) + phase_s(report, CheckpointPhase.COMMIT)
    live_gc_s = full_collection_s()
    del node
    raw_path = root / "raw.bin"
    write_s = raw_write(raw_path, segment_bytes, payload)
    raw_path.unlink()
    files = [p for d in ("segments", "sidecars") for p in sorted((store_dir / d).iterdir())]
    snapshot_bytes = sum(p.stat().st_size for p in files)

    release_memory()
    read_s = raw_read(files, root) if raw_read_first else 0.0
    drop_cache(store_dir)
    fresh = Node(store_dir, plan, prompts)
    rss_before = common.rss_gib()
    restored = await restore(
        fresh.controller,
        fresh.store,
        fresh.checkpointer,
        "latest",
        FINGERPRINT,
        Granularity.SIBLING,
    )
    restored_rows = fresh.rows
    rss_restored = (common.rss_gib() - rss_before) * (1 << 30)
    restored_gc_s = full_collection_s()
    del fresh
    gc.unfreeze()  # restore froze what it built; the next repetition starts as a process would
    release_memory()
    if not raw_read_first:
        read_s = raw_read(files, root)
    shutil.rmtree(store_dir)
    if restored_rows != len(samples):
        raise RuntimeError(f"restored {restored_rows} rows, expected {len(samples)}")
    return {
        "segment_bytes": segment_bytes,
        "total_bytes": report.size_bytes[SizePart.TOTAL],
        "checkpoint_s": report.seconds,
        "phase_s": report.phase_seconds(),
        "save_s": save_s,
        "save_mb_s": segment_bytes / save_s / 1e6,
        "raw_write_s": write_s,
        "raw_write_mb_s": segment_bytes / write_s / 1e6,
        "restore_bytes": snapshot_bytes,
        "restore_s": restored.seconds,
        "restore_phase_s": {p.phase.value: p.seconds for p in restored.phases},
        "restore_mb_s": snapshot_bytes / restored.seconds / 1e6,
        "rss_per_payload_byte_restored": rss_restored / payload_bytes(samples),
        "full_gc_ms_live": live_gc_s * 1e3,
        "full_gc_ms_restored": restored_gc_s * 1e3,
        "raw_read_first": raw_read_first,
        "raw_read_s": read_s,
        "raw_read_mb_s": snapshot_bytes / read_s / 1e6,
    }


# --- the run ------------------------------------------------------------------------------------


async def measure_size(
    rows: int,
    naive_reps: int,
    plan: Plan,
    factory: SampleFactory,
    prompts: Sequence[Prompt],
    base: Sequence[Sample],
    payload: bytes,
    root: Path,
    largest: bool,
) -> dict[str, Any]:
    out: dict[str, Any] = {"rows": rows, "groups": rows // plan.group_size}
    samples = base[:rows]
    out["payload_bytes"] = int(row_bytes(samples) * rows)

    reps = []
    for rep in range(plan.throughput_reps):
        common.progress(
            f"{rows:,} rows: full snapshot, raw write, restore, raw read "
            f"({rep + 1}/{plan.throughput_reps})"
        )
        reps.append(await full_snapshot_rep(root, plan, prompts, samples, payload, rep % 2 == 1))
        last = reps[-1]
        common.progress(
            f"{rows:,} rows: save {last['save_mb_s']:,.0f} MB/s (raw write "
            f"{last['raw_write_mb_s']:,.0f}), restore {last['restore_mb_s']:,.0f} MB/s (raw read "
            f"{last['raw_read_mb_s']:,.0f}); RSS {common.rss_gib():.1f} GiB"
        )
    out["full_snapshot"] = reps
    for key in ("save", "raw_write", "restore", "raw_read"):
        out[f"{key}_mb_s_median"] = common.median([r[f"{key}_mb_s"] for r in reps])
        out[f"{key}_s_median"] = common.median([r[f"{key}_s"] for r in reps])
    for key in ("rss_per_payload_byte_restored", "full_gc_ms_live", "full_gc_ms_restored"):
        out[key] = common.median([r[key] for r in reps])
    common.progress(
        f"{rows:,} rows: restored buffer {out['rss_per_payload_byte_restored']:.2f} bytes of RSS "
        f"per payload byte; a full collection takes {out['full_gc_ms_live']:,.1f} ms with "
        f"the rows live in the buffer, {out['full_gc_ms_restored']:,.2f} ms once the restore "
        "froze what it built"
    )

    node = Node(root / "store", plan, prompts)
    await node.admit(samples)
    await node.checkpoint()  # the full first snapshot; the series below are incremental

    lag = LoopLag()
    lag.start()
    fixed = Series(lag)
    quarter = max(plan.hold_checkpoints // 4, 1)
    for i in range(plan.hold_checkpoints):
        await node.churn(factory, plan.fixed_delta_groups)
        fixed.add(await node.checkpoint(), node)
        if (i + 1) % quarter == 0:
            holds = fixed.holds_s()
            common.progress(
                f"{rows:,} rows: fixed-delta checkpoint {i + 1}/{plan.hold_checkpoints}, "
                f"hold p50 {common.median(holds) * 1e3:.3f} ms, max {max(holds) * 1e3:.3f} ms; "
                f"RSS {common.rss_gib():.1f} GiB"
            )
    await lag.stop()
    out["fixed_delta"] = {"delta_groups": plan.fixed_delta_groups, **fixed.figures()}

    pct_groups = max(1, round(rows * plan.pct_delta / plan.group_size))
    pct = Series()
    for _ in range(plan.pct_checkpoints):
        await node.churn(factory, pct_groups)
        pct.add(await node.checkpoint(), node)
    out["pct_delta"] = {"delta_groups": pct_groups, **pct.figures()}
    common.progress(
        f"{rows:,} rows: 1% delta ({pct_groups * plan.group_size} rows) hold p99 "
        f"{out['pct_delta']['hold_ms']['p99']:.3f} ms over {plan.pct_checkpoints} checkpoints"
    )

    naive = []
    for rep in range(naive_reps):
        naive.append(await naive_hold(node, root / "naive.pickle"))
        common.progress(
            f"{rows:,} rows: naive pickle hold {naive[-1]['hold_s'] * 1e3:,.1f} ms "
            f"({rep + 1}/{naive_reps}); RSS {common.rss_gib():.1f} GiB"
        )
    (root / "naive.pickle").unlink()
    release_memory()  # the pickler's memo held a copy of every array
    out["naive"] = {
        "hold_ms": common.summary([n["hold_s"] for n in naive], 1e3),
        "pickle_write_ms": common.summary([n["pickle_write_s"] for n in naive], 1e3),
        "fsync_ms": common.summary([n["fsync_s"] for n in naive], 1e3),
        "bytes": naive[-1]["bytes"],
    }

    if largest:
        out["bytes_vs_delta"] = await bytes_vs_delta(node, plan, factory)
        out["aged_ledger"] = await aged_ledger(node, plan, factory)
    del node
    shutil.rmtree(root / "store")
    return out


async def bytes_vs_delta(node: Node, plan: Plan, factory: SampleFactory) -> list[dict[str, Any]]:
    points = []
    for groups in plan.delta_groups:
        series = Series()
        for _ in range(plan.delta_reps):
            await node.churn(factory, groups)
            series.add(await node.checkpoint(), node)
        figures = series.figures()
        new_rows = figures["new_rows"]
        segment_bytes = figures["segment_bytes_p50_without_compaction"]
        sidecar_bytes = figures["bytes"]["sidecar"]["p50"]
        group_bytes = figures["bytes"]["groups"]["p50"]
        manifest_bytes = figures["manifest_bytes"]["p50"]
        other_bytes = group_bytes + sidecar_bytes + manifest_bytes
        point = {
            "delta_rows": groups * plan.group_size,
            "checkpoints": len(series.reports),
            "compactions": figures["compactions"],
            "new_rows": new_rows,
            "removed_rows": figures["removed_rows"],
            "segment_bytes": segment_bytes,
            "segment_bytes_mean_with_compaction": figures["segment_bytes_mean_with_compaction"],
            "group_bytes": group_bytes,
            "sidecar_bytes": sidecar_bytes,
            "manifest_bytes": manifest_bytes,
            "total_bytes": segment_bytes + other_bytes,
            "segment_bytes_per_row": segment_bytes / new_rows,
            "total_bytes_per_row": (segment_bytes + other_bytes) / new_rows,
            "hold_ms_p50": figures["hold_ms"]["p50"],
            "duration_ms_p50": figures["duration_ms"]["p50"],
        }
        points.append(point)
        common.progress(
            f"delta {point['delta_rows']:,} rows: segments {point['segment_bytes'] / 1e6:,.2f} MB, "
            f"groups {group_bytes / 1e3:,.1f} kB, sidecar {sidecar_bytes / 1e3:,.1f} kB, "
            f"manifest {manifest_bytes / 1e3:,.1f} kB, hold {point['hold_ms_p50']:.3f} ms; "
            f"RSS {common.rss_gib():.1f} GiB"
        )
    return points


async def aged_ledger(node: Node, plan: Plan, factory: SampleFactory) -> dict[str, Any]:
    """The fixed-delta hold once the ledger of finalized leases is full, as after a long run.

    Reaching it through the RPC path takes 65,536 journaled acks (one fdatasync each), so the
    leases are acked and finalized through the buffer's own ``finalize`` inside a FINALIZE
    mutation, as ack records without groups; every checkpoint after that is measured as usual.
    """
    ctl = node.controller
    ledger = ctl.rooms.ledger
    async with ctl.barrier.mutation(MutationKind.FINALIZE):
        node.step += 1
        for i in range(ACKED_LEASES_REMEMBERED):
            lease_id = f"aged-{i:08x}"
            ledger.record_ack(AckRecord(lease_id, (), node.step, ctl.rooms.clock()))
        ledger.finalize(node.step)
    await node.checkpoint()  # takes the 65,536 newly finalized leases
    series = Series()
    for _ in range(max(plan.hold_checkpoints // 4, 5)):
        await node.churn(factory, plan.fixed_delta_groups)
        series.add(await node.checkpoint(), node)
    figures = series.figures()
    common.progress(
        f"aged ledger ({len(ledger.finalized_leases):,} finalized leases): hold p50 "
        f"{figures['hold_ms']['p50']:.3f} ms, p99 {figures['hold_ms']['p99']:.3f} ms"
    )
    return {"finalized_leases": len(ledger.finalized_leases), **figures}


async def run(plan: Plan, quick: bool) -> dict[str, Any]:
    started = time.time()
    gc.callbacks.append(GC)
    factory = SampleFactory(plan)
    largest = max(plan.sizes)
    common.progress(f"building {largest:,} samples ({plan.tokens[0]}-{plan.tokens[1]} tokens each)")
    base = factory.samples(largest // plan.group_size)
    prompts = factory.prompts(4 * largest // plan.group_size)
    payload = os.urandom(CHUNK)
    mean_row = row_bytes(base)
    common.progress(
        f"{mean_row / 1e3:,.1f} kB of payload per row; {mean_row * largest / 1e9:.2f} GB at "
        f"{largest:,} rows"
    )
    sizes: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(
        prefix="rolloutd-bench-", dir=os.environ.get("BENCH_DIR")
    ) as tmp:
        common.progress(f"store and raw files under {tmp}")
        for rows, naive_reps in zip(plan.sizes, plan.naive_reps, strict=True):
            sizes[str(rows)] = await measure_size(
                rows, naive_reps, plan, factory, prompts, base, payload, Path(tmp), rows == largest
            )
            release_memory()
    gc.callbacks.remove(GC)
    return assemble(plan, quick, sizes, mean_row, started)


def assemble(
    plan: Plan, quick: bool, sizes: dict[str, Any], mean_row: float, started: float
) -> dict[str, Any]:
    keys = [str(n) for n in plan.sizes]
    top = keys[-1]
    large = sizes[top]
    hold_p99 = {k: sizes[k]["fixed_delta"]["hold_ms"]["p99"] for k in keys}
    hold_p50 = {k: sizes[k]["fixed_delta"]["hold_ms"]["p50"] for k in keys}
    scaling = hold_p99[top] / hold_p99[keys[0]]
    naive_ratio = large["naive"]["hold_ms"]["p50"] / hold_p99[top]
    save_vs_disk = large["save_mb_s_median"] / large["raw_write_mb_s_median"]
    restore_vs_disk = large["restore_mb_s_median"] / large["raw_read_mb_s_median"]
    reps = large["full_snapshot"]
    save_rounds = [r["save_mb_s"] / r["raw_write_mb_s"] for r in reps]
    restore_rounds = [r["restore_mb_s"] / r["raw_read_mb_s"] for r in reps]
    points = large["bytes_vs_delta"]
    seg_prop = points[0]["segment_bytes_per_row"] / points[-1]["segment_bytes_per_row"]
    tot_prop = points[0]["total_bytes_per_row"] / points[-1]["total_bytes_per_row"]
    aged = large["aged_ledger"]["hold_ms"]["p99"]
    fixed_rows = plan.fixed_delta_groups * plan.group_size
    headline = [
        common.headline(
            f"hold p99 at {int(top):,} rows",
            hold_p99[top],
            "ms",
            "< 1 ms",
            hold_p99[top] < 1.0,
            f"after a delta of {fixed_rows} new and {fixed_rows} removed rows",
        ),
        common.headline(
            "hold_scaling_ratio",
            scaling,
            "x",
            "<= 2 (largest / smallest p99)",
            scaling <= 2.0,
            f"{int(top):,} vs {int(keys[0]):,} rows, same delta",
        ),
        common.headline(
            "hold p99, ledger of 65,536 finalized leases",
            aged,
            "ms",
            "< 1 ms",
            aged < 1.0,
            f"{int(top):,} rows, as after a long run",
        ),
        common.headline(
            "segment bytes per delta row, smallest / largest delta",
            seg_prop,
            "x",
            "~1 (proportional)",
            seg_prop <= 1.25,
            f"deltas {points[0]['delta_rows']:,} and {points[-1]['delta_rows']:,} rows",
        ),
        common.headline(
            "all bytes per delta row, smallest / largest delta",
            tot_prop,
            "x",
            "~1 (proportional)",
            tot_prop <= 1.25,
            "segments, group segments, sidecar and manifest",
        ),
        common.headline(
            "save_vs_disk",
            save_vs_disk,
            "",
            ">= 0.70",
            save_vs_disk >= 0.7,
            "full snapshot vs raw write+fsync, same bytes (medians of each); per round "
            + common.noise_note(save_rounds),
        ),
        common.headline(
            "restore_vs_disk",
            restore_vs_disk,
            "",
            ">= 0.70",
            restore_vs_disk >= 0.7,
            "restore vs raw read, both from a cold page cache (medians of each); per round "
            + common.noise_note(restore_rounds),
        ),
        common.headline(
            "RSS per payload byte, restored buffer",
            large["rss_per_payload_byte_restored"],
            "",
            "<= 1.5",
            large["rss_per_payload_byte_restored"] <= 1.5,
            f"{int(top):,} rows kept in the snapshot's verified buffers",
        ),
        common.headline(
            "full GC pause, restored buffer",
            large["full_gc_ms_restored"],
            "ms",
            "",
            None,
            f"{int(top):,} rows, after gc.freeze(); {large['full_gc_ms_live']:,.0f} ms with "
            "the same rows live in the buffer",
        ),
        common.headline(
            "naive_hold_ratio",
            naive_ratio,
            "x",
            ">= 100",
            naive_ratio >= 100,
            "naive p50 / ours p99",
        ),
    ]
    return {
        "benchmark": NAME,
        "quick": quick,
        "quick_changes": QUICK_CHANGES if quick else "",
        "conditions": common.conditions(started, peak_rss_gib=common.peak_rss_gib()),
        "workload": {
            "group_size": plan.group_size,
            "tokens": list(plan.tokens),
            "prompt_tokens": list(plan.prompt_tokens),
            "chars_per_token": plan.chars_per_token,
            "payload_bytes_per_row": mean_row,
            "fixed_delta_rows": fixed_rows,
            "pct_delta": plan.pct_delta,
        },
        "hold_p99_ms_by_rows": hold_p99,
        "hold_p50_ms_by_rows": hold_p50,
        "hold_p99_ms_by_rows_1pct_delta": {
            k: sizes[k]["pct_delta"]["hold_ms"]["p99"] for k in keys
        },
        "hold_scaling_ratio": scaling,
        "naive_hold_ratio": naive_ratio,
        "save_vs_disk": save_vs_disk,
        "restore_vs_disk": restore_vs_disk,
        "save_vs_disk_noise": common.noise(save_rounds),
        "restore_vs_disk_noise": common.noise(restore_rounds),
        "rss_per_payload_byte_restored": large["rss_per_payload_byte_restored"],
        "full_gc_ms_live": large["full_gc_ms_live"],
        "full_gc_ms_restored": large["full_gc_ms_restored"],
        "bytes_proportionality_segments": seg_prop,
        "bytes_proportionality_total": tot_prop,
        "aged_ledger_hold_p99_ms": aged,
        "sizes": sizes,
        "headline": headline,
    }


# --- reporting ----------------------------------------------------------------------------------


def markdown(result: dict[str, Any]) -> str:
    sizes = result["sizes"]
    keys = list(sizes)
    top = sizes[keys[-1]]
    w = result["workload"]
    c = result["conditions"]
    out = [
        "# Checkpoint benchmark\n",
        f"{'Quick run. ' + result['quick_changes'] + '.' if result['quick'] else 'Full run.'} "
        f"Rows of {w['tokens'][0]}-{w['tokens'][1]} generated tokens with float32 logprobs, "
        f"{w['prompt_tokens'][0]}-{w['prompt_tokens'][1]} prompt tokens and the decoded text "
        f"({w['payload_bytes_per_row'] / 1e3:,.1f} kB per row), groups of {w['group_size']}. "
        f"{c['cpus']} CPUs, load average {c['load_avg_1m_5m_15m'][0]:.1f} at the end, "
        f"{c['duration_s']:.0f} s, peak RSS {c['peak_rss_gib']:.1f} GiB; {c['started_at']}.\n",
        common.headline_table(result["headline"]),
        "\n## Exclusive hold and checkpoint duration\n",
        f"Each checkpoint follows a delta through the controller's API: groups admitted, staged "
        f"and committed; as many leased, acked (journaled) and finalized. Fixed delta: "
        f"{w['fixed_delta_rows']} rows new and removed at every size. Times in ms.\n",
        common.markdown_table(
            [
                "rows",
                "checkpoints",
                "hold p50",
                "hold p99",
                "holds with a GC",
                "hold p99, 1% delta",
                "1% delta rows",
                "duration p50",
                "loop stall p99",
                "naive hold p50",
            ],
            [
                (
                    int(k),
                    s["fixed_delta"]["checkpoints"],
                    s["fixed_delta"]["hold_ms"]["p50"],
                    s["fixed_delta"]["hold_ms"]["p99"],
                    s["fixed_delta"]["holds_with_gc"],
                    s["pct_delta"]["hold_ms"]["p99"],
                    s["pct_delta"]["delta_groups"] * w["group_size"],
                    s["fixed_delta"]["duration_ms"]["p50"],
                    s["fixed_delta"]["loop_stall_ms"]["p99"],
                    s["naive"]["hold_ms"]["p50"],
                )
                for k, s in sizes.items()
            ],
        ),
        "\nPhases of the fixed-delta checkpoints, p50 (p99) in ms; bytes written per checkpoint:\n",
        common.markdown_table(
            ["rows", *[p.value for p in CheckpointPhase], "segment bytes", "sidecar bytes"],
            [
                (
                    int(k),
                    *[
                        f"{common.fmt(s['fixed_delta']['phase_ms'][p.value]['p50'])} "
                        f"({common.fmt(s['fixed_delta']['phase_ms'][p.value]['p99'])})"
                        for p in CheckpointPhase
                    ],
                    s["fixed_delta"]["bytes"]["segments"]["p50"],
                    s["fixed_delta"]["bytes"]["sidecar"]["p50"],
                )
                for k, s in sizes.items()
            ],
        ),
        f"\n## Bytes written against the delta ({int(keys[-1]):,} rows buffered)\n",
        "Medians over the checkpoints that did not also compact (compaction merges the smallest "
        "segments once a snapshot lists more than 8; the mean shows what it adds).\n",
        common.markdown_table(
            [
                "delta rows",
                "segment bytes",
                "per row",
                "group bytes",
                "sidecar bytes",
                "manifest bytes",
                "all bytes",
                "all per row",
                "checkpoints (compacting)",
                "segment bytes, mean",
                "hold p50 ms",
            ],
            [
                (
                    p["delta_rows"],
                    p["segment_bytes"],
                    p["segment_bytes_per_row"],
                    p["group_bytes"],
                    p["sidecar_bytes"],
                    p["manifest_bytes"],
                    p["total_bytes"],
                    p["total_bytes_per_row"],
                    f"{p['checkpoints']} ({p['compactions']})",
                    p["segment_bytes_mean_with_compaction"],
                    p["hold_ms_p50"],
                )
                for p in top["bytes_vs_delta"]
            ],
        ),
        "\n## Full snapshot and restore against this disk (medians)\n",
        "Save: segment bytes / (buffer_save + commit) of a full first snapshot; raw: os.write of "
        "8 MiB chunks + fsync of as many bytes. Restore: every snapshot byte / restore time into "
        "a fresh controller; raw: os.read of 8 MiB chunks. Both reads after "
        "posix_fadvise(DONTNEED) of every file. Restore phases of the last repetition: the "
        "rows are read and checksummed on threads from the end of resolve_snapshot while the "
        "groups decode (dataloader); buffer indexes the rows and waits for their checksums.\n",
        common.markdown_table(
            [
                "rows",
                "snapshot bytes",
                "save MB/s",
                "raw write MB/s",
                "restore MB/s",
                "raw read MB/s",
                "restore s (resolve / groups / rows + verify wait)",
            ],
            [
                (
                    int(k),
                    s["full_snapshot"][0]["segment_bytes"],
                    s["save_mb_s_median"],
                    s["raw_write_mb_s_median"],
                    s["restore_mb_s_median"],
                    s["raw_read_mb_s_median"],
                    f"{common.fmt(s['restore_s_median'])} ("
                    + " / ".join(
                        common.fmt(s["full_snapshot"][-1]["restore_phase_s"][phase])
                        for phase in ("resolve_snapshot", "dataloader", "buffer")
                    )
                    + ")",
                )
                for k, s in sizes.items()
            ],
        ),
    ]
    return "\n".join(out)


def plot(result: dict[str, Any], path: Path) -> None:
    plt = common.pyplot()
    sizes = result["sizes"]
    rows = [int(k) for k in sizes]
    top = sizes[str(max(rows))]
    fig, ((ax1, ax2), (ax3, ax4)) = plt.subplots(2, 2, figsize=(12, 9))

    for label, key, stat, style in (
        ("ours p50, fixed delta", "fixed_delta", "p50", "o-"),
        ("ours p99, fixed delta", "fixed_delta", "p99", "s-"),
        ("ours p99, 1% delta", "pct_delta", "p99", "^--"),
        ("naive pickle p50", "naive", "p50", "x-"),
    ):
        ax1.plot(rows, [sizes[str(n)][key]["hold_ms"][stat] for n in rows], style, label=label)
    ax1.axhline(1.0, color="grey", linestyle=":", label="1 ms target")
    ax1.set(xscale="log", yscale="log", xlabel="buffered rows", ylabel="exclusive hold (ms)")
    ax1.set_title("Exclusive hold")
    ax1.legend(fontsize=8)

    bottom = [0.0] * len(rows)
    for phase in CheckpointPhase:
        values = [sizes[str(n)]["fixed_delta"]["phase_ms"][phase.value]["p50"] for n in rows]
        ax2.bar([str(n) for n in rows], values, bottom=bottom, label=phase.value)
        bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    ax2.set(xlabel="buffered rows", ylabel="ms (p50)")
    ax2.set_title("Checkpoint phases, fixed delta")
    ax2.legend(fontsize=8)

    points = top["bytes_vs_delta"]
    delta = [p["delta_rows"] for p in points]
    ax3.plot(delta, [p["segment_bytes"] / 1e6 for p in points], "o-", label="segments")
    ax3.plot(
        delta,
        [p["total_bytes"] / 1e6 for p in points],
        "s-",
        label="all (segments, groups, sidecar, manifest)",
    )
    per_row = points[-1]["segment_bytes"] / 1e6 / delta[-1]
    ax3.plot(delta, [d * per_row for d in delta], ":", color="grey", label="proportional")
    ax3.set(xscale="log", yscale="log", xlabel="delta rows", ylabel="MB written")
    ax3.set_title(f"Bytes per checkpoint, {max(rows):,} rows buffered")
    ax3.legend(fontsize=8)

    labels = ["save", "raw write", "restore", "raw read"]
    values = [top[f"{k}_mb_s_median"] for k in ("save", "raw_write", "restore", "raw_read")]
    ax4.bar(labels, values, color=["C0", "C7", "C1", "C7"])
    ax4.set(ylabel="MB/s (median)")
    ax4.set_title(f"Full snapshot and restore vs this disk, {max(rows):,} rows")

    title = "rolloutd checkpoint benchmark" + (" (quick)" if result["quick"] else "")
    fig.suptitle(title)
    common.save_figure(fig, path)


def main() -> None:
    args = common.parse_args(__doc__.splitlines()[0])
    plan = QUICK if args.quick else FULL
    if args.quick:
        common.progress(QUICK_CHANGES)
    result = asyncio.run(run(plan, args.quick))
    common.publish(result, args.json, NAME, markdown(result), plot)


if __name__ == "__main__":
    main()
