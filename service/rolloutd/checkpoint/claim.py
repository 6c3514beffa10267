"""One writer per store: a renewable claim, and fencing of a holder that lost it.

The claim is one small record at the store's root (``lock.json``): who holds the store (a random
token, host, pid, since when), when it last renewed, and an epoch that grows at each takeover.
Every change of the record is a compare-and-swap, so of two processes racing for it exactly one
wins:

* local directory: under an exclusive ``flock`` of ``lock.guard``, the record is read, compared
  with what this process last saw, and replaced (written, fsynced, renamed);
* object store (S3): a conditional put, ``If-None-Match: *`` when there is no record and
  ``If-Match: <ETag>`` of the record last seen otherwise (s3requests.py).

Rules (``checkpoint.lock_timeout_s`` = T):

* :meth:`StoreClaim.acquire` at start-up refuses a store whose holder renewed less than T ago,
  naming it (:class:`StoreHeld`); an older claim, or one whose process is gone from this host,
  is taken over.
* The holder renews every T/3 (:meth:`renew`). Before each write to the store (a publish,
  retention, a journal record) :meth:`check` costs nothing when the last renewal is younger than
  T/2, and renews otherwise: a holder that was paused (SIGSTOP, a frozen VM, a partition) finds on
  its first write that another process took over, and raises :class:`Fenced` instead of writing.
  A fenced claim stays fenced; the service turns not-ready and says why.

Clocks of the hosts sharing a store are assumed to agree within T/2.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import secrets
import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, replace

from rolloutd.checkpoint import s3requests
from rolloutd.checkpoint.backends import LocalBackend, ObjectBackend, StoreError

log = logging.getLogger(__name__)

LOCK = "lock.json"
GUARD = "lock.guard"


class StoreHeld(StoreError):
    """Another live process holds the store."""


class Fenced(StoreError):
    """This process lost its claim on the store: it must write nothing more there."""


class _Lost(Exception):
    """A compare-and-swap found another record than the one this process last saw."""


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
        self._version: bytes | str | None = None
        """What this process last wrote: the record's bytes (local) or its ETag (object store)."""
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

    def acquire(self) -> Holder | None:
        """Claims the store; returns the holder it took over, if any. Raises :class:`StoreHeld`
        naming a live holder, and ``OSError`` when the store cannot be written (the service
        retries, not ready meanwhile)."""
        self._wanted = True
        for _ in range(3):  # another process may win a race for a stale claim
            current, version = self._read()
            now = self._clock()
            if (
                current is not None
                and current.token != self._me.token
                and self._alive(current, now)
            ):
                raise StoreHeld(
                    f"the store {self._backend.url} is held by {current.describe(now)}; stop "
                    f"that process, or wait checkpoint.lock_timeout_s={self.timeout_s:g}s after "
                    "it stops renewing, or give this one another --checkpoint-dir"
                )
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
            self._me, self._renewed = mine, time.monotonic()
            if current is not None:
                log.warning("took over the store from %s", current.describe(now))
            return current
        raise StoreHeld(f"the store {self._backend.url} is being claimed by another process")

    def renew(self) -> None:
        """Renews the claim; raises :class:`Fenced` (and stays fenced) if it was taken over."""
        with self._renewing:
            self._renew()

    def _renew(self) -> None:
        if self.fenced is not None:
            raise Fenced(self.fenced)
        now = self._clock()
        renewed = replace(self._me, renewed_at=now)
        try:
            self._version = self._swap(self._version, renewed)
        except _Lost:
            current, _ = self._read()
            who = "nobody" if current is None else current.describe(now)
            self.fenced = (
                f"fenced: another process took over the store {self._backend.url} "
                f"(now held by {who}); this one publishes nothing more"
            )
            log.critical("%s", self.fenced)
            raise Fenced(self.fenced) from None
        self._me, self._renewed = renewed, time.monotonic()

    def check(self) -> None:
        """Before a write to the store: raises :class:`Fenced` if the claim was lost, and
        :class:`StoreError` while it is not held yet. Free while the last renewal is recent; a
        no-op for a process that never tries to claim the store (tools, tests of the store)."""
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

    def _read(self) -> tuple[Holder | None, bytes | str | None]:
        if isinstance(self._backend, LocalBackend):
            data = self._read_local()
            return (None if data is None else _decode(data)), data
        found = self._get_object()
        if found is None:
            return None, None
        data, etag = found
        return _decode(data), etag

    def _swap(self, expected: bytes | str | None, holder: Holder | None) -> bytes | str | None:
        """Replaces the record if it is still ``expected`` (None: absent); ``holder=None``
        deletes it. Returns the new version; raises :class:`_Lost` otherwise."""
        data = None if holder is None else json.dumps(asdict(holder)).encode()
        if isinstance(self._backend, LocalBackend):
            with self._guard():
                if self._read_local() != expected:
                    raise _Lost
                if data is None:
                    self._backend.delete([LOCK])
                else:
                    self._backend.put(LOCK, data)
            return data
        return self._swap_object(expected, data)

    # local

    @property
    def _root(self) -> str:
        assert isinstance(self._backend, LocalBackend)
        return self._backend.root

    def _read_local(self) -> bytes | None:
        try:
            with open(os.path.join(self._root, LOCK), "rb") as f:
                return f.read()
        except FileNotFoundError:
            return None

    @contextlib.contextmanager
    def _guard(self) -> Iterator[None]:
        os.makedirs(self._root, exist_ok=True)
        flags = os.O_RDWR | os.O_CREAT | os.O_CLOEXEC
        fd = os.open(os.path.join(self._root, GUARD), flags, 0o644)
        try:
            deadline = time.monotonic() + self.timeout_s
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if time.monotonic() > deadline:
                        raise StoreHeld(
                            f"{self._backend.url}/{GUARD} stays locked by another process"
                        ) from None
                    time.sleep(0.05)
            yield
        finally:
            os.close(fd)  # releases the flock

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

    def _swap_object(self, expected: bytes | str | None, data: bytes | None) -> str | None:
        assert isinstance(self._backend, ObjectBackend)
        assert not isinstance(expected, bytes)
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
