"""The sidecar: :class:`ControllerState` <-> JSON. One encoder, one decoder; pure functions that run
outside the exclusive hold.

Values are encoded field by field from their dataclass declarations (:func:`to_json`,
:func:`from_json`), so a field added to ``GroupMeta``, ``Lease``, ``AckRecord``, ``Counters`` ...
is persisted without being listed again here. Positions are ``[epoch, offset]`` (``[epoch,
offset, source]`` beyond the first source), prompts ``{id, text, metadata, messages}`` (and
``generation`` where the prompt has its own settings), enums their value.

The layout (format 1)::

    {"format": 1, "sampler": {cursor, submitted_len, submitted_head, readmit, skip, skip_ids,
                              cursors, draws},
     "controller": {next_group_id, policy_version, weights_path,
     max_acked_step, finalized_through, counters, next_row_id, gate, concurrency},
     "leases": [...], "acks": [...],
     "lost_acks": [...], "lost_leases": [...]}

Group metadata is not in the sidecar: each group goes into the group segment of the snapshot
that changed it (groups.py), so a sidecar's size does not follow the number of buffered groups.
Sidecars of manifest format 1 still hold a ``"groups"`` array, and group segments of format 2 a
JSON document per group (:func:`encode_group`); both are read.
Nor is the finalized-lease ledger: it is in ledger pieces (ledger.py). Sidecars written before
them hold it as ``"finalized_leases": {lease: step}``; it is read.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import operator
import types
import typing
from collections.abc import Callable, Iterable, Mapping, Sequence
from functools import cache
from typing import Any

from rolloutd.domain.accounting import Counters
from rolloutd.domain.buffer import BufferState
from rolloutd.domain.concurrency import ConcurrencyState
from rolloutd.domain.group import GroupMeta, GroupTable, Position, Prompt
from rolloutd.domain.journal import AckRecord, Lease
from rolloutd.domain.ledger import LedgerState, LostAck, LostLease
from rolloutd.domain.policy import PolicyState
from rolloutd.domain.sampler import Admission, SamplerState
from rolloutd.domain.snapshot import ControllerState
from rolloutd.domain.spec import GenerationSpec
from rolloutd.domain.staleness import GateState

SIDECAR_FORMAT = 1


# --- values ------------------------------------------------------------------------------------


def to_json(value: Any) -> Any:
    """A domain value as JSON-able data, derived from its declaration."""
    if isinstance(value, tuple | list):
        return [to_json(v) for v in value]
    kind: Any = type(value)
    return _encoder(kind)(value)


def from_json(kind: Any, data: Any) -> Any:
    """The value of type ``kind`` that :func:`to_json` encoded as ``data``."""
    return _decoder(kind)(data)


def _same(value: Any) -> Any:
    return value


def _prompt_to_json(p: Prompt) -> dict[str, Any]:
    out = {"id": p.prompt_id, "text": p.text, "metadata": p.metadata, "messages": list(p.messages)}
    if p.generation:
        out["generation"] = p.generation.to_json()
    if p.tools:
        out["tools"] = [dict(t) for t in p.tools]
    return out


def _prompt_from_json(d: Mapping[str, Any]) -> Prompt:
    return Prompt(
        prompt_id=str(d["id"]),
        text=str(d["text"]),
        metadata=d["metadata"],  # any JSON value, delivered exactly as it came
        messages=tuple(d["messages"]),
        generation=GenerationSpec.from_json(d.get("generation")),
        tools=tuple(d.get("tools", ())),
    )


@cache
def _encoder(kind: Any) -> Callable[[Any], Any]:
    """value -> JSON for values of type ``kind``, planned once per type from its declaration."""
    origin = typing.get_origin(kind)
    if origin in (types.UnionType, typing.Union):
        (inner,) = [a for a in typing.get_args(kind) if a is not type(None)]
        encode = _encoder(inner)
        return _same if encode is _same else lambda v: None if v is None else encode(v)
    if origin is tuple or origin is list:
        item = _encoder(typing.get_args(kind)[0])
        return list if item is _same else lambda v: [item(x) for x in v]
    if origin in (dict, Mapping) or kind is Any or kind in (int, float, str, bool, type(None)):
        return _same
    if kind is Position:
        return lambda p: [p.epoch, p.offset] if p.source == 0 else [p.epoch, p.offset, p.source]
    if kind is Prompt:
        return _prompt_to_json
    if isinstance(kind, type) and issubclass(kind, enum.Enum):
        return lambda e: e.value
    if isinstance(kind, type) and dataclasses.is_dataclass(kind):
        hints = typing.get_type_hints(kind)
        plan = [(f.name, _encoder(hints[f.name])) for f in dataclasses.fields(kind)]
        direct = [name for name, enc in plan if enc is _same]
        converted = [(name, enc) for name, enc in plan if enc is not _same]
        get = operator.attrgetter(*direct) if len(direct) > 1 else None

        def encode(v: Any) -> dict[str, Any]:
            out = dict(zip(direct, get(v), strict=True)) if get else {}
            if len(direct) == 1:
                out[direct[0]] = getattr(v, direct[0])
            for name, enc in converted:
                out[name] = enc(getattr(v, name))
            return out

        return encode
    raise TypeError(f"no sidecar encoding for {kind!r}")


@cache
def _decoder(kind: Any) -> Callable[[Any], Any]:
    """JSON -> value of type ``kind``, planned once per type from its declaration."""
    origin = typing.get_origin(kind)
    if origin in (types.UnionType, typing.Union):
        (inner,) = [a for a in typing.get_args(kind) if a is not type(None)]
        decode = _decoder(inner)
        return lambda d: None if d is None else decode(d)
    if origin is tuple:
        item = _decoder(typing.get_args(kind)[0])
        return lambda d: tuple(item(x) for x in d)
    if origin in (dict, Mapping):
        value = _decoder(typing.get_args(kind)[1])
        return lambda d: {k: value(v) for k, v in d.items()}
    if kind is Any:
        return _same
    if kind in (int, float, str, bool):
        return kind  # type: ignore[no-any-return]
    if kind is Position:
        return lambda d: Position(int(d[0]), int(d[1]), int(d[2]) if len(d) > 2 else 0)
    if kind is Prompt:
        return _prompt_from_json
    if isinstance(kind, type) and issubclass(kind, enum.Enum):
        return kind
    if isinstance(kind, type) and dataclasses.is_dataclass(kind):
        hints = typing.get_type_hints(kind)
        plan = [(f.name, _decoder(hints[f.name])) for f in dataclasses.fields(kind)]
        direct = hasattr(kind, "__dict__") and not hasattr(kind, "__post_init__")

        def decode(d: Any) -> Any:
            values = {name: dec(d[name]) for name, dec in plan if name in d}
            if not direct or len(values) < len(plan):
                # A field a snapshot from an earlier version lacks takes its declared default.
                return kind(**values)
            # Every field given and nothing to run after __init__: fill the instance directly,
            # which for a frozen dataclass costs a third of __init__ (a restore decodes every
            # buffered group).
            value = object.__new__(kind)
            value.__dict__.update(values)
            return value

        return decode
    raise TypeError(f"no sidecar decoding for {kind!r}")


# --- the sampler -------------------------------------------------------------------------------


def sampler_to_json(s: SamplerState) -> dict[str, Any]:
    """The sampler's small state: the submitted prompts themselves are in the snapshot's
    submissions pieces (submissions.py); the sidecar holds their count."""
    return {
        "cursor": to_json(s.cursor),
        "submitted_len": s.submitted_len,
        "submitted_head": s.submitted_head,
        "readmit": to_json(s.readmit),
        "skip": to_json(s.skip),
        "skip_ids": list(s.skip_ids),
        "cursors": to_json(s.cursors),
        "draws": s.draws,
    }


def sampler_from_json(d: Mapping[str, Any]) -> SamplerState:
    """The sampler's state without its submitted prompts (``submitted`` is empty, but for
    sidecars of earlier versions, which held them): restore attaches them from the snapshot's
    submissions pieces (:func:`submissions.attach`)."""
    submitted = [_prompt_from_json(p) for p in d.get("submitted", [])]
    return SamplerState(
        cursor=from_json(Position, d["cursor"]),
        submitted=submitted,
        submitted_head=int(d["submitted_head"]),
        submitted_len=int(d.get("submitted_len", len(submitted))),
        readmit=from_json(tuple[Admission, ...], d["readmit"]),
        skip=from_json(tuple[Position, ...], d["skip"]),
        skip_ids=tuple(d["skip_ids"]),
        cursors=from_json(tuple[Position, ...], d.get("cursors", [])),
        draws=int(d.get("draws", 0)),
    )


# --- the whole state ---------------------------------------------------------------------------


def encode_group(meta: GroupMeta) -> bytes:
    """One group's metadata as JSON, as format-1 sidecars and format-2 group segments held it."""
    return json.dumps(_encoder(GroupMeta)(meta), separators=(",", ":"), allow_nan=False).encode()


