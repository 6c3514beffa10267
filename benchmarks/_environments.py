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

    Every call appends one JSON line to ``log`` in one ``write`` (O_APPEND), before it answers,
    so that the line survives a SIGKILL of the service right after: ``reset`` writes ``{"call":
    "reset", "pid", "episode_id", "prompt_id", "sibling"}``, ``step`` ``{"call": "step", "pid",
    "episode_id", "turn", "completion", "replay"}``. Without ``state()``, a restore calls
    ``reset`` again and replays the durable steps (``replay: true``)."""

    def __init__(self, log: str, turns: int = 3) -> None:
        self.turns = turns
        self._fd = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        self._lock = threading.Lock()

    def reset(self, start: EpisodeStart) -> list[Message]:
        self._write(
            {"call": "reset", "pid": os.getpid(), "episode_id": start.episode_id,
             "prompt_id": start.prompt_id, "sibling": start.sibling}
        )  # fmt: skip
        return []

    def step(
        self, episode_id: str, turn: int, completion: str, *, replay: bool = False
    ) -> StepResult:
        self._write(
            {"call": "step", "pid": os.getpid(), "episode_id": episode_id, "turn": turn,
             "completion": completion, "replay": replay}
        )  # fmt: skip
        digest = hashlib.sha256(completion.encode()).hexdigest()[:8]
        answer = {"role": "tool", "content": f"{digest} {len(completion)}"}
        done = turn + 1 >= self.turns
        return StepResult((answer,), done=done, reward=(len(completion) % 7) / 6 if done else None)

    def _write(self, call: dict[str, object]) -> None:
        line = json.dumps(call) + "\n"
        with self._lock:
            os.write(self._fd, line.encode())

    def close(self) -> None:
        os.close(self._fd)


class WithState(Deterministic):
    """:class:`Deterministic` whose state comes back through ``state()``/``restore()`` (it has
    none to keep: the bytes are the episode id)."""

    def state(self, episode_id: str) -> bytes:
        return episode_id.encode()

    def restore(self, start: EpisodeStart, state: bytes) -> None:
        assert state == start.episode_id.encode(), (state, start.episode_id)
