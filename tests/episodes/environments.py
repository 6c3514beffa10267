"""Environments the episode tests name by entry point (``tests.episodes.environments:<name>``).
Each records the calls it got, so that a test can tell which ran, where, and how often."""

from __future__ import annotations

import asyncio
import threading
from collections import Counter
from collections.abc import Sequence
from typing import Any

from rolloutd.episodes import (
    EnvironmentFailure,
    EpisodeEnd,
    EpisodeStart,
    Message,
    StepResult,
)


class Echo:
    """Sync: answers each turn with the completion upper-cased, done after ``turns`` turns with
    reward ``turns``. ``fail_first`` step calls of each ``(episode, turn)`` raise."""

    def __init__(self, turns: int = 3, greeting: str = "", fail_first: int = 0) -> None:
        self.turns = turns
        self.greeting = greeting
        self.fail_first = fail_first
        self.steps: list[tuple[str, int, str, bool]] = []
        self.attempts: Counter[tuple[str, int]] = Counter()
        self.threads: set[int] = set()
        self.started: list[EpisodeStart] = []
        self.closed = False

    def reset(self, start: EpisodeStart) -> list[Message]:
        self.threads.add(threading.get_ident())
        self.started.append(start)
        return [{"role": "system", "content": self.greeting}] if self.greeting else []

    def step(
        self, episode_id: str, turn: int, completion: str, *, replay: bool = False
    ) -> StepResult:
        self.threads.add(threading.get_ident())
        self.steps.append((episode_id, turn, completion, replay))
        self.attempts[episode_id, turn] += 1
        if self.attempts[episode_id, turn] <= self.fail_first:
            raise ConnectionError(f"sandbox busy ({self.attempts[episode_id, turn]})")
        done = turn + 1 >= self.turns
        return StepResult(
            messages=({"role": "tool", "content": completion.upper(), "name": "echo"},),
            done=done,
            reward=float(self.turns) if done else None,
        )

    def close(self) -> None:
        self.closed = True


class Counting:
    """Async, with ``state()``/``restore()``: counts the characters each episode's completions
    had; answers with mappings, not StepResults; its step takes no ``replay``."""

    def __init__(self) -> None:
        self.totals: dict[str, int] = {}
        self.restored: list[tuple[str, bytes]] = []

    async def reset(self, start: EpisodeStart) -> tuple[Message, ...]:
        await asyncio.sleep(0)
        self.totals[start.episode_id] = 0
        return ({"role": "user", "content": f"tools: {len(start.tools)}"},)

    async def step(self, episode_id: str, turn: int, completion: str) -> dict[str, Any]:
        await asyncio.sleep(0)
        self.totals[episode_id] += len(completion)
        total = self.totals[episode_id]
        return {"messages": [{"role": "tool", "content": str(total)}], "done": total > 10}

    async def state(self, episode_id: str) -> bytes:
        return self.totals[episode_id].to_bytes(4, "big") + b"\xff\x00"

    async def restore(self, start: EpisodeStart, state: bytes) -> None:
        self.restored.append((start.episode_id, state))
        self.totals[start.episode_id] = int.from_bytes(state[:4], "big")


class Hangs:
    """Sync: ``step`` blocks until :attr:`release` is set (episode ``"quick"`` answers at once);
    ``reset`` answers at once."""

    release = threading.Event()

    def __init__(self) -> None:
        self.entered = threading.Event()
        self.calls = 0

    def reset(self, start: EpisodeStart) -> list[Message]:
        return []

    def step(
        self, episode_id: str, turn: int, completion: str, *, replay: bool = False
    ) -> StepResult:
        self.calls += 1
        if episode_id != "quick":
            self.entered.set()
            self.release.wait(60)
        return StepResult(done=True)


class AsyncHangs(Hangs):
    """:class:`Hangs` with an async ``step`` that never returns."""

    async def step(  # type: ignore[override]
        self, episode_id: str, turn: int, completion: str, *, replay: bool = False
    ) -> StepResult:
        self.calls += 1
        if episode_id != "quick":
            self.entered.set()
            await asyncio.Event().wait()
        return StepResult(done=True)


class Returns:
    """``step`` returns what it was built with (``result``), or one of a few things YAML cannot
    hold (``special``); ``state`` returns ``state``; ``step`` raises when ``raises`` names an
    exception: ``"timeout"`` (its own TimeoutError), ``"failure"`` (an EnvironmentFailure)."""

    def __init__(
        self, result: Any = None, special: str = "", state: Any = b"", raises: str = ""
    ) -> None:
        self.result = result
        self.special = special
        self._state = state
        self.raises = raises

    def reset(self, start: EpisodeStart) -> Any:
        return self.result if self.special == "reset" else []

    def step(self, episode_id: str, turn: int, completion: str, *, replay: bool = False) -> Any:
        if self.raises == "timeout":
            raise TimeoutError("the sandbox timed out")
        if self.raises == "failure":
            raise EnvironmentFailure(EpisodeEnd.MALFORMED, "the environment says so")
        if self.special == "object":
            return StepResult(messages=({"role": "tool", "content": "x", "extra": object()},))
        if self.special == "nan":
            return StepResult(done=True, reward=float("nan"))
        return self.result

    def state(self, episode_id: str) -> Any:
        return self._state

    def restore(self, start: EpisodeStart, state: bytes) -> None:
        return None


class NeedsLimit:
    """Refuses to be built without a positive ``limit``."""

    def __init__(self, limit: int) -> None:
        if limit <= 0:
            raise ValueError(f"limit must be positive, got {limit}")

    def reset(self, start: EpisodeStart) -> Sequence[Message]:
        return []

    def step(self, episode_id: str, turn: int, completion: str, *, replay: bool = False) -> Any:
        return StepResult(done=True)


class NoReplay:
    """Neither takes ``replay`` nor has state: cannot come back after a restart."""

    def reset(self, start: EpisodeStart) -> Sequence[Message]:
        return []

    def step(self, episode_id: str, turn: int, completion: str) -> Any:
        return StepResult(done=True)


class NoStep:
    def reset(self, start: EpisodeStart) -> Sequence[Message]:
        return []


def not_a_class() -> None:
    """A function where a class is expected."""
