"""The dashboard's history: the service's own metric state, sampled every few seconds.

Each :class:`Point` is one reading of the Prometheus registry behind ``/metrics`` (the same
instruments, the same collection a scrape does), reduced to the series the built-in dashboard
draws. Points sit in a ring buffer, so a browser that reloads gets the history back, and are
appended to a JSON-lines file next to the checkpoints, so a restarted service serves the points
of its previous runs too.

What must hold:

- **Wall-clock time axis.** ``Point.t`` is Unix seconds, so the points of a run and of the run
  after a restart sit on one axis with the downtime between them. ``Point.run`` names the process
  that took the point; the page breaks its lines and marks a restart where it changes.
- **Counters run on across restarts.** A counter's value is its total since the history began: a
  new process starts its counters at zero, so its values are added to the totals of the last
  point on file. The difference of two consecutive points is therefore the increase between
  them, also across a restart (the restore that happened in between, the recovered groups).
- **Telemetry never stops the service.** The file is a convenience, not durable data: it is
  appended without fsync, a torn last line (a SIGKILL mid-write) is skipped at load, and a write
  that fails is logged and the point kept in memory.
- Next to a local checkpoint directory the points are one file (:class:`HistoryFile`); on an
  object store they are objects of a few points each (:class:`HistoryObjects`), since an object
  cannot be appended to. Either way a restarted service serves the points of its previous runs.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import urlsplit

from prometheus_client import CollectorRegistry

from rolloutd.telemetry import catalogue as cat
from rolloutd.telemetry import throttle
from rolloutd.telemetry.catalogue import Instrument, Kind
from rolloutd.telemetry.generation import GenAIAttr
from rolloutd.telemetry.prometheus import prometheus_label, prometheus_name

logger = logging.getLogger(__name__)
logger.addFilter(throttle.SHARED)

HISTORY_DIR = "dashboard"
HISTORY_FILE = "history.jsonl"
HISTORY_OBJECTS = f"{HISTORY_DIR}/history"
"""Where :class:`HistoryObjects` keeps its objects, under the checkpoints' prefix."""
HISTORY_BATCH = 12
"""Points per object on an object store (1 min at 5 s): the object being filled is put again,
whole, at each point, so a put stays a few tens of kB and a SIGKILL loses no point already put."""


@dataclass(frozen=True)
class Point:
    t: float
    """Wall-clock Unix seconds of the reading."""
    run: str
    """The process that took it; changes at a restart."""
    values: Mapping[str, float]
    """Series key -> value. Counters are totals since the history began; a counter left out is
    zero. A gauge left out has no value yet (e.g. no snapshot was written in this run)."""

    def to_json(self) -> dict[str, Any]:
        return {"t": self.t, "run": self.run, "v": dict(self.values)}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Point:
        return cls(float(data["t"]), str(data["run"]), {k: float(v) for k, v in data["v"].items()})


@dataclass(frozen=True)
class Series:
    """One family of series the dashboard draws, read from one Prometheus sample name."""

    key: str
    """Prefix of the keys in :attr:`Point.values`; ``key/label value[/label value]`` per split."""
    instrument: Instrument
    suffix: str = ""
    """``_sum`` or ``_count`` for a histogram; empty otherwise."""
    split_by: tuple[str, ...] = ()
    """Instrument attributes that become part of the key; every other attribute is summed."""

    @property
    def sample_name(self) -> str:
        return prometheus_name(self.instrument) + self.suffix

    @property
    def cumulative(self) -> bool:
        return self.instrument.kind in (Kind.COUNTER, Kind.OBSERVABLE_COUNTER, Kind.HISTOGRAM)

    def key_of(self, labels: Mapping[str, str]) -> str:
        return "/".join([self.key, *(labels[prometheus_label(a)] for a in self.split_by)])


PHASE = (cat.PHASE_ATTR,)

