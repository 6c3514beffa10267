"""What an environment answers, checked: messages, step results and state, as both adapters
(in process, over HTTP) read them. Anything else is :attr:`EpisodeEnd.MALFORMED`, with a message
that names what is wrong.

A message is a mapping with a ``role`` and a ``content`` that are strings (other keys, such as
``name`` or ``tool_call_id``, are kept) and holds only JSON values, since it is journaled. A step
result is a :class:`StepResult` or a mapping with the same keys (``messages``, ``done``,
``reward``). ``done`` is a bool and ``reward`` a finite number or None.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from typing import Any

from rolloutd.domain.episode import EnvironmentFailure, EpisodeEnd, Message, StepResult

STEP_KEYS = frozenset({"messages", "done", "reward"})


def malformed(what: str) -> EnvironmentFailure:
    return EnvironmentFailure(EpisodeEnd.MALFORMED, what)


def messages_of(value: Any, where: str) -> tuple[Message, ...]:
    """``value`` as a tuple of plain-dict messages; ``where`` names the call in the error."""
    if value is None:
        return ()
    if isinstance(value, str | bytes | Mapping) or not isinstance(value, Sequence):
        raise malformed(f"{where}: messages must be a list of messages, got {_kind(value)}")
    return tuple(_message(m, f"{where}: message {i}") for i, m in enumerate(value))


def _message(value: Any, where: str) -> dict[str, Any]:
    if not isinstance(value, Mapping):
        raise malformed(f"{where} must be a mapping with 'role' and 'content', got {_kind(value)}")
    for key in ("role", "content"):
        if key not in value:
            raise malformed(f"{where} has no {key!r}")
        if not isinstance(value[key], str):
            raise malformed(f"{where}: {key!r} must be a string, got {_kind(value[key])}")
    if not value["role"]:
        raise malformed(f"{where}: 'role' is empty")
    message = dict(value)
    try:
        json.dumps(message, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise malformed(f"{where} is not JSON: {exc}") from None
    if not all(isinstance(k, str) for k in message):
        raise malformed(f"{where}: keys must be strings")
    return message


def step_result_of(value: Any, where: str) -> StepResult:
    """``value`` (a :class:`StepResult` or a mapping with its keys) checked and normalised."""
    messages: Any
    if isinstance(value, StepResult):
        messages, done, reward = value.messages, value.done, value.reward
    elif isinstance(value, Mapping):
        unknown = set(value) - STEP_KEYS
        if unknown:
            raise malformed(
                f"{where}: unknown keys {sorted(map(str, unknown))}; a step result has "
                f"{sorted(STEP_KEYS)}"
            )
        messages = value.get("messages")
        done, reward = value.get("done", False), value.get("reward")
    else:
        raise malformed(f"{where} must return a StepResult or a mapping, got {_kind(value)}")
    if not isinstance(done, bool):
        raise malformed(f"{where}: 'done' must be true or false, got {_kind(done)}")
    if reward is not None:
        if isinstance(reward, bool) or not isinstance(reward, int | float):
            raise malformed(f"{where}: 'reward' must be a number or None, got {_kind(reward)}")
        if not math.isfinite(reward):
            raise malformed(f"{where}: 'reward' must be finite, got {reward!r}")
        reward = float(reward)
    return StepResult(messages=messages_of(messages, where), done=done, reward=reward)


def state_of(value: Any, where: str) -> bytes:
    if isinstance(value, bytes | bytearray | memoryview):
        return bytes(value)
    raise malformed(f"{where} must return bytes, got {_kind(value)}")


def _kind(value: Any) -> str:
    text = repr(value)
    return f"{type(value).__name__} {text[:60]}{'...' if len(text) > 60 else ''}"
