"""Environments named in the configuration, adapted to the runner's :class:`EnvironmentPort`.

``episodes.environment`` is either ``"package.module:Class"`` — a user's class imported from the
service's Python path (an installed package or ``PYTHONPATH``), built once with
``episodes.environment_config`` as keyword arguments and run in process by
:class:`LocalEnvironment` — or ``"http://host:port[/prefix]"``, an environment served elsewhere
(:mod:`rolloutd.episodes.http`).

What a wrong setting looks like is found here, at start-up: a spec that does not import, a class
without ``reset`` or ``step``, a configuration its constructor refuses. Each raises a ValueError
that names the key. What goes wrong later, per call, is an :class:`EnvironmentFailure` that ends
that episode only.
"""

from __future__ import annotations

import asyncio
import contextvars
import inspect
import re
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import Any, cast

from rolloutd.domain.episode import (
    EnvironmentFailure,
    EnvironmentPort,
    EpisodeEnd,
    EpisodeStart,
    Message,
    StepResult,
)
from rolloutd.entrypoints import EntryPointError, load
from rolloutd.episodes.results import messages_of, state_of, step_result_of

URL = re.compile(r"^https?://", re.IGNORECASE)
WORKER_THREADS = 64
"""Threads that run one environment's sync methods: at most this many calls at once. A call
that hangs past its timeout keeps its thread (Python cannot stop one), so a hanging environment
uses up its own threads, never the service's."""


def load_environment(
    spec: str,
    config: Mapping[str, Any],
    *,
    step_timeout_s: float,
    retries: int,
    key: str = "episodes.environment",
) -> EnvironmentPort:
    """The environment ``spec`` names, adapted (see the module docstring). ``retries``: how
    often an HTTP environment's call is tried again; a class in process is never retried (what
    it raises ends the episode). ``key`` names the setting in errors (a dataset source's
    ``dataset.sources[i].environment`` overrides ``episodes.environment``)."""
    if step_timeout_s <= 0:
        raise ValueError(f"episodes.step_timeout_s must be above 0, got {step_timeout_s}")
    if URL.match(spec):
        from rolloutd.episodes.http import HttpEnvironment  # httpx: only for a served one

        if config:
            raise ValueError(
                f"{key}_config: an environment served over HTTP ({spec}) is configured where it "
                "runs; leave it empty"
            )
        return HttpEnvironment(spec, timeout_s=step_timeout_s, retries=retries, key=key)
    return LocalEnvironment(build(spec, config, key=key), timeout_s=step_timeout_s, name=spec)


def build(spec: str, config: Mapping[str, Any], *, key: str = "episodes.environment") -> Any:
    """The class ``spec`` names, checked and built with ``**config``."""
    try:
        cls = load(spec)
    except EntryPointError as exc:
        raise EntryPointError(f"{key}: {exc}") from exc
    if not isinstance(cls, type):
        raise ValueError(f"{key}: {spec} is a {type(cls).__name__}, not a class")
    missing = [m for m in ("reset", "step") if not callable(getattr(cls, m, None))]
    if missing:
        raise ValueError(
            f"{key}: {spec} has no {' or '.join(f'{m}()' for m in missing)}; an environment "
            "has reset(start) and step(episode_id, turn, completion, *, replay=False)"
        )
    if not _has_state(cls) and not _takes(cast(Any, cls).step, "e", 0, "c", replay=True):
        raise ValueError(
            f"{key}: {spec}.step takes no 'replay' keyword, and the class has no state() and "
            "restore(): after a restart its state can come back neither way"
        )
    if not isinstance(config, Mapping):
        raise ValueError(f"{key}_config: must be a mapping, got {type(config).__name__}")
    try:
        return cls(**config)
    except Exception as exc:
        raise ValueError(f"{key}_config: {spec} refused it ({type(exc).__name__}: {exc})") from exc


def _has_state(target: Any) -> bool:
    return callable(getattr(target, "state", None)) and callable(getattr(target, "restore", None))