SERIES: tuple[Series, ...] = (
    Series("acked_groups", cat.ACKED_GROUPS),
    Series("trainer_step", cat.TRAINER_STEP),
    Series("staleness_sum", cat.DELIVERED_STALENESS, "_sum"),
    Series("staleness_count", cat.DELIVERED_STALENESS, "_count"),
    Series("generation_tokens", cat.GENERATION_TOKENS),
    Series("committed_tokens", cat.COMMITTED_TOKENS),
    Series("committed_groups", cat.COMMITTED_GROUPS),
    Series("checkpoint_seconds_sum", cat.CHECKPOINT_DURATION, "_sum", PHASE),
    Series("checkpoint_seconds_count", cat.CHECKPOINT_DURATION, "_count", PHASE),
    Series("blocked", cat.MUTATION_BLOCKED, split_by=("mutation.kind",)),
    Series("blocked_wait_sum", cat.MUTATION_WAIT, "_sum"),
    Series("blocked_wait_count", cat.MUTATION_WAIT, "_count"),
    Series("attempts", cat.CHECKPOINT_ATTEMPTS, split_by=("outcome", "reason")),
    Series("spacing_sum", cat.CHECKPOINT_SPACING, "_sum"),
    Series("spacing_count", cat.CHECKPOINT_SPACING, "_count"),
    Series("since_success", cat.CHECKPOINT_SINCE_SUCCESS),
    Series("interval", cat.CHECKPOINT_INTERVAL),
    Series("consecutive_failures", cat.CHECKPOINT_CONSECUTIVE_FAILURES),
    Series("restore_seconds_sum", cat.RESTORE_DURATION, "_sum", PHASE),
    Series("restore_seconds_count", cat.RESTORE_DURATION, "_count", PHASE),
    Series("recovery_groups", cat.RECOVERY_GROUPS, split_by=("state",)),
    Series("recovery_siblings", cat.RECOVERY_SIBLINGS, split_by=("disposition",)),
    Series("recovery_tokens", cat.RECOVERY_TOKENS, split_by=("disposition",)),
    Series("recovery_turns", cat.RECOVERY_TURNS, split_by=("disposition",)),
    Series("rows", cat.CHECKPOINT_ROWS, split_by=("kind",)),
    Series("size_bytes", cat.CHECKPOINT_SIZE, split_by=("part",)),
    Series("buffer_groups", cat.BUFFER_GROUPS, split_by=("state",)),
    Series("inflight_samples", cat.INFLIGHT_SAMPLES),
    Series("policy_version", cat.POLICY_VERSION),
    Series("reward_sum", cat.SAMPLE_REWARD, "_sum"),
    Series("reward_count", cat.SAMPLE_REWARD, "_count"),
    Series("score_seconds_sum", cat.GROUP_SCORE_DURATION, "_sum"),
    Series("score_seconds_count", cat.GROUP_SCORE_DURATION, "_count"),
    Series("scoring_failures", cat.SCORING_FAILURES, split_by=("failure.kind",)),
    Series("dropped_groups", cat.DROPPED_GROUPS, split_by=("reason",)),
    Series("dropped_tokens", cat.DROPPED_TOKENS, split_by=("reason",)),
    Series("tokens", cat.TOKENS, split_by=("fate",)),
    Series("goodput", cat.GOODPUT),
    Series("engine_seconds", cat.ENGINE_TIME, split_by=("state",)),
    Series("first_token_sum", cat.TIME_TO_FIRST_TOKEN, "_sum"),
    Series("first_token_count", cat.TIME_TO_FIRST_TOKEN, "_count"),
    Series("per_token_sum", cat.TIME_PER_OUTPUT_TOKEN, "_sum"),
    Series("per_token_count", cat.TIME_PER_OUTPUT_TOKEN, "_count"),
    Series("request_seconds_sum", cat.REQUEST_DURATION, "_sum"),
    Series("request_seconds_count", cat.REQUEST_DURATION, "_count"),
    Series("token_usage_sum", cat.TOKEN_USAGE, "_sum", (GenAIAttr.TOKEN_TYPE,)),
    Series("token_usage_count", cat.TOKEN_USAGE, "_count", (GenAIAttr.TOKEN_TYPE,)),
    Series("preemptions", cat.ENGINE_PREEMPTIONS),
    Series("prefix_cache_hit_ratio", cat.ENGINE_PREFIX_CACHE_HIT_RATIO),
    Series("in_flight_limit", cat.ADMISSION_IN_FLIGHT_LIMIT, split_by=("reason",)),
    Series("consumed_per_version", cat.ADMISSION_CONSUMED_PER_VERSION),
    Series("staleness_room", cat.ADMISSION_STALENESS_ROOM),
    Series("kv_cache_usage", cat.ENGINE_KV_CACHE_USAGE),
    Series("evicted_groups", cat.EVICTED_GROUPS),
)
"""What the dashboard draws; its JavaScript names these keys."""

_BY_SAMPLE = {s.sample_name: s for s in SERIES}
COUNTER_KEYS = frozenset(s.key for s in SERIES if s.cumulative)
"""Keys whose values are totals since the history began (counters and histogram sums/counts)."""


