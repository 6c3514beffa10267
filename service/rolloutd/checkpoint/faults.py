"""Fault injection for crash tests: SIGKILL this process at a named point of a checkpoint.

``ROLLOUTD_FAULT`` selects the points: one name (``commit.before_rename``), a comma list, and
optionally a probability per name (``buffer_save.mid:0.3``). An unknown name is an error, so a typo
cannot make a crash test pass without crashing. With the variable unset, :func:`fault_point` costs
one environment lookup.
"""

from __future__ import annotations

import enum
import os
import random
import signal

ENV = "ROLLOUTD_FAULT"


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


def parse(spec: str) -> dict[FaultPoint, float]:
    """``name[:probability][,...]`` to the probability of crashing at each point."""
    points: dict[FaultPoint, float] = {}
    for item in filter(None, (part.strip() for part in spec.split(","))):
        name, _, probability = item.partition(":")
        try:
            point = FaultPoint(name)
        except ValueError:
            known = ", ".join(p.value for p in FaultPoint)
            raise ValueError(f"{ENV}: unknown fault point {name!r}; known: {known}") from None
        p = float(probability) if probability else 1.0
        if not 0.0 <= p <= 1.0:
            raise ValueError(f"{ENV}: probability of {name} must be within [0, 1], not {p}")
        points[point] = p
    return points


def fault_point(point: FaultPoint) -> None:
    """Kill this process with SIGKILL when ``ROLLOUTD_FAULT`` selects ``point``."""
    spec = os.environ.get(ENV)
    if not spec:
        return
    probability = parse(spec).get(point, 0.0)
    if probability and random.random() < probability:
        os.kill(os.getpid(), signal.SIGKILL)
