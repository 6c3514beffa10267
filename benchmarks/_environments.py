"""Environments ``episodes.py`` names by entry point (``_environments:<name>``, with
``benchmarks/`` on the service's Python path). Not a benchmark: ``run_all.py`` skips names that
start with ``_``."""

from __future__ import annotations

import hashlib
import json
import os
import threading

from rolloutd.episodes import EpisodeStart, Message, StepResult


class Deterministic:
    """``turns`` model turns per episode; each tool answer is a function of the completion alone
    (its hash and length), so an interrupted episode and an uninterrupted one see the same
    answers for the same turns. Reward: the last completion's length modulo 7, over 6.

    Every ``step`` appends one JSON line ``{"pid", "episode_id", "turn", "completion", "replay"}``
    to ``log`` in one ``write`` (O_APPEND), before it answers: the line survives a SIGKILL of the
    service right after. Without ``state()``, a restore replays the turns (``replay: true``)."""

    def __init__(self, log: str, turns: int = 3) -> None:
        self.turns = turns
        self._fd = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        self._lock = threading.Lock()

    def reset(self, start: EpisodeStart) -> list[Message]:
        return []

    def step(
        self, episode_id: str, turn: int, completion: str, *, replay: bool = False
    ) -> StepResult:
        call = {"pid": os.getpid(), "episode_id": episode_id, "turn": turn}
        line = json.dumps({**call, "completion": completion, "replay": replay}) + "\n"
        with self._lock:
            os.write(self._fd, line.encode())
        digest = hashlib.sha256(completion.encode()).hexdigest()[:8]
        answer = {"role": "tool", "content": f"{digest} {len(completion)}"}
        done = turn + 1 >= self.turns
        return StepResult((answer,), done=done, reward=(len(completion) % 7) / 6 if done else None)

    def close(self) -> None:
        os.close(self._fd)


class WithState(Deterministic):
    """:class:`Deterministic` whose state comes back through ``state()``/``restore()`` (it has
    none to keep: the bytes are the episode id)."""

    def state(self, episode_id: str) -> bytes:
        return episode_id.encode()

    def restore(self, start: EpisodeStart, state: bytes) -> None:
        assert state == start.episode_id.encode(), (state, start.episode_id)
