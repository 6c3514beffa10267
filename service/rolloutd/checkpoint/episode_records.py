"""Episode records as JSON (``domain/episode_log.py``): the journal's ``episode_reset``,
``episode_turn`` and ``episode_step`` records, and the ``episode`` column of a snapshot's
partials file. Token ids and logprobs are base64 of their little-endian int32/float32 buffers,
state base64 of its bytes, so a record costs about the bytes it holds."""

from __future__ import annotations

import base64
import sys
from array import array
from collections.abc import Mapping
from typing import Any

from rolloutd.domain.episode_log import EnvironmentReply, EpisodeRecord, ModelTurn, RecordKind
from rolloutd.domain.group import SamplePart

PREFIX = "episode_"
KINDS = tuple(PREFIX + k.value for k in RecordKind)
"""The journal's record kinds of episode records."""


def _b64(values: array[Any]) -> str:
    if sys.byteorder != "little":
        values = array(values.typecode, values)
        values.byteswap()
    return base64.b64encode(values.tobytes()).decode()


def _array(typecode: str, text: str) -> array[Any]:
    values = array(typecode)
    values.frombytes(base64.b64decode(text))
    if sys.byteorder != "little":
        values.byteswap()
    return values


def to_json(record: EpisodeRecord) -> dict[str, Any]:
    body: dict[str, Any] = {"kind": PREFIX + record.kind.value, "turn": record.turn}
    if isinstance(record, ModelTurn):
        return body | {
            "token_ids": _b64(record.token_ids),
            "logprobs": _b64(record.logprobs),
            "parts": [[p.start, p.policy_version] for p in record.parts],
            "finish_reason": record.finish_reason,
            "text": record.text,
        }
    return body | {
        "messages": [dict(m) for m in record.messages],
        "token_ids": _b64(record.token_ids),
        "done": record.done,
        "reward": record.reward,
        "state": None if record.state is None else base64.b64encode(record.state).decode(),
    }


def from_json(d: Mapping[str, Any]) -> EpisodeRecord:
    kind = RecordKind(str(d["kind"]).removeprefix(PREFIX))
    turn = int(d["turn"])
    if kind is RecordKind.TURN:
        return ModelTurn(
            turn,
            _array("i", d["token_ids"]),
            _array("f", d["logprobs"]),
            tuple(SamplePart(int(a), int(b)) for a, b in d["parts"]),
            str(d["finish_reason"]),
            str(d["text"]),
        )
    state = d.get("state")
    reward = d.get("reward")
    return EnvironmentReply(
        turn,
        tuple(dict(m) for m in d["messages"]),
        _array("i", d["token_ids"]),
        bool(d["done"]),
        None if reward is None else float(reward),
        None if state is None else base64.b64decode(state),
    )
