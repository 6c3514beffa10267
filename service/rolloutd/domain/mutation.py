"""Kinds of change to the buffer or the ledger; dashboards group blocked mutations by kind."""

from __future__ import annotations

import enum


class MutationKind(enum.Enum):
    ADMIT = "admit"
    """A group admitted, or prompts submitted."""
    STAGE_SAMPLE = "stage_sample"
    """A finished sibling staged."""
    COMMIT_GROUP = "commit_group"
    """A finished group committed by its finishing stage."""
    LEASE = "lease"
    ACK = "ack"
    REQUEUE = "requeue"
    """An expired lease's groups (or those of a lease whose grant could not be journaled)
    available again."""
    FINALIZE = "finalize"
    EVICT = "evict"
    """Groups too stale evicted (at a weight update)."""
    RESTORE = "restore"
    DROP = "drop"
    """A group dropped before delivery (an engine error, a refused request, a verdict)."""
    REWIND = "rewind"
    """Acks after a trainer step undone (``Rewind``)."""
