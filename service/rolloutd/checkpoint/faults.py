"""Fault injection for crash and stall tests, at named points of the store's writes.

``ROLLOUTD_FAULT`` selects points where this process is SIGKILLed: one name
(``commit.before_rename``), a comma list, and optionally a probability per name
(``buffer_save.mid:0.3``). ``ROLLOUTD_STALL`` selects points where the calling thread sleeps,
as on a disk that stops answering for a while (fsync stalls of tens of seconds were measured
beside vLLM on two cores): ``claim.renew:3`` sleeps 3 s every time a renewal of the store's claim
is about to write. An unknown name is an error, so a typo cannot make a test pass without its
fault. With both variables unset, :func:`fault_point` costs two environment lookups.
"""

from __future__ import annotations

import enum
import os
import random
import signal
import time

ENV = "ROLLOUTD_FAULT"
STALL_ENV = "ROLLOUTD_STALL"


class FaultPoint(enum.Enum):
    """Instants where a crash must leave the previous snapshot restorable."""

    BARRIER_WAIT = "barrier_wait"
    EXCLUSIVE_HOLD = "exclusive_hold"
    BUFFER_SAVE_MID = "buffer_save.mid"
    """A segment is partly written (one record batch on its way to storage)."""
    SIDECAR_WRITE_MID = "sidecar_write.mid"
    """Half of the sidecar is written."""
    COMMIT_BEFORE_RENAME = "commit.before_rename"
    """The manifest is durable under a temporary name (object store: not yet put)."""
    COMMIT_AFTER_RENAME = "commit.after_rename"
    """The manifest has its final name, its directory not yet fsynced (object store: just put)."""
    RETIRE_MID = "retire.mid"
    """Retired manifests are moved to the trash, their files not yet deleted."""
    COMPACT_MID = "compact.mid"
    """A compacted segment is partly written."""
    JOURNAL_APPEND = "journal.append"
    """A journal record (ack, lease grant, submission, id reservation) is durable, the caller
    not yet told so."""
    CLAIM_RENEW = "claim.renew"
    """A renewal of the store's claim is about to write its record (local: under the record's
    lock, which a process waiting to take over then waits for)."""


def _point(env: str, name: str) -> FaultPoint:
    try:
        return FaultPoint(name)
    except ValueError:
        known = ", ".join(p.value for p in FaultPoint)
        raise ValueError(f"{env}: unknown fault point {name!r}; known: {known}") from None


def parse(spec: str) -> dict[FaultPoint, float]:
    """``name[:probability][,...]`` to the probability of crashing at each point."""
    points: dict[FaultPoint, float] = {}
    for item in filter(None, (part.strip() for part in spec.split(","))):
        name, _, probability = item.partition(":")
        point = _point(ENV, name)
        p = float(probability) if probability else 1.0
        if not 0.0 <= p <= 1.0:
            raise ValueError(f"{ENV}: probability of {name} must be within [0, 1], not {p}")
        points[point] = p
    return points


def parse_stalls(spec: str) -> dict[FaultPoint, float]:
    """``name:seconds[,...]`` to how long to sleep at each point."""
    stalls: dict[FaultPoint, float] = {}
    for item in filter(None, (part.strip() for part in spec.split(","))):
        name, _, seconds = item.partition(":")
        point = _point(STALL_ENV, name)
        s = float(seconds) if seconds else -1.0
        if s < 0:
            raise ValueError(f"{STALL_ENV}: {name} needs the seconds to stall, as {name}:3")
        stalls[point] = s
    return stalls


def fault_point(point: FaultPoint) -> None:
    """Sleep when ``ROLLOUTD_STALL`` selects ``point``, then kill this process with SIGKILL when
    ``ROLLOUTD_FAULT`` selects it."""
    stall = os.environ.get(STALL_ENV)
    if stall:
        time.sleep(parse_stalls(stall).get(point, 0.0))
    spec = os.environ.get(ENV)
    if not spec:
        return
    probability = parse(spec).get(point, 0.0)
    if probability and random.random() < probability:
        os.kill(os.getpid(), signal.SIGKILL)
