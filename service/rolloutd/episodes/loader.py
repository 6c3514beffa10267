"""Environments named in the configuration, adapted to the runner's :class:`EnvironmentPort`.

A minimal in-process adapter with the loader's signature; the full loader (HTTP environments,
a bounded thread pool, result validation naming what is wrong) replaces it."""

from __future__ import annotations

import asyncio
import inspect
import math
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from rolloutd.domain.episode import (
    EnvironmentFailure,
    EnvironmentPort,
    EpisodeEnd,
    EpisodeStart,
    Message,
    StepResult,
)
from rolloutd.entrypoints import load


def load_environment(
    spec: str,
    config: Mapping[str, Any],
    *,
    step_timeout_s: float,
    retries: int,
    key: str = "episodes.environment",
) -> EnvironmentPort:
    """``package.module:Class`` built with ``**config``, adapted (sync methods on a worker
    thread, each call bounded by ``step_timeout_s``, failures as :class:`EnvironmentFailure`)."""
    if spec.startswith(("http://", "https://")):
        raise ValueError(f"{key}: environments over HTTP are not available in this build")
    try:
        cls = load(spec)
        instance = cls(**config)
    except Exception as exc:
        raise ValueError(f"{key}: {spec}: {exc}") from exc
    return _Local(instance, step_timeout_s)


class _Local:
    def __init__(self, env: Any, timeout_s: float) -> None:
        self.env = env
        self.timeout_s = timeout_s
        self.has_state = hasattr(env, "state") and hasattr(env, "restore")

    async def _call(self, method: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        try:
            if inspect.iscoroutinefunction(method):
                call: Awaitable[Any] = method(*args, **kwargs)
            else:
                call = asyncio.to_thread(method, *args, **kwargs)
            return await asyncio.wait_for(call, self.timeout_s)
        except TimeoutError:
            raise EnvironmentFailure(
                EpisodeEnd.STEP_TIMEOUT, f"{method.__name__} ran past {self.timeout_s} s"
            ) from None
        except EnvironmentFailure:
            raise
        except Exception as exc:
            raise EnvironmentFailure(
                EpisodeEnd.STEP_FAILED, f"{method.__name__} raised {type(exc).__name__}: {exc}"
            ) from exc

    async def reset(self, start: EpisodeStart) -> tuple[Message, ...]:
        return _messages(await self._call(self.env.reset, start))

    async def step(
        self, episode_id: str, turn: int, completion: str, *, replay: bool = False
    ) -> StepResult:
        got = await self._call(self.env.step, episode_id, turn, completion, replay=replay)
        if isinstance(got, Mapping):
            got = StepResult(
                tuple(got.get("messages", ())), bool(got.get("done", False)), got.get("reward")
            )
        if not isinstance(got, StepResult) or not isinstance(got.done, bool):
            raise EnvironmentFailure(EpisodeEnd.MALFORMED, f"step returned {got!r}")
        reward = got.reward
        if reward is not None and (
            not isinstance(reward, int | float) or not math.isfinite(reward)
        ):
            raise EnvironmentFailure(EpisodeEnd.MALFORMED, f"reward {reward!r} is no finite number")
        return StepResult(_messages(got.messages), got.done, reward)

    async def state(self, episode_id: str) -> bytes:
        return bytes(await self._call(self.env.state, episode_id))

    async def restore(self, start: EpisodeStart, state: bytes) -> None:
        await self._call(self.env.restore, start, state)

    async def close(self) -> None:
        return None


def _messages(got: Any) -> tuple[Message, ...]:
    if not isinstance(got, list | tuple) or not all(
        isinstance(m, Mapping)
        and isinstance(m.get("role"), str)
        and isinstance(m.get("content"), str)
        for m in got
    ):
        raise EnvironmentFailure(
            EpisodeEnd.MALFORMED, "messages must be a list of {role: str, content: str}"
        )
    return tuple(dict(m) for m in got)