def is_cumulative(key: str) -> bool:
    return key.split("/", 1)[0] in COUNTER_KEYS


def read_registry(registry: CollectorRegistry) -> dict[str, float]:
    """One collection of ``registry`` reduced to :data:`SERIES` (this run's raw values)."""
    values: dict[str, float] = {}
    for family in registry.collect():
        for sample in family.samples:
            series = _BY_SAMPLE.get(sample.name)
            if series is None:
                continue
            key = series.key_of(sample.labels)
            values[key] = values.get(key, 0.0) + float(sample.value)
    return values


def history_path(checkpoint_dir: str) -> Path | None:
    """Where the history file of a service checkpointing to ``checkpoint_dir`` is kept; ``None``
    for an object store (see :func:`history_log`). The store ignores the ``dashboard/`` folder."""
    parts = urlsplit(checkpoint_dir)
    if parts.scheme not in ("", "file"):
        return None
    root = parts.path if parts.scheme == "file" else checkpoint_dir
    return Path(root) / HISTORY_DIR / HISTORY_FILE


class Objects(Protocol):
    """The object store the checkpoints are on, at their prefix (``checkpoint/backends.py``'s
    ``ObjectBackend``); every failure an ``OSError``."""

    url: str

    def listdir(self, path: str) -> list[str]: ...
    def read_many(self, paths: Sequence[str]) -> list[bytes]: ...
    def put(self, path: str, data: bytes) -> None: ...
    def delete(self, paths: Collection[str]) -> None: ...


class HistoryLog(Protocol):
    """Where the points outlive the process."""

    @property
    def where(self) -> str:
        """For messages: the file or prefix."""
        ...

    def load(self) -> list[Point]:
        """The newest points kept, oldest first."""
        ...

    def append(self, point: Point, kept: Iterable[Point]) -> None:
        """Keeps ``point``; ``kept``: the points in memory, for a log that rewrites itself."""
        ...


def history_log(checkpoint_dir: str, objects: Objects | None, capacity: int) -> HistoryLog:
    """The history's log next to the checkpoints: a file in a local directory, objects on an
    object store (``objects``, the store's backend)."""
    path = history_path(checkpoint_dir)
    if path is not None:
        return HistoryFile(path, capacity)
    if objects is None:
        raise ValueError(f"{checkpoint_dir} is an object store: its objects are needed")
    return HistoryObjects(objects, capacity)


def _parse(lines: Iterable[bytes | str], where: str) -> list[Point]:
    points = []
    for number, line in enumerate(lines, 1):
        try:
            points.append(Point.from_json(json.loads(line)))
        except (ValueError, KeyError, TypeError) as exc:
            # A SIGKILL can tear the line being appended; every other line is whole.
            logger.warning("%s line %d skipped: %s", where, number, exc)
    return points


class HistoryFile:
    """The points on disk: one JSON object a line, appended; rewritten with only the newest
    ``capacity`` points (temporary name, rename) once it holds twice that many."""

    def __init__(self, path: Path, capacity: int) -> None:
        self.path = path
        self._capacity = capacity
        self._lines = 0

    @property
    def where(self) -> str:
        return str(self.path)

    def load(self) -> list[Point]:
        try:
            text = self.path.read_text()
        except FileNotFoundError:
            return []
        points = _parse(text.splitlines(), str(self.path))
        self._lines = len(points)
        return points[-self._capacity :]

    def append(self, point: Point, kept: Iterable[Point]) -> None:
        """Appends ``point``; ``kept``: the points to keep if the file is due for a rewrite."""
        if self._lines >= 2 * self._capacity:
            self._rewrite(kept)
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self.path.open("a") as f:
            f.write(json.dumps(point.to_json(), separators=(",", ":")) + "\n")
        self._lines += 1

    def _rewrite(self, points: Iterable[Point]) -> None:
        tmp = self.path.with_suffix(".tmp")
        lines = [json.dumps(p.to_json(), separators=(",", ":")) + "\n" for p in points]
        tmp.write_text("".join(lines))
        os.replace(tmp, self.path)
        self._lines = len(lines)


