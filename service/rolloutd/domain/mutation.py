"""Kinds of change to the buffer or the ledger; dashboards group blocked mutations by kind."""

from __future__ import annotations

import enum


class MutationKind(enum.Enum):
    ADMIT = "admit"
    STAGE_SAMPLE = "stage_sample"
    COMMIT_GROUP = "commit_group"
    LEASE = "lease"
    ACK = "ack"
    REQUEUE = "requeue"
    FINALIZE = "finalize"
    EVICT = "evict"
    RESTORE = "restore"