def decode_groups(groups: Iterable[str | bytes]) -> list[GroupMeta]:
    """Groups from their :func:`encode_group` JSON, with one parse for all of them."""
    decode_meta = _decoder(GroupMeta)
    joined = ",".join(g if isinstance(g, str) else g.decode() for g in groups)
    return [decode_meta(v) for v in json.loads(f"[{joined}]")]


def head(state: ControllerState) -> dict[str, Any]:
    """The sidecar but for its groups (see :func:`encode`)."""
    ledger, policy = state.ledger, state.policy
    return {
        "format": SIDECAR_FORMAT,
        "sampler": sampler_to_json(state.sampler),
        "controller": {
            "next_group_id": state.next_group_id,
            "policy_version": policy.policy_version,
            "weights_path": policy.weights_path,
            "max_acked_step": ledger.max_acked_step,
            "finalized_through": ledger.finalized_through,
            "counters": to_json(state.counters),
            "next_row_id": state.buffer.next_row_id,
            "gate": to_json(policy.gate),
            "concurrency": to_json(state.concurrency),
        },
        "leases": to_json(list(ledger.leases.values())),
        "acks": to_json(list(ledger.acks.values())),
        "lost_acks": to_json(ledger.lost_acks),
        "lost_leases": to_json(ledger.lost_leases),
    }