class HistoryObjects:
    """The points on an object store: ``dashboard/history/<first point's ms>-<run>.jsonl``, one
    JSON object a line, at most :data:`HISTORY_BATCH` points an object. The object being filled
    is put again, whole, with each point (a put replaces an object at once: nothing is torn), and
    when a new one starts the oldest objects are deleted as long as the others still hold
    ``capacity`` points. Names sort by time, since runs follow one another."""

    def __init__(self, objects: Objects, capacity: int, batch: int = HISTORY_BATCH) -> None:
        self._objects = objects
        self._capacity = capacity
        self._batch = batch
        self._held: dict[str, int] = {}
        """Object name -> points in it, oldest first (of those listed at load, and this run's)."""
        self._filling: list[Point] = []
        self._name = ""

    @property
    def where(self) -> str:
        return f"{self._objects.url}/{HISTORY_OBJECTS}"

    def load(self) -> list[Point]:
        names = [n for n in self._objects.listdir(HISTORY_OBJECTS) if n.endswith(".jsonl")]
        datas = self._objects.read_many([f"{HISTORY_OBJECTS}/{n}" for n in names])
        points: list[Point] = []
        for name, data in zip(names, datas, strict=True):
            found = _parse(data.splitlines(), f"{self.where}/{name}")
            self._held[name] = len(found)
            points += found
        return points[-self._capacity :]

    def append(self, point: Point, kept: Iterable[Point]) -> None:
        if not self._filling or len(self._filling) >= self._batch:
            self._filling = []
            self._name = f"{round(point.t * 1000):015d}-{point.run}.jsonl"
            self._prune()
        self._filling.append(point)
        lines = [json.dumps(p.to_json(), separators=(",", ":")) + "\n" for p in self._filling]
        self._objects.put(f"{HISTORY_OBJECTS}/{self._name}", "".join(lines).encode())
        self._held[self._name] = len(self._filling)

    def _prune(self) -> None:
        """Deletes the oldest objects whose points the newer ones make unneeded."""
        names = list(self._held)
        doomed: list[str] = []
        newer = sum(self._held.values())
        for name in names:
            newer -= self._held[name]
            if newer < self._capacity:
                break
            doomed.append(name)
        if doomed:
            self._objects.delete([f"{HISTORY_OBJECTS}/{n}" for n in doomed])
            for name in doomed:
                del self._held[name]


class MetricHistory:
    """A ring buffer of :class:`Point` over one Prometheus registry, optionally kept in a file.

    :meth:`sample` reads the registry (the cost of one ``/metrics`` scrape) and is meant for a
    worker thread; :meth:`points` may be called from any thread.
    """

    def __init__(
        self,
        registry: CollectorRegistry,
        *,
        run: str,
        capacity: int,
        log: HistoryLog | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be at least 1, got {capacity}")
        self.run = run
        self.capacity = capacity
        self._registry = registry
        self._clock = clock
        self._file = log
        self._lock = threading.Lock()
        """Guards ``_points``, which readers copy from other threads."""
        self._sampling = threading.Lock()
        """One reading at a time: the final one at shutdown may overlap a cancelled tick's."""
        self._points: deque[Point] = deque(maxlen=capacity)
        self._offsets: dict[str, float] = {}
        """Counter totals of the previous runs, which this run's raw values add to."""
        if self._file is not None:
            try:
                self._points.extend(self._file.load())
            except OSError as exc:
                logger.warning("dashboard history not read from %s: %s", self._file.where, exc)
        if self._points:
            last = self._points[-1]
            self._offsets = {k: v for k, v in last.values.items() if is_cumulative(k)}

    def sample(self) -> Point:
        with self._sampling:
            return self._sample()

    def _sample(self) -> Point:
        raw = read_registry(self._registry)
        values = {k: v + self._offsets.get(k, 0.0) for k, v in raw.items()}
        for key, total in self._offsets.items():
            values.setdefault(key, total)
        point = Point(
            self._clock(),
            self.run,
            {k: v for k, v in values.items() if v != 0.0 or not is_cumulative(k)},
        )
        with self._lock:
            self._points.append(point)
            kept = list(self._points)
        if self._file is not None:
            try:
                self._file.append(point, kept)
            except OSError as exc:
                logger.warning("dashboard history not written to %s: %s", self._file.where, exc)
        return point

    def points(self, since: float | None = None) -> list[Point]:
        """The points newer than ``since`` (all of them when ``None``), oldest first."""
        with self._lock:
            points = list(self._points)
        if since is None:
            return points
        return [p for p in points if p.t > since]

    async def run_every(self, interval_s: float) -> None:
        """Samples every ``interval_s`` until cancelled; a failed reading is logged and skipped."""
        while True:
            try:
                await asyncio.to_thread(self.sample)
            except Exception:
                # Telemetry must never break the host; the next tick tries again.
                logger.exception("dashboard history: reading the metrics failed")
            await asyncio.sleep(interval_s)
