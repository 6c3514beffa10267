"""One writer per store: a renewable claim, and fencing of a holder that lost it.

The claim is one small record: who holds the store (a random token, host, pid, since when), when
it last renewed, and an epoch that grows at each takeover. Every change of the record is a
compare-and-swap, so of two processes racing for it exactly one wins, and none holds a lock that
a frozen process could keep:

* local directory: the record has generations, ``claim/<generation>.json``, the newest one
  current. A change after generation N writes the new record to a file of its own, fsyncs it,
  and hard-links it as generation N+1: the link fails when N+1 exists, and a link that landed
  below a newer generation (N+1 was pruned) is lost too. A released claim is an empty
  generation. The last few generations are kept;
* object store (S3): a conditional put of ``lock.json``, ``If-None-Match: *`` when there is no
  record and ``If-Match: <ETag>`` of the record last seen otherwise (s3requests.py).

Rules (``checkpoint.lock_timeout_s`` = T):

* :meth:`StoreClaim.acquire` at start-up takes over a claim older than T, or one whose process
  is gone from this host. A younger claim is waited for, up to ``checkpoint.claim_wait_s``
  (1.5 T by default) with a progress line: a holder that is frozen (SIGSTOP, a paused VM, a
  partitioned node) stops renewing and its claim lapses, so its replacement takes over instead
  of exiting and crash-looping. A holder seen renewing during the wait is alive: the start is
  refused at once, naming it (:class:`StoreHeld`), as it is when the wait runs out.
* The holder renews every T/3 (:meth:`renew`). Before each write to the store (a publish,
  retention, a journal record), and again right before a manifest becomes visible,
  :meth:`check` costs nothing while the last renewal is younger than T/2, and renews otherwise:
  a holder that was paused finds on its first write that another process took over, and raises
  :class:`Fenced` instead of writing. A fenced claim stays fenced; the service turns not-ready
  and says why.
* A renewal counts from the moment before its record was written, which is the ``renewed_at``
  others read, not from when the write returned: a renewal that stalled on the disk for longer
  than T lands already lapsed, and its holder knows it. So a holder writes only within T/2 of a
  renewal that others see as at most that old; past it, it writes nothing until a renewal
  succeeds, which it cannot once another process took over. It fences itself before another
  may take over, by the other half of T.

Clocks of the hosts sharing a store are assumed to agree within T/2.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import secrets
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace

from rolloutd.checkpoint import s3requests
from rolloutd.checkpoint.backends import LocalBackend, ObjectBackend, StoreError, fsync_dir
from rolloutd.checkpoint.faults import FaultPoint, fault_point

log = logging.getLogger(__name__)

LOCK = "lock.json"
"""The record on an object store."""
CLAIM_DIR = "claim"
"""The record's generations in a local directory."""
KEPT_GENERATIONS = 4

PROGRESS_S = 5.0
"""How often a start waiting for another process's claim to lapse says so."""


class StoreHeld(StoreError):
    """Another live process holds the store."""


class Fenced(StoreError):
    """This process lost its claim on the store: it must write nothing more there."""


class _Lost(Exception):
    """A compare-and-swap found another record than the one this process last saw."""


class _Busy(Exception):
    """The store is held, by ``holder`` (None: its record is being written right now)."""

    def __init__(self, holder: Holder | None) -> None:
        self.holder = holder


@dataclass(frozen=True)
class Holder:
    token: str
    host: str
    pid: int
    process_start: str
    """The process's start time on its host (tells a live holder from a reused pid)."""
    since: float
    renewed_at: float
    epoch: int

    def describe(self, now: float) -> str:
        since = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(self.since))
        return (
            f"host {self.host} pid {self.pid} since {since} "
            f"(renewed {now - self.renewed_at:.1f}s ago, epoch {self.epoch})"
        )


