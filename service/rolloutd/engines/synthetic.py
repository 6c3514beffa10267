"""A deterministic engine for tests and for benchmarks that isolate the service's own overhead.

Token ids are a pure function of (prompt, seed, policy version), so a re-run of a sibling after a
restart reproduces it exactly. Time to finish is a latency drawn from a seeded distribution plus
``tokens / tokens_per_s``. Every draw of a sample comes from one SHAKE-128 stream of that key,
turned into tokens and logprobs with numpy in a few array operations: at the instant rate of the
control-plane benchmark the engine must cost the service microseconds per sample, not a Python
call per token.

With a delta sink the tokens are handed over in deltas of :data:`DELTA_TOKENS` spread over that
time. A request with a prefix continues the same stream after the prefix's tokens (the prefix is
taken as it is), so a sibling resumed on the same weights ends as it would have without a
restart. Stop strings are not simulated.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import math
import os
import time
from array import array

import numpy as np

from rolloutd.config import SyntheticSettings
from rolloutd.domain.engine import DeltaSink, EngineCounters, EngineError, GenerationRequest
from rolloutd.domain.group import Sample
from rolloutd.domain.partial import TokenDelta, join_parts
from rolloutd.domain.weights import WeightsPhase, WeightsTimeline

_VOCAB = 32_000

DELTA_TOKENS = 16
"""Tokens per streamed delta."""


class SyntheticEngine:
    name = "synthetic"

    def __init__(self, config: SyntheticSettings | None = None) -> None:
        """``config``: the ``engine.synthetic`` keys."""
        self._config = config or SyntheticSettings()
        self._version = 0
        self._prompt_tokens = 0
        self._generation_tokens = 0
        self._running: dict[str, asyncio.Task[None]] = {}
        self._paused = asyncio.Event()
        self._paused.set()

    async def start(self) -> None:
        return None

    async def stop(self) -> None:
        await self.abort(list(self._running))

    @property
    def policy_version(self) -> int:
        return self._version

    def counters(self) -> EngineCounters:
        return EngineCounters(
            prompt_tokens=self._prompt_tokens,
            generation_tokens=self._generation_tokens,
            requests_running=len(self._running),
        )

    async def generate(
        self, request: GenerationRequest, on_delta: DeltaSink | None = None
    ) -> Sample:
        await self._paused.wait()
        started = time.time()
        version = self._version
        cfg = self._config
        max_tokens = request.params.max_tokens
        draws = _Draws(f"{request.prompt.text}|{request.seed}|{version}", max_tokens)
        length = draws.length(min(cfg.min_tokens, max_tokens))
        prompt_ids = array("i", _prompt_ids(request.prompt.text))
        stream_ids, stream_lps = draws.tokens(length)
        prefix = request.prefix
        done = len(prefix) if prefix is not None else 0
        token_ids, logprobs = stream_ids[done:], stream_lps[done:]
        new = len(token_ids)
        delay = cfg.latency_s * (
            math.exp(draws.gauss() * cfg.latency_sigma) if cfg.latency_sigma else 1
        )
        if cfg.tokens_per_s > 0:
            delay += new / cfg.tokens_per_s
        self._prompt_tokens += len(prompt_ids) + done
        if delay > 0:
            task = asyncio.current_task()
            assert task is not None
            try:
                self._running[request.request_id] = task  # type: ignore[assignment]
                await self._emit(token_ids, logprobs, version, delay, on_delta)
            finally:
                self._running.pop(request.request_id, None)
        else:  # nothing to wait for, so nothing to abort: no await until the sample is returned
            await self._emit(token_ids, logprobs, version, delay, on_delta)
        self._generation_tokens += new
        finish = "length" if max(length, done) >= max_tokens else "stop"
        if prefix is None:
            return Sample(
                index=request.index,
                token_ids=token_ids,
                logprobs=logprobs,
                text=_text(token_ids),
                finish_reason=finish,
                policy_version=version,
                prompt_token_ids=prompt_ids,
                seed=request.seed,
                started_at=started,
                finished_at=time.time(),
            )
        whole = prefix.token_ids() + token_ids
        parts = join_parts(prefix.parts(), done, version, new)
        return Sample(
            index=request.index,
            token_ids=whole,
            logprobs=prefix.logprobs() + logprobs,
            text=_text(whole),
            finish_reason=finish,
            policy_version=min(p.policy_version for p in parts) if parts else version,
            prompt_token_ids=prompt_ids,
            seed=request.seed,
            started_at=started,
            finished_at=time.time(),
            resumed_at=done,
            parts=parts,
        )

    @staticmethod
    async def _emit(
        token_ids: array[int],
        logprobs: array[float],
        version: int,
        delay: float,
        on_delta: DeltaSink | None,
    ) -> None:
        """Waits ``delay`` in all, handing the tokens to ``on_delta`` in deltas along the way."""
        if on_delta is None or not token_ids:
            if delay > 0:
                await asyncio.sleep(delay)
            return
        steps = range(0, len(token_ids), DELTA_TOKENS)
        for start in steps:
            if delay > 0:
                await asyncio.sleep(delay / len(steps))
            end = start + DELTA_TOKENS
            on_delta(TokenDelta(token_ids[start:end], logprobs[start:end], version))

    async def abort(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            task = self._running.pop(rid, None)
            if task is not None:
                task.cancel()

    async def update_weights(
        self, path: str, version: int, *, timeline: WeightsTimeline | None = None
    ) -> None:
        """No weights to load, but the path must exist, as it must for vLLM: a trainer that
        tests against this engine learns of a wrong path here, not on the GPU fleet."""
        if not await asyncio.to_thread(os.path.exists, path):
            raise EngineError(f"weights path {path}: does not exist")
        timeline = timeline or WeightsTimeline()
        with timeline.phase(WeightsPhase.PAUSE):
            self._paused.clear()
        try:
            with timeline.phase(WeightsPhase.LOAD):
                self._version = version
        finally:
            with timeline.phase(WeightsPhase.RESUME):
                self._paused.set()


class _Draws:
    """The seeded draws of one sample, read from one SHAKE-128 stream of its key: 8 bytes for
    the length, 8 for the latency, then one 32-bit word per token for its id and one for its
    logprob (``max_tokens`` of each, so a token's draws do not depend on the length)."""

    def __init__(self, key: str, max_tokens: int) -> None:
        self._max = max_tokens
        self._raw = hashlib.shake_128(key.encode()).digest(16 + 8 * max_tokens)

    def length(self, shortest: int) -> int:
        """Uniform in [shortest, max_tokens]."""
        return shortest + int.from_bytes(self._raw[:8], "little") % (self._max - shortest + 1)

    def gauss(self) -> float:
        """A standard normal draw (Box-Muller on the latency's two 32-bit words)."""
        u1 = (int.from_bytes(self._raw[8:12], "little") + 1) / 2**32
        u2 = int.from_bytes(self._raw[12:16], "little") / 2**32
        return math.sqrt(-2 * math.log(u1)) * math.cos(2 * math.pi * u2)

    def tokens(self, length: int) -> tuple[array[int], array[float]]:
        """Token ids uniform in [3, vocabulary) and logprobs -Exp(2), the first ``length``."""
        words = np.frombuffer(self._raw, np.uint32, 2 * self._max, 16)
        ids = (words[:length] % (_VOCAB - 3) + 3).astype(np.int32)
        lps = (np.log1p(-(words[self._max : self._max + length] / 2**32)) / 2).astype(np.float32)
        token_ids, logprobs = array("i"), array("f")
        token_ids.frombytes(ids.tobytes())
        logprobs.frombytes(lps.tobytes())
        return token_ids, logprobs


@functools.lru_cache(maxsize=4096)
def _prompt_ids(text: str) -> tuple[int, ...]:
    """A prompt's token ids, one per byte of its first 512; the siblings of a group share it."""
    return tuple(text.encode()[:512])


_WORDS = [f"t{t}" for t in range(_VOCAB)]
"""The word of each token id: a sample's text is one word per token."""


def _text(token_ids: array[int]) -> str:
    return " ".join(map(_WORDS.__getitem__, token_ids))