def _takes(method: Callable[..., Any], *args: Any, **kwargs: Any) -> bool:
    """Whether ``method`` (unbound) accepts these arguments after ``self``."""
    try:
        inspect.signature(method).bind(None, *args, **kwargs)
    except TypeError:
        return False
    except ValueError:  # no signature (a builtin): assume it does
        return True
    return True


class LocalEnvironment:
    """A user's environment object behind :class:`EnvironmentPort`.

    Async methods are awaited on the event loop; sync ones run in this adapter's own worker
    threads, so a CPU-heavy or blocking environment does not stall the service. Every call is
    bounded by ``timeout_s`` (None: unbounded). A sync call that runs past it cannot be stopped:
    its thread goes on until the method returns, and its result is discarded. Exceptions
    become :attr:`EpisodeEnd.STEP_FAILED` (an :class:`EnvironmentFailure` the environment
    raises itself is kept as it is), results are checked (:mod:`rolloutd.episodes.results`).
    """

    def __init__(self, environment: Any, *, timeout_s: float | None, name: str = "") -> None:
        self.environment = environment
        self.name = name or type(environment).__name__
        self.has_state = _has_state(environment)
        self._timeout_s = timeout_s
        self._threads = ThreadPoolExecutor(WORKER_THREADS, thread_name_prefix="rolloutd-env")

    async def reset(self, start: EpisodeStart) -> tuple[Message, ...]:
        where = f"{self.name}.reset({start.episode_id})"
        return messages_of(await self._call("reset", where, start), where)

    async def step(
        self, episode_id: str, turn: int, completion: str, *, replay: bool = False
    ) -> StepResult:
        where = f"{self.name}.step({episode_id}, turn {turn})"
        # replay only when set: an environment with state() and restore() need not take it
        extra = {"replay": True} if replay else {}
        result = await self._call("step", where, episode_id, turn, completion, **extra)
        return step_result_of(result, where)

    async def state(self, episode_id: str) -> bytes:
        where = f"{self.name}.state({episode_id})"
        self._need_state(where)
        return state_of(await self._call("state", where, episode_id), where)

    async def restore(self, start: EpisodeStart, state: bytes) -> None:
        where = f"{self.name}.restore({start.episode_id})"
        self._need_state(where)
        await self._call("restore", where, start, state)

    async def close(self) -> None:
        """Calls the environment's own ``close()`` if it has one; threads still running a
        call that timed out are left to finish."""
        try:
            if callable(getattr(self.environment, "close", None)):
                await self._call("close", f"{self.name}.close()")
        finally:
            self._threads.shutdown(wait=False, cancel_futures=True)

    def _need_state(self, where: str) -> None:
        if not self.has_state:
            raise EnvironmentFailure(
                EpisodeEnd.STEP_FAILED, f"{where}: the environment has no state() and restore()"
            )

    async def _call(self, method: str, where: str, *args: Any, **kwargs: Any) -> Any:
        function = getattr(self.environment, method)
        try:
            async with asyncio.timeout(self._timeout_s) as bound:
                if inspect.iscoroutinefunction(function):
                    result = await function(*args, **kwargs)
                else:
                    loop = asyncio.get_running_loop()
                    call = partial(function, *args, **kwargs)
                    # as asyncio.to_thread does: the call sees this task's context (its span)
                    context = contextvars.copy_context()
                    result = await loop.run_in_executor(self._threads, context.run, call)
                if inspect.isawaitable(result):  # a sync method that returned a coroutine
                    result = await result
        except EnvironmentFailure:
            raise
        except TimeoutError as exc:
            if bound.expired():
                raise EnvironmentFailure(
                    EpisodeEnd.STEP_TIMEOUT, f"{where}: no answer within {self._timeout_s:g} s"
                ) from None
            raise _failed(where, exc) from exc
        except Exception as exc:
            raise _failed(where, exc) from exc
        return result


def _failed(where: str, exc: BaseException) -> EnvironmentFailure:
    return EnvironmentFailure(EpisodeEnd.STEP_FAILED, f"{where} raised {type(exc).__name__}: {exc}")
