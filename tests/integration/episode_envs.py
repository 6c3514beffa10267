"""Environments the episode process tests run in the service: each tool result is a
deterministic function of the completion, and every call is appended to a file the test reads
(one JSON line each)."""

from __future__ import annotations

import hashlib
import json
import os
from typing import Any

from rolloutd.episodes import EpisodeStart, StepResult


def _answer(completion: str) -> str:
    return f"{len(completion)} {hashlib.sha256(completion.encode()).hexdigest()[:8]}"


class _Logged:
    def __init__(self, log: str, turns: int = 3) -> None:
        self.log, self.turns = log, turns

    def _note(self, **call: Any) -> None:
        line = json.dumps({"env": type(self).__name__, **call}) + "\n"
        fd = os.open(self.log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, line.encode())
        finally:
            os.close(fd)

    def reset(self, start: EpisodeStart) -> list[dict[str, str]]:
        self._note(call="reset", episode=start.episode_id, tools=list(start.tools))
        return [{"role": "system", "content": "Use the tool; it answers with a checksum."}]

    def step(self, episode_id: str, turn: int, completion: str, *, replay: bool = False):  # type: ignore[no-untyped-def]
        self._note(call="step", episode=episode_id, turn=turn, completion=completion, replay=replay)
        done = turn + 1 >= self.turns
        return StepResult(
            ({"role": "tool", "content": _answer(completion)},),
            done,
            float(len(completion) % 7) if done else None,
        )


class ReplayedEnv(_Logged):
    """No state of its own: a restore replays its durable steps."""


class ServedEnv(ReplayedEnv):
    """As :class:`ReplayedEnv`, served over HTTP (``python -m rolloutd.episodes.server``) in a
    process of its own, which outlives the service's SIGKILLs."""


class StatefulEnv(_Logged):
    """Keeps the answers so far per episode and saves them with ``state()``."""

    def __init__(self, log: str, turns: int = 3) -> None:
        super().__init__(log, turns)
        self.answers: dict[str, list[str]] = {}

    def reset(self, start: EpisodeStart) -> list[dict[str, str]]:
        self.answers[start.episode_id] = []
        return super().reset(start)

    def step(self, episode_id: str, turn: int, completion: str, *, replay: bool = False):  # type: ignore[no-untyped-def]
        result = super().step(episode_id, turn, completion, replay=replay)
        self.answers[episode_id].append(_answer(completion))
        return result

    def state(self, episode_id: str) -> bytes:
        return json.dumps(self.answers[episode_id]).encode()

    def restore(self, start: EpisodeStart, state: bytes) -> None:
        self._note(call="restore", episode=start.episode_id)
        self.answers[start.episode_id] = json.loads(state)
