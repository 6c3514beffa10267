"""Controller state <-> the sidecar's JSON. Pure functions; run outside the exclusive hold."""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

from rolloutd.domain.buffer import AckRecord, GroupMeta, Lease
from rolloutd.domain.controller import ControllerCapture, Counters
from rolloutd.domain.group import GroupState, Position
from rolloutd.domain.sampler import Admission, prompt_from_state, prompt_state

SIDECAR_FORMAT = 1


def meta_to_json(m: GroupMeta) -> dict[str, Any]:
    return {
        "group_id": m.group_id,
        "prompt": prompt_state(m.prompt),
        "position": None if m.position is None else [m.position.epoch, m.position.offset],
        "group_size": m.group_size,
        "policy_version": m.policy_version,
        "admitted_at": m.admitted_at,
        "seed": m.seed,
        "state": m.state.value,
        "committed_at": m.committed_at,
        "lease_id": m.lease_id,
        "ack_step": m.ack_step,
    }


def meta_from_json(d: dict[str, Any]) -> GroupMeta:
    pos = d["position"]
    return GroupMeta(
        group_id=int(d["group_id"]),
        prompt=prompt_from_state(d["prompt"]),
        position=None if pos is None else Position(int(pos[0]), int(pos[1])),
        group_size=int(d["group_size"]),
        policy_version=int(d["policy_version"]),
        admitted_at=float(d["admitted_at"]),
        seed=int(d["seed"]),
        state=GroupState(d["state"]),
        committed_at=d["committed_at"],
        lease_id=d["lease_id"],
        ack_step=d["ack_step"],
    )


def lease_to_json(lease: Lease) -> dict[str, Any]:
    return {
        "lease_id": lease.lease_id,
        "group_ids": list(lease.group_ids),
        "consumer": lease.consumer,
        "created_at": lease.created_at,
        "expires_at": lease.expires_at,
    }


def lease_from_json(d: dict[str, Any]) -> Lease:
    return Lease(
        d["lease_id"], tuple(d["group_ids"]), d["consumer"], d["created_at"], d["expires_at"]
    )


def ack_to_json(r: AckRecord) -> dict[str, Any]:
    return {
        "lease_id": r.lease_id,
        "group_ids": list(r.group_ids),
        "trainer_step": r.trainer_step,
        "acked_at": r.acked_at,
    }


def ack_from_json(d: dict[str, Any]) -> AckRecord:
    return AckRecord(
        d["lease_id"], tuple(d["group_ids"]), int(d["trainer_step"]), float(d["acked_at"])
    )


def admission_to_json(a: Admission) -> dict[str, Any]:
    pos = a.position
    return {
        "prompt": prompt_state(a.prompt),
        "position": None if pos is None else [pos.epoch, pos.offset],
    }


def admission_from_json(d: dict[str, Any]) -> Admission:
    pos = d["position"]
    return Admission(prompt_from_state(d["prompt"]), None if pos is None else Position(*pos))


def encode_group(m: GroupMeta) -> bytes:
    """One group's metadata as it stands in the sidecar's ``groups`` array."""
    return json.dumps(meta_to_json(m), separators=(",", ":"), allow_nan=False).encode()


def sidecar_json(capture: ControllerCapture, groups: Iterable[bytes]) -> bytes:
    """The sidecar as JSON. ``groups`` is every live group as :func:`encode_group` bytes: the
    checkpointer encodes a group once when it changes and only concatenates the others, so a
    checkpoint's encoding work follows its delta rather than the size of the buffer."""
    head = json.dumps(sidecar(capture), separators=(",", ":"), allow_nan=False).encode()
    return head[:-1] + b',"groups":[' + b",".join(groups) + b"]}"


def sidecar(capture: ControllerCapture) -> dict[str, Any]:
    """Controller state of a snapshot, but for the groups (see :func:`sidecar_json`)."""
    return {
        "format": SIDECAR_FORMAT,
        "sampler": capture.sampler.state(),
        "controller": {
            "next_group_id": capture.next_group_id,
            "policy_version": capture.policy_version,
            "weights_path": capture.weights_path,
            "max_acked_step": capture.max_acked_step,
            "finalized_through": capture.finalized_through,
            "counters": vars(capture.counters),
            "next_row_id": capture.buffer.next_row_id,
        },
        "leases": [lease_to_json(lease) for lease in capture.buffer.leases.values()],
        "acks": [ack_to_json(r) for r in capture.buffer.acks.values()],
        "finalized_leases": capture.buffer.finalized_leases,
        "lost_acks": [
            {"trainer_step": step, "admissions": [admission_to_json(a) for a in adm]}
            for step, adm in capture.lost_acks
        ],
    }


def counters_from_json(d: dict[str, Any]) -> Counters:
    return Counters(**d)