def _process_start(pid: int) -> str:
    """Start time of ``pid`` in clock ticks since boot (Linux), "" where unknown or gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[19].decode()
    except (OSError, IndexError):
        return ""


class StoreClaim:
    """This process's claim on one store (see the module docstring)."""

    def __init__(
        self,
        backend: LocalBackend | ObjectBackend,
        timeout_s: float,
        *,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._backend = backend
        self.timeout_s = timeout_s
        self._clock = clock
        self._me = Holder(
            token=secrets.token_hex(8),
            host=socket.gethostname(),
            pid=os.getpid(),
            process_start=_process_start(os.getpid()),
            since=0.0,
            renewed_at=0.0,
            epoch=0,
        )
        self._version: int | str | None = None
        """What this process last wrote: its generation (local) or its ETag (object store)."""
        self._renewed = -1.0
        """``time.monotonic()`` of the last renewal; negative while nothing is held."""
        self.fenced: str | None = None
        """Why this process lost the store; None while it holds it (or never claimed it)."""
        self._wanted = False
        """An acquire was attempted: from then on nothing is written unless the claim is held."""
        self._renewing = threading.Lock()
        """One renewal at a time: two would race on the version and the loser would think it
        had been taken over."""

    @property
    def held(self) -> bool:
        return self._renewed >= 0 and self.fenced is None

    # --- the rules -------------------------------------------------------------------------

    def acquire(self, wait_s: float = 0.0) -> Holder | None:
        """Claims the store; returns the holder it took over, if any.

        A live claim is waited for up to ``wait_s`` (see the module docstring); then, or at once
        when its holder renews meanwhile, :class:`StoreHeld` names the holder. ``OSError`` when
        the store cannot be written (the service retries, not ready meanwhile)."""
        self._wanted = True
        started = time.monotonic()
        deadline, progress = started + wait_s, started
        seen: Holder | None = None
        while True:
            try:
                return self._try_acquire()
            except _Busy as busy:
                holder = busy.holder
            now = self._clock()
            if (
                holder is not None
                and seen is not None
                and (holder.token, holder.renewed_at) != (seen.token, seen.renewed_at)
                and holder.token == seen.token
            ):
                raise StoreHeld(self._held(holder, now, "it renewed its claim just now"))
            seen = holder or seen
            left = deadline - time.monotonic()
            if left <= 0:
                raise (
                    StoreHeld(self._held(seen, now, f"waited {wait_s:g}s"))
                    if seen is not None
                    else StoreHeld(f"the store {self._backend.url} is being claimed")
                )
            if time.monotonic() >= progress:
                progress += PROGRESS_S
                log.warning(
                    "the store %s is held by %s; waiting %.0fs more for that claim to lapse "
                    "(checkpoint.claim_wait_s)",
                    self._backend.url,
                    "another process" if seen is None else seen.describe(now),
                    left,
                )
            time.sleep(min(left, self.timeout_s / 10, 1.0))

    def _held(self, holder: Holder, now: float, why: str) -> str:
        return (
            f"the store {self._backend.url} is held by {holder.describe(now)} ({why}); stop "
            f"that process, or wait checkpoint.lock_timeout_s={self.timeout_s:g}s after "
            "it stops renewing, or give this one another --checkpoint-dir"
        )

    def _try_acquire(self) -> Holder | None:
        """One attempt; :class:`_Busy` while a live holder has the store."""
        for _ in range(3):  # another process may win a race for a stale claim
            current, version = self._read()
            now, started = self._clock(), time.monotonic()
            if (
                current is not None
                and current.token != self._me.token
                and self._alive(current, now)
            ):
                raise _Busy(current)
            mine = replace(
                self._me,
                since=now,
                renewed_at=now,
                epoch=0 if current is None else current.epoch + 1,
            )
            try:
                self._version = self._swap(version, mine)
            except _Lost:
                continue
            self._me, self._renewed = mine, started
            if current is not None:
                log.warning("took over the store from %s", current.describe(now))
            return current
        raise _Busy(None)

    def renew(self) -> None:
        """Renews the claim; raises :class:`Fenced` (and stays fenced) if it was taken over."""
        with self._renewing:
            self._renew()

    def _renew(self) -> None:
        if self.fenced is not None:
            raise Fenced(self.fenced)
        now, started = self._clock(), time.monotonic()
        renewed = replace(self._me, renewed_at=now)
        try:
            self._version = self._swap(self._version, renewed, FaultPoint.CLAIM_RENEW)
        except _Lost:
            current, _ = self._read()
            who = "nobody" if current is None else current.describe(now)
            self.fenced = (
                f"fenced: another process took over the store {self._backend.url} "
                f"(now held by {who}); this one publishes nothing more"
            )
            log.critical("%s", self.fenced)
            raise Fenced(self.fenced) from None
        # from before the write: what others read (see the module docstring)
        self._me, self._renewed = renewed, started

    def check(self) -> None:
        """Before a write to the store, and right before a manifest becomes visible: raises
        :class:`Fenced` if the claim was lost, and :class:`StoreError` while it is not held yet.
        Free while the last renewal is younger than T/2, renews (waiting for one in progress)
        otherwise. A no-op for a process that never tries to claim the store (tools, tests of
        the store)."""
        if self.fenced is not None:
            raise Fenced(self.fenced)
        if self._renewed < 0:
            if self._wanted:
                raise StoreError(f"the store {self._backend.url} is not claimed yet")
            return
        if time.monotonic() - self._renewed > self.timeout_s / 2:
            with self._renewing:
                if time.monotonic() - self._renewed > self.timeout_s / 2:
                    self._renew()

    def release(self) -> None:
        """Gives the store up at shutdown, so the next process need not wait for the timeout."""
        if not self.held:
            return
        with contextlib.suppress(_Lost):
            self._swap(self._version, None)
        self._renewed = -1.0

    def _alive(self, holder: Holder, now: float) -> bool:
        if now - holder.renewed_at > self.timeout_s:
            return False
        if holder.host == self._me.host and holder.process_start:
            # on this host a dead holder (a SIGKILL, the previous container) is seen at once
            return _process_start(holder.pid) == holder.process_start
        return True

    # --- the record, compared and swapped --------------------------------------------------

    def current(self) -> Holder | None:
        """Who holds the store now, as its record says (None: nobody)."""
        return self._read()[0]

    def _read(self) -> tuple[Holder | None, int | str | None]:
        if isinstance(self._backend, LocalBackend):
            data, generation = self._read_local()
            return (None if not data else _decode(data)), generation
        found = self._get_object()
        if found is None:
            return None, None
        data, etag = found
        return _decode(data), etag

    def _swap(
        self,
        expected: int | str | None,
        holder: Holder | None,
        point: FaultPoint | None = None,
    ) -> int | str | None:
        """Replaces the record if it is still ``expected`` (None: absent); ``holder=None``
        releases it. Returns the new version; raises :class:`_Lost` otherwise. ``point``: the
        fault point of the write (a renewal's)."""
        data = None if holder is None else json.dumps(asdict(holder)).encode()
        if isinstance(self._backend, LocalBackend):
            assert not isinstance(expected, str)
            return self._link_next(expected or 0, data or b"", point)
        assert not isinstance(expected, int)
        return self._swap_object(expected, data, point)

    # local

    @property
    def _dir(self) -> str:
        assert isinstance(self._backend, LocalBackend)
        return os.path.join(self._backend.root, CLAIM_DIR)

    def _generations(self) -> list[int]:
        try:
            names = os.listdir(self._dir)
        except FileNotFoundError:
            return []
        return sorted(int(n[: -len(".json")]) for n in names if n.endswith(".json"))

    def _read_local(self) -> tuple[bytes, int]:
        """The newest generation's record (empty: released or none) and its number (0: none)."""
        while True:
            generations = self._generations()
            if not generations:
                return b"", 0
            try:
                with open(os.path.join(self._dir, f"{generations[-1]:020d}.json"), "rb") as f:
                    return f.read(), generations[-1]
            except FileNotFoundError:  # pruned since it was listed: a newer one exists
                continue

    def _link_next(self, expected: int, data: bytes, point: FaultPoint | None) -> int:
        os.makedirs(self._dir, exist_ok=True)
        new = expected + 1
        tmp = os.path.join(self._dir, f".{self._me.token}.tmp")
        try:
            with open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            if point is not None:
                fault_point(point)
            try:
                os.link(tmp, os.path.join(self._dir, f"{new:020d}.json"))
            except FileExistsError:
                raise _Lost from None
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
        fsync_dir(self._dir)
        generations = self._generations()
        if generations[-1] != new:
            raise _Lost  # it landed below a newer generation: someone else moved on
        for old in generations[:-KEPT_GENERATIONS]:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(self._dir, f"{old:020d}.json"))
        return new

    # object store

    def _bucket_key(self) -> tuple[str, str]:
        assert isinstance(self._backend, ObjectBackend)
        bucket, key, _ = self._backend.fs.split_path(self._backend._path(LOCK))
        return bucket, key

    def _get_object(self) -> tuple[bytes, str] | None:
        """The record and its ETag, from one GET (so the two agree)."""
        assert isinstance(self._backend, ObjectBackend)
        bucket, key = self._bucket_key()
        with self._backend.io(f"read {LOCK}"):
            return s3requests.get(self._backend.fs, bucket, key)

    def _swap_object(
        self, expected: bytes | str | None, data: bytes | None, point: FaultPoint | None
    ) -> str | None:
        assert isinstance(self._backend, ObjectBackend)
        assert not isinstance(expected, bytes)
        if point is not None:
            fault_point(point)
        bucket, key = self._bucket_key()
        fs = self._backend.fs
        with self._backend.io(f"write {LOCK}"):
            if data is None:
                # S3 has no conditional delete everywhere: check, then delete (release only)
                found = self._get_object()
                if found is None or found[1] != expected:
                    raise _Lost
                s3requests.delete(fs, bucket, key)
                return None
            try:
                return s3requests.put(fs, bucket, key, data, expected)
            except s3requests.PreconditionFailed as exc:
                raise _Lost from exc


def _decode(data: bytes) -> Holder:
    return Holder(**json.loads(data))
