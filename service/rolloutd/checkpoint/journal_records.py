"""The journal's records: each domain event (``DeliveryJournal``'s calls) as a JSON object with a
``kind``, and back. Records from before ``kind`` existed are acks.

Lease and ack records name each group's prompt by reference (``prompt_id`` and ``position``),
so a lease does not write a prompt's metadata again; records written before carry the whole
admission (``prompt``) and are still read."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from rolloutd.checkpoint import episode_records
from rolloutd.checkpoint.sidecar import from_json, to_json
from rolloutd.domain.group import GroupMeta, Prompt
from rolloutd.domain.journal import (
    AckRecord,
    IdReservation,
    Journaled,
    JournaledAck,
    JournaledAdmission,
    JournaledDrop,
    JournaledEpisode,
    JournaledLease,
    JournaledRewind,
    JournaledSubmission,
    Lease,
    PromptRef,
)
from rolloutd.domain.sampler import Admission


class UnknownRecord(ValueError):
    """A record of a kind this version does not know."""


ACK, LEASE, SUBMIT, REWIND, IDS, DROP = "ack", "lease", "submit", "rewind", "ids", "drop"
ADMIT = "admit"


def _refs(admissions: Mapping[int, Admission]) -> list[dict[str, Any]]:
    return [
        {"group_id": gid, **to_json(PromptRef(a.prompt.prompt_id, a.position))}
        for gid, a in admissions.items()
    ]


def _decode_groups(d: Mapping[str, Any]) -> tuple[dict[int, Admission], dict[int, PromptRef]]:
    """Whole admissions (records of earlier versions) and references (``_refs``)."""
    whole: dict[int, Admission] = {}
    refs: dict[int, PromptRef] = {}
    for g in d["groups"]:
        if "prompt" in g:
            whole[int(g["group_id"])] = from_json(Admission, g)
        else:
            refs[int(g["group_id"])] = from_json(PromptRef, g)
    return whole, refs


def ack(record: AckRecord, admissions: Mapping[int, Admission]) -> dict[str, Any]:
    """An ack, with a reference to each of its groups' prompts."""
    return {"kind": ACK, **to_json(record), "groups": _refs(admissions)}


def lease(lease: Lease, admissions: Mapping[int, Admission]) -> dict[str, Any]:
    """A lease grant, with a reference to each of its groups' prompts."""
    return {"kind": LEASE, **to_json(lease), "groups": _refs(admissions)}


def submission(prompts: Sequence[Prompt]) -> dict[str, Any]:
    return {"kind": SUBMIT, "prompts": to_json(list(prompts))}


def rewind(trainer_step: int) -> dict[str, Any]:
    return {"kind": REWIND, "trainer_step": trainer_step}


def ids(through: int) -> dict[str, Any]:
    return {"kind": IDS, "through": through}


def drop(drop: JournaledDrop) -> dict[str, Any]:
    return {"kind": DROP, **to_json(drop)}


def admission(meta: GroupMeta) -> dict[str, Any]:
    """An episode group's admission: its whole metadata (prompt, position, seed, settings)."""
    return {"kind": ADMIT, "group": to_json(meta)}


def episode(group_id: int, index: int, record: Any) -> dict[str, Any]:
    """An episode record of sibling ``index`` of group ``group_id``."""
    return {**episode_records.to_json(record), "group_id": group_id, "index": index}


def decode(d: Mapping[str, Any]) -> Journaled:
    """One journal record as a domain event; records from before ``kind`` existed are acks."""
    kind = d.get("kind", ACK)
    if kind == ACK:
        return decode_ack(d)
    if kind == LEASE:
        return JournaledLease(from_json(Lease, d), *_decode_groups(d))
    if kind == SUBMIT:
        return JournaledSubmission(tuple(from_json(tuple[Prompt, ...], d["prompts"])))
    if kind == REWIND:
        return JournaledRewind(int(d["trainer_step"]))
    if kind == IDS:
        return IdReservation(int(d["through"]))
    if kind == DROP:
        return from_json(JournaledDrop, d)
    if kind == ADMIT:
        return JournaledAdmission(from_json(GroupMeta, d["group"]))
    if kind in episode_records.KINDS:
        return JournaledEpisode(int(d["group_id"]), int(d["index"]), episode_records.from_json(d))
    raise UnknownRecord(f"a record of unknown kind {kind!r}")


def decode_ack(d: Mapping[str, Any]) -> JournaledAck:
    return JournaledAck(from_json(AckRecord, d), *_decode_groups(d))
