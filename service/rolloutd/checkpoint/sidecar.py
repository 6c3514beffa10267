"""The sidecar: :class:`ControllerState` <-> JSON. One encoder, one decoder; pure functions that run
outside the exclusive hold.

Values are encoded field by field from their dataclass declarations (:func:`to_json`,
:func:`from_json`), so a field added to ``GroupMeta``, ``Lease``, ``AckRecord``, ``Counters`` ...
is persisted without being listed again here. Positions are ``[epoch, offset]``, prompts
``{id, text, metadata, messages}``, enums their value.

The layout (format 1)::

    {"format": 1, "sampler": {...}, "controller": {next_group_id, policy_version, weights_path,
     max_acked_step, finalized_through, counters, next_row_id}, "leases": [...], "acks": [...],
     "finalized_leases": {lease: step}, "lost_acks": [...], "groups": [...]}
"""

from __future__ import annotations

import dataclasses
import enum
import json
import types
import typing
from collections.abc import Iterable, Mapping
from functools import cache
from typing import Any

from rolloutd.domain.buffer import AckRecord, BufferState, Lease
from rolloutd.domain.group import GroupMeta, Position, Prompt
from rolloutd.domain.sampler import Admission, SamplerState
from rolloutd.domain.state import ControllerState, Counters, LostAck

SIDECAR_FORMAT = 1


# --- values ------------------------------------------------------------------------------------


def to_json(value: Any) -> Any:
    """A domain value as JSON-able data, derived from its declaration."""
    if value is None or isinstance(value, bool | int | float | str):
        return value
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, Position):
        return [value.epoch, value.offset]
    if isinstance(value, Prompt):
        return {
            "id": value.prompt_id,
            "text": value.text,
            "metadata": value.metadata,
            "messages": list(value.messages),
        }
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: to_json(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, tuple | list):
        return [to_json(v) for v in value]
    if isinstance(value, Mapping):
        return {k: to_json(v) for k, v in value.items()}
    raise TypeError(f"no sidecar encoding for {type(value).__name__}")


@cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def from_json(kind: Any, data: Any) -> Any:
    """The value of type ``kind`` that :func:`to_json` encoded as ``data``."""
    origin = typing.get_origin(kind)
    if origin in (types.UnionType, typing.Union):
        if data is None:
            return None
        (inner,) = [a for a in typing.get_args(kind) if a is not type(None)]
        return from_json(inner, data)
    if origin is tuple:
        (item, _) = typing.get_args(kind)
        return tuple(from_json(item, v) for v in data)
    if origin in (dict, Mapping):
        _, item = typing.get_args(kind)
        return {k: from_json(item, v) for k, v in data.items()}
    if kind is Any:
        return data
    if kind is Position:
        return Position(int(data[0]), int(data[1]))
    if kind is Prompt:
        return Prompt(
            prompt_id=str(data["id"]),
            text=str(data["text"]),
            metadata=dict(data["metadata"]),
            messages=tuple(data["messages"]),
        )
    if isinstance(kind, type) and issubclass(kind, enum.Enum):
        return kind(data)
    if kind in (int, float, str, bool):
        return kind(data)
    if isinstance(kind, type) and dataclasses.is_dataclass(kind):
        hints = _hints(kind)
        return kind(
            **{f.name: from_json(hints[f.name], data[f.name]) for f in dataclasses.fields(kind)}
        )
    raise TypeError(f"no sidecar decoding for {kind!r}")


# --- the sampler -------------------------------------------------------------------------------


def sampler_to_json(s: SamplerState) -> dict[str, Any]:
    return {
        "cursor": to_json(s.cursor),
        "submitted": to_json(s.submitted_prompts),
        "submitted_head": s.submitted_head,
        "readmit": to_json(s.readmit),
        "skip": to_json(s.skip),
        "skip_ids": list(s.skip_ids),
    }


def sampler_from_json(d: Mapping[str, Any]) -> SamplerState:
    submitted = [from_json(Prompt, p) for p in d["submitted"]]
    return SamplerState(
        cursor=from_json(Position, d["cursor"]),
        submitted=submitted,
        submitted_head=int(d["submitted_head"]),
        submitted_len=len(submitted),
        readmit=from_json(tuple[Admission, ...], d["readmit"]),
        skip=from_json(tuple[Position, ...], d["skip"]),
        skip_ids=tuple(d["skip_ids"]),
    )


# --- the whole state ---------------------------------------------------------------------------


def encode_group(meta: GroupMeta) -> bytes:
    """One group's metadata as it stands in the sidecar's ``groups`` array."""
    return json.dumps(to_json(meta), separators=(",", ":"), allow_nan=False).encode()


def head(state: ControllerState) -> dict[str, Any]:
    """The sidecar but for its groups (see :func:`encode`)."""
    b = state.buffer
    return {
        "format": SIDECAR_FORMAT,
        "sampler": sampler_to_json(state.sampler),
        "controller": {
            "next_group_id": state.next_group_id,
            "policy_version": state.policy_version,
            "weights_path": state.weights_path,
            "max_acked_step": state.max_acked_step,
            "finalized_through": state.finalized_through,
            "counters": to_json(state.counters),
            "next_row_id": b.next_row_id,
        },
        "leases": to_json(list(b.leases.values())),
        "acks": to_json(list(b.acks.values())),
        "finalized_leases": dict(b.finalized_leases),
        "lost_acks": to_json(state.lost_acks),
    }


def encode(state: ControllerState, groups: Iterable[bytes]) -> bytes:
    """The sidecar of ``state`` (whose ledger is whole). ``groups`` is every live group as
    :func:`encode_group` bytes: the checkpointer encodes a group once when it changes and only
    concatenates the others, so a checkpoint's encoding work follows its delta rather than the
    size of the buffer."""
    data = json.dumps(head(state), separators=(",", ":"), allow_nan=False).encode()
    return data[:-1] + b',"groups":[' + b",".join(groups) + b"]}"


def decode(d: Mapping[str, Any]) -> ControllerState:
    """The whole state a sidecar holds, but for its rows (they are in the segments)."""
    if d.get("format") != SIDECAR_FORMAT:
        raise ValueError(f"sidecar format {d.get('format')!r}, expected {SIDECAR_FORMAT}")
    c = d["controller"]
    leases = [from_json(Lease, v) for v in d["leases"]]
    acks = [from_json(AckRecord, v) for v in d["acks"]]
    metas = [from_json(GroupMeta, v) for v in d["groups"]]
    return ControllerState(
        buffer=BufferState(
            new_rows=(),
            removed_rows=[],
            groups={m.group_id: m for m in metas},
            leases={lease.lease_id: lease for lease in leases},
            acks={r.lease_id: r for r in acks},
            finalized_leases=dict(d["finalized_leases"]),
            next_row_id=int(c["next_row_id"]),
        ),
        sampler=sampler_from_json(d["sampler"]),
        counters=from_json(Counters, c["counters"]),
        next_group_id=int(c["next_group_id"]),
        policy_version=int(c["policy_version"]),
        weights_path=c["weights_path"],
        max_acked_step=int(c["max_acked_step"]),
        finalized_through=int(c["finalized_through"]),
        lost_acks=from_json(tuple[LostAck, ...], d["lost_acks"]),
    )
