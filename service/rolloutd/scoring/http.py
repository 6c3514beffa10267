"""The HTTP verifier: a reward model or judge served elsewhere, named by its URL.

Each sample is one ``POST`` of JSON::

    {"prompt_id": "p7", "prompt": "...", "messages": [...], "metadata": {...},
     "completion": "...", "token_ids": [1, 2, 3], "finish_reason": "stop", "index": 0}

answered with ``{"reward": 0.75}`` or ``{"reward": 0.75, "info": {...}}``. At most
``concurrency`` requests are in flight at once; each may take ``timeout_s``. A request that
times out, cannot connect, or gets a 5xx is retried ``retries`` times, after ``backoff_s``,
then twice that, and so on; a 4xx (or any other status) is the server refusing this input and
is not retried. Every way it ends is a score: the failed ones say how, and after how many
attempts.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from dataclasses import asdict
from typing import Any

import httpx

from rolloutd.domain.finishing import SampleScore
from rolloutd.scoring.inputs import ScoringInput
from rolloutd.scoring.results import ScoreFailure, failed, score_of

log = logging.getLogger(__name__)


def request_body(sample: ScoringInput) -> dict[str, Any]:
    """What is posted for ``sample`` (field names as :class:`ScoringInput`'s)."""
    body = asdict(sample)
    body["messages"] = list(sample.messages)
    body["token_ids"] = list(sample.token_ids)
    return body


class HttpVerifier:
    """Scores samples by posting them to ``url`` (see the module docstring)."""

    def __init__(
        self,
        url: str,
        *,
        timeout_s: float,
        concurrency: int,
        retries: int,
        backoff_s: float,
    ) -> None:
        self.url = url
        self._timeout_s = timeout_s
        self._retries = retries
        self._backoff_s = backoff_s
        self._slots = asyncio.Semaphore(concurrency)
        self._client = httpx.AsyncClient(
            timeout=timeout_s, limits=httpx.Limits(max_connections=concurrency)
        )

    async def start(self) -> None:
        """Nothing to start: connections are opened as requests need them."""

    async def score(self, inputs: Sequence[ScoringInput]) -> list[SampleScore]:
        return list(await asyncio.gather(*(self._score(x) for x in inputs)))

    async def _score(self, sample: ScoringInput) -> SampleScore:
        body = request_body(sample)
        attempts = self._retries + 1
        for attempt in range(attempts):
            if attempt:
                await asyncio.sleep(self._backoff_s * 2 ** (attempt - 1))
            try:
                async with self._slots, asyncio.timeout(self._timeout_s):
                    response = await self._client.post(self.url, json=body)
            except (TimeoutError, httpx.TimeoutException):
                kind, why = ScoreFailure.TIMEOUT, f"no answer within {self._timeout_s:g} s"
            except httpx.TransportError as exc:
                kind, why = ScoreFailure.UNREACHABLE, f"{type(exc).__name__}: {exc}"
            else:
                if response.status_code < 500:
                    return self._read(response)
                kind, why = ScoreFailure.HTTP_STATUS, f"HTTP {response.status_code}"
            log.debug("%s, attempt %d of %d: %s", self.url, attempt + 1, attempts, why)
        return failed(kind, f"{self.url}: {why} ({attempts} attempts)")

    def _read(self, response: httpx.Response) -> SampleScore:
        if not response.is_success:
            text = response.text[:200]
            return failed(
                ScoreFailure.HTTP_STATUS,
                f"{self.url}: HTTP {response.status_code}, not retried: {text}",
            )
        try:
            body = response.json()
        except ValueError:
            body = None
        if not isinstance(body, dict) or "reward" not in body:
            return failed(
                ScoreFailure.BAD_RESULT,
                f'{self.url} answered {response.text[:200]!r}; expected {{"reward": number}}',
            )
        info = body.get("info")
        return score_of(body["reward"] if info is None else (body["reward"], info))

    async def aclose(self) -> None:
        await self._client.aclose()
