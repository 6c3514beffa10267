"""Environments over HTTP, the client: :class:`HttpEnvironment`, the adapter the runner calls
(``episodes.environment: "http://host:port[/prefix]"``). The other end, which serves any
:class:`Environment`, is :mod:`rolloutd.episodes.server`; this module never imports it.

The wire format, JSON both ways, every path under the base URL::

    GET  /info     -> {"has_state": true, "environment": "package.module:Class"}
    POST /reset    {"episode_id": "g7-s0", "group_id": 7, "sibling": 0, "prompt_id": "p3",
                    "messages": [...], "metadata": ..., "tools": [...]}
                   -> {"messages": [...]}
    POST /step     {"episode_id": "g7-s0", "turn": 0, "completion": "...", "replay": false}
                   -> {"messages": [...], "done": false, "reward": null}
    POST /state    {"episode_id": "g7-s0"} -> {"state": "<base64>"}
    POST /restore  {"start": {... as /reset}, "state": "<base64>"} -> {}

A failing environment answers 500 with ``{"error": "<EpisodeEnd value>", "detail": "..."}``
(``step_failed``, ``malformed``); a request it cannot read, 422.

The adapter asks ``/info`` once, when it is built (at start-up): an environment that cannot be
reached then is a configuration error naming the key. Each call may take ``timeout_s``. A call
that cannot connect, loses its connection or gets a 5xx is tried again ``retries`` times, after
``backoff_s``, then twice that, and so on; a 4xx is never retried, nor is a ``/step`` that timed
out (:attr:`EpisodeEnd.STEP_TIMEOUT` at once). A ``/step`` tried again carries the same
``(episode_id, turn)`` and completion, as after a crash (rolloutd.domain.episode): a server with
side effects deduplicates on that key.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import logging
import time
from collections.abc import Mapping
from typing import Any

import httpx

from rolloutd.domain.episode import (
    EnvironmentFailure,
    EpisodeEnd,
    EpisodeStart,
    Message,
    StepResult,
)
from rolloutd.episodes.results import malformed, messages_of, step_result_of

log = logging.getLogger(__name__)

BACKOFF_S = 0.2
PROBE_TIMEOUT_S = 10.0
"""``/info`` at start-up waits at most this long per attempt (or ``timeout_s``, if shorter)."""


def start_body(start: EpisodeStart) -> dict[str, Any]:
    """``start`` as ``/reset`` (and ``/restore``'s ``start``) carry it."""
    return {
        "episode_id": start.episode_id,
        "group_id": start.group_id,
        "sibling": start.sibling,
        "prompt_id": start.prompt_id,
        "messages": [dict(m) for m in start.messages],
        "metadata": start.metadata,
        "tools": [dict(t) for t in start.tools],
    }


class HttpEnvironment:
    """An environment served at ``url``, behind :class:`EnvironmentPort` (see the module
    docstring)."""

    def __init__(
        self,
        url: str,
        *,
        timeout_s: float,
        retries: int,
        backoff_s: float = BACKOFF_S,
        key: str = "episodes.environment",
    ) -> None:
        self.url = url.rstrip("/")
        self.name = self.url
        self._timeout_s = timeout_s
        self._retries = retries
        self._backoff_s = backoff_s
        self.has_state = self._probe(key)
        self._client = httpx.AsyncClient(timeout=timeout_s)

    def _probe(self, key: str) -> bool:
        """``/info``'s ``has_state``; a ValueError naming ``key`` when there is no answer."""
        why = ""
        for attempt in range(self._retries + 1):
            if attempt:
                time.sleep(self._backoff_s * 2 ** (attempt - 1))
            try:
                response = httpx.get(
                    f"{self.url}/info", timeout=min(self._timeout_s, PROBE_TIMEOUT_S)
                )
            except httpx.HTTPError as exc:
                why = f"{type(exc).__name__}: {exc}"
                continue
            if response.status_code >= 500:
                why = f"HTTP {response.status_code}"
                continue
            try:
                info = response.json() if response.is_success else None
            except ValueError:
                info = None
            if not isinstance(info, dict) or not isinstance(info.get("has_state"), bool):
                raise ValueError(
                    f"{key}: {self.url}/info answered HTTP {response.status_code} "
                    f'{response.text[:200]!r}; expected {{"has_state": true|false}} (is it an '
                    "environment server? see python -m rolloutd.episodes.server --help)"
                )
            return info["has_state"]
        raise ValueError(
            f"{key}: cannot reach {self.url}/info ({why}; {self._retries + 1} attempts)"
        )

    async def reset(self, start: EpisodeStart) -> tuple[Message, ...]:
        where = f"{self.url}/reset ({start.episode_id})"
        body = await self._post("/reset", start_body(start), where)
        return messages_of(_field(body, "messages", where), where)

    async def step(
        self, episode_id: str, turn: int, completion: str, *, replay: bool = False
    ) -> StepResult:
        where = f"{self.url}/step ({episode_id}, turn {turn})"
        request = {"episode_id": episode_id, "turn": turn, "completion": completion}
        body = await self._post("/step", {**request, "replay": replay}, where, step=True)
        return step_result_of(body, where)

    async def state(self, episode_id: str) -> bytes:
        where = f"{self.url}/state ({episode_id})"
        body = await self._post("/state", {"episode_id": episode_id}, where)
        encoded = _field(body, "state", where)
        try:
            return base64.b64decode(encoded, validate=True)
        except (TypeError, binascii.Error) as exc:
            raise malformed(f"{where}: 'state' is not base64 ({exc})") from None

    async def restore(self, start: EpisodeStart, state: bytes) -> None:
        where = f"{self.url}/restore ({start.episode_id})"
        body = {"start": start_body(start), "state": base64.b64encode(state).decode()}
        await self._post("/restore", body, where)

    async def close(self) -> None:
        await self._client.aclose()

    async def _post(
        self, path: str, body: Mapping[str, Any], where: str, *, step: bool = False
    ) -> Any:
        """The answer's JSON; tries again as the module docstring says."""
        attempts = self._retries + 1
        end, why = EpisodeEnd.STEP_FAILED, ""
        for attempt in range(attempts):
            if attempt:
                await asyncio.sleep(self._backoff_s * 2 ** (attempt - 1))
            try:
                async with asyncio.timeout(self._timeout_s):
                    response = await self._client.post(self.url + path, json=body)
            except (TimeoutError, httpx.TimeoutException):
                end, why = EpisodeEnd.STEP_TIMEOUT, f"no answer within {self._timeout_s:g} s"
                if step:
                    raise EnvironmentFailure(end, f"{where}: {why}") from None
            except httpx.TransportError as exc:
                end, why = EpisodeEnd.STEP_FAILED, f"unreachable ({type(exc).__name__}: {exc})"
            else:
                if response.status_code >= 500:
                    end, why = _server_error(response)
                elif not response.is_success:
                    raise EnvironmentFailure(
                        EpisodeEnd.STEP_FAILED,
                        f"{where}: HTTP {response.status_code}, not retried: {response.text[:300]}",
                    )
                else:
                    try:
                        return response.json()
                    except ValueError:
                        raise malformed(
                            f"{where}: the answer is not JSON: {response.text[:200]!r}"
                        ) from None
            log.debug("%s, attempt %d of %d: %s", where, attempt + 1, attempts, why)
        raise EnvironmentFailure(end, f"{where}: {why} ({attempts} attempts)")


def _server_error(response: httpx.Response) -> tuple[EpisodeEnd, str]:
    """How a 5xx ends the episode: the ``error`` the server named, else a failed step."""
    try:
        body = response.json()
    except ValueError:
        body = None
    if isinstance(body, dict):
        try:
            end = EpisodeEnd(body.get("error"))
        except ValueError:
            end = EpisodeEnd.STEP_FAILED
        if end.failed:
            return end, f"HTTP {response.status_code}: {body.get('detail', '')}"
    return EpisodeEnd.STEP_FAILED, f"HTTP {response.status_code}: {response.text[:300]}"


def _field(body: Any, name: str, where: str) -> Any:
    if not isinstance(body, dict) or name not in body:
        raise malformed(f"{where}: expected a JSON object with {name!r}, got {str(body)[:200]}")
    return body[name]