def encode(state: ControllerState) -> bytes:
    """The sidecar of ``state``: everything but rows, groups, submitted prompts and the
    finalized-lease ledger (their pieces hold them)."""
    return json.dumps(head(state), separators=(",", ":"), allow_nan=False).encode()


def decode(d: Mapping[str, Any], groups: GroupTable | Sequence[GroupMeta] = ()) -> ControllerState:
    """The whole state a sidecar and its snapshot's group segments hold, but for the rows
    (they are in the segments). ``groups`` is every live group of the group segments."""
    if d.get("format") != SIDECAR_FORMAT:
        raise ValueError(f"sidecar format {d.get('format')!r}, expected {SIDECAR_FORMAT}")
    c = d["controller"]
    leases = [from_json(Lease, v) for v in d["leases"]]
    acks = [from_json(AckRecord, v) for v in d["acks"]]
    if "groups" in d:  # a sidecar of format 1 (no group segments) held them
        decode_meta = _decoder(GroupMeta)
        segments = groups.values() if isinstance(groups, GroupTable) else groups
        groups = [*segments, *map(decode_meta, d["groups"])]
    table = groups if isinstance(groups, GroupTable) else GroupTable.of(groups)
    return ControllerState(
        buffer=BufferState(
            new_rows=(),
            removed_rows=[],
            groups=table,
            next_row_id=int(c["next_row_id"]),
        ),
        ledger=LedgerState(
            leases={lease.lease_id: lease for lease in leases},
            acks={r.lease_id: r for r in acks},
            # only sidecars of earlier versions hold the finalized leases (now in ledger pieces)
            finalized_leases=dict(d.get("finalized_leases", {})),
            max_acked_step=int(c["max_acked_step"]),
            finalized_through=int(c["finalized_through"]),
            lost_acks=from_json(tuple[LostAck, ...], d["lost_acks"]),
            # absent from the sidecars of earlier versions
            lost_leases=from_json(tuple[LostLease, ...], d.get("lost_leases", [])),
        ),
        sampler=sampler_from_json(d["sampler"]),
        counters=from_json(Counters, c["counters"]),
        next_group_id=int(c["next_group_id"]),
        policy=PolicyState(
            policy_version=int(c["policy_version"]),
            weights_path=c["weights_path"],
            gate=from_json(GateState, c.get("gate", {})),
        ),
        concurrency=from_json(ConcurrencyState, c.get("concurrency", {})),
    )
