"""A deterministic engine for tests and for benchmarks that isolate the service's own overhead.

Token ids are a pure function of (prompt, seed, policy version), so a re-run of a sibling after a
restart reproduces it exactly. Time to finish is a latency drawn from a seeded distribution plus
``tokens / tokens_per_s``. A sample's own draws (its length, its latency and where its tokens
start) come from a SHAKE-128 digest of that key; its tokens, logprobs and text are a window of
one fixed token stream (:class:`_Stream`), copied out as buffers. At the instant rate of the
control-plane benchmark the engine must cost the service a few microseconds per sample, not a
Python call (or a numpy call) per token.

With a delta sink the tokens are handed over in deltas of :data:`DELTA_TOKENS` spread over that
time (all in one delta when there is no time to wait). A request with a prefix continues the
same window after the prefix's tokens (the prefix is taken as it is), so a sibling resumed on
the same weights ends as it would have without a restart. Stop strings are not simulated.

The engine's own signals are simulated plausibly: a KV cache of ``kv_cache_sequences`` that
preempts a request started while it is full, a prefix cache that hits the prompt of a recent
request (a group's later siblings), and each request's time to first token (its latency plus
one token's time) and end.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import json
import math
import os
import time
import zlib
from array import array
from collections import OrderedDict, deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from rolloutd.domain.engine import (
    DeltaSink,
    EngineCounters,
    EngineError,
    FinishedRequest,
    GenerationRequest,
    RequestObserver,
)
from rolloutd.domain.group import Sample
from rolloutd.domain.partial import TokenDelta, join_parts
from rolloutd.domain.weights import WeightsPhase, WeightsTimeline

_VOCAB = 32_000

DELTA_TOKENS = 16
"""Tokens per streamed delta."""

RECENT_REQUESTS = 1000
"""Requests the prefix cache's hit ratio is taken over (as vLLM's)."""


@dataclass(frozen=True)
class SyntheticConfig:
    """The synthetic engine's settings; ``rolloutd.config`` exposes them as
    ``engine.synthetic.*`` keys with these defaults and meanings."""

    tokens_per_s: float = 2000.0
    """Generation speed of one synthetic request (0: instant)."""
    latency_s: float = 0.0
    """Median extra latency of a synthetic request."""
    latency_sigma: float = 0.0
    """Log-normal spread of that latency (0: constant)."""
    min_tokens: int = 8
    """Shortest synthetic completion; lengths are uniform in [min_tokens, engine.max_tokens]."""
    kv_cache_sequences: int = 0
    """Sequences the simulated KV cache holds (0: any number). A request started while it is
    full counts a preemption; its usage is the running requests over this."""


class SyntheticEngine:
    name = "synthetic"

    def __init__(self, config: SyntheticConfig | None = None) -> None:
        self._config = config or SyntheticConfig()
        self._version = 0
        self._prompt_tokens = 0
        self._generation_tokens = 0
        self._running: dict[str, asyncio.Task[None]] = {}
        self._paused = asyncio.Event()
        self._paused.set()
        self._preemptions = 0
        self._prefix = _PrefixCache()
        self._observer: RequestObserver | None = None

    async def start(self) -> None:
        return None

    async def stop(self) -> None:
        await self.abort(list(self._running))

    @property
    def policy_version(self) -> int:
        return self._version

    def check_alive(self) -> None:
        """In-process, it lives as long as the service."""

    def counters(self) -> EngineCounters:
        capacity = self._config.kv_cache_sequences
        running = len(self._running)
        return EngineCounters(
            prompt_tokens=self._prompt_tokens,
            generation_tokens=self._generation_tokens,
            requests_running=running,
            kv_cache_usage=min(running / capacity, 1.0) if capacity else 0.0,
            preemptions=self._preemptions,
            prefix_cache_hit_ratio=self._prefix.hit_ratio,
        )

    def report_requests(self, observer: RequestObserver) -> None:
        """``ReportsRequests``: each request's simulated first token and end."""
        self._observer = observer

    async def generate(
        self, request: GenerationRequest, on_delta: DeltaSink | None = None
    ) -> Sample:
        if not self._paused.is_set():
            await self._paused.wait()
        started = time.time()
        version = self._version
        cfg = self._config
        max_tokens = request.params.max_tokens
        context = request.context
        key = f"{request.prompt.text}|{request.seed}|{version}"
        if context is not None:  # an episode's turn: its tokens follow from the conversation
            key += f"|{zlib.crc32(context.tobytes())}"
        draws = _Draws(key)
        length = draws.length(min(cfg.min_tokens, max_tokens), max_tokens)
        prompt_ids = _prompt_ids(request.prompt.text) if context is None else context
        prefix = request.prefix
        done = len(prefix) if prefix is not None else 0
        token_ids, logprobs, text = _stream().window(draws.start + done, length - done)
        new = len(token_ids)
        delay = cfg.latency_s * (
            math.exp(draws.gauss() * cfg.latency_sigma) if cfg.latency_sigma else 1
        )
        first_token_s = delay + (1 / cfg.tokens_per_s if cfg.tokens_per_s > 0 and new else 0.0)
        if cfg.tokens_per_s > 0:
            delay += new / cfg.tokens_per_s
        self._prompt_tokens += len(prompt_ids) + done
        self._prefix.request(request.prompt.text, len(prompt_ids) + done)
        streamed = 0

        def counted(delta: TokenDelta) -> None:
            # tokens count as generated when handed over, as an aborted request's do in vLLM
            nonlocal streamed
            streamed += len(delta.token_ids)
            self._generation_tokens += len(delta.token_ids)
            assert on_delta is not None
            on_delta(delta)

        if delay > 0:
            task = asyncio.current_task()
            assert task is not None
            if cfg.kv_cache_sequences and len(self._running) >= cfg.kv_cache_sequences:
                self._preemptions += 1
            try:
                self._running[request.request_id] = task  # type: ignore[assignment]
                await self._emit(
                    token_ids, logprobs, version, delay, None if on_delta is None else counted
                )
            finally:
                self._running.pop(request.request_id, None)
        elif on_delta is not None and token_ids:
            # nothing to wait for, so nothing to abort and no time to spread deltas over: the
            # tokens go in one delta, with no await until the sample is returned
            counted(TokenDelta(token_ids, logprobs, version))
        self._generation_tokens += new - streamed
        if self._observer is not None:
            self._reported(len(prompt_ids) + done, new, first_token_s, delay)
        finish = "length" if max(length, done) >= max_tokens else "stop"
        if prefix is None:
            return Sample(
                index=request.index,
                token_ids=token_ids,
                logprobs=logprobs,
                text=text,
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

    def _reported(self, prompt: int, new: int, first_token_s: float, duration_s: float) -> None:
        observer = self._observer
        assert observer is not None
        if new:
            observer.first_token(first_token_s)
        observer.request_finished(
            FinishedRequest(
                input_tokens=prompt,
                output_tokens=new,
                duration_s=duration_s,
                time_per_output_token_s=(duration_s - first_token_s) / (new - 1)
                if new > 1
                else None,
            )
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

    async def render_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        tools: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool,
    ) -> str:
        """The tiny model's template (``engines/tiny_model.py``): tools in a system turn first,
        one JSON object a line."""
        listed = "".join(json.dumps(dict(t), ensure_ascii=False) + "\n" for t in tools)
        head = f"<|system|>\n# Tools\n{listed}<|end|>\n" if tools else ""
        body = "".join(f"<|{m['role']}|>\n{m['content']}<|end|>\n" for m in messages)
        return "<|bos|>" + head + body + ("<|assistant|>\n" if add_generation_prompt else "")

    async def encode(self, text: str) -> array[int]:
        """One token per character (its code point)."""
        return array("i", map(ord, text))

    def decode(self, token_ids: array[int]) -> str:
        return _text(token_ids)

    async def abort(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            task = self._running.pop(rid, None)
            if task is not None:
                task.cancel()

    async def update_weights(
        self,
        path: str,
        version: int,
        *,
        timeline: WeightsTimeline | None = None,
        only: tuple[str, ...] | None = None,
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


class _PrefixCache:
    """The prefix cache's hit ratio over the most recent requests: a request whose prompt a
    recent request had (a group's later siblings) finds all of it cached."""

    def __init__(self) -> None:
        self._prompts: OrderedDict[str, None] = OrderedDict()
        self._recent: deque[tuple[int, int]] = deque()
        self._queries = self._hits = 0

    def request(self, prompt: str, tokens: int) -> None:
        hit = tokens if prompt in self._prompts else 0
        self._prompts[prompt] = None
        self._prompts.move_to_end(prompt)
        if len(self._prompts) > RECENT_REQUESTS:
            self._prompts.popitem(last=False)
        self._recent.append((tokens, hit))
        self._queries += tokens
        self._hits += hit
        if len(self._recent) > RECENT_REQUESTS:
            queries, hits = self._recent.popleft()
            self._queries -= queries
            self._hits -= hits

    @property
    def hit_ratio(self) -> float:
        return self._hits / self._queries if self._queries else 0.0


class _Draws:
    """The seeded draws of one sample, from a SHAKE-128 digest of its key: 8 bytes for the
    length, 8 for the latency, 8 for where its tokens start in the stream."""

    def __init__(self, key: str) -> None:
        self._raw = hashlib.shake_128(key.encode()).digest(24)
        self.start = int.from_bytes(self._raw[16:24], "little") % _STREAM_TOKENS
        """Stream position of the sample's first token."""

    def length(self, shortest: int, longest: int) -> int:
        """Uniform in [shortest, longest]."""
        return shortest + int.from_bytes(self._raw[:8], "little") % (longest - shortest + 1)

    def gauss(self) -> float:
        """A standard normal draw (Box-Muller on the latency's two 32-bit words)."""
        u1 = (int.from_bytes(self._raw[8:12], "little") + 1) / 2**32
        u2 = int.from_bytes(self._raw[12:16], "little") / 2**32
        return math.sqrt(-2 * math.log(u1)) * math.cos(2 * math.pi * u2)


_STREAM_TOKENS = 1 << 18
"""Tokens in the stream that samples are windows of (it wraps around at the end)."""


class _Stream:
    """A fixed stream of token ids uniform in [3, vocabulary), logprobs -Exp(2) and their text
    (one word per token, space-separated), drawn once from SHAKE-128.

    A sample is the window of ``length`` tokens from its seeded start, read position by
    position modulo the stream's length, so token ``i`` of a sample does not depend on the
    sample's length and a resumed sample continues its window. Reading a window copies buffers
    and slices one string: its cost does not grow with a Python step per token.
    """

    def __init__(self) -> None:
        raw = hashlib.shake_128(b"rolloutd synthetic stream").digest(8 * _STREAM_TOKENS)
        words = np.frombuffer(raw, np.uint32)
        ids = (words[:_STREAM_TOKENS] % (_VOCAB - 3) + 3).astype(np.int32)
        lps = (np.log1p(-(words[_STREAM_TOKENS:] / 2**32)) / 2).astype(np.float32)
        self._ids = memoryview(ids.tobytes())
        self._lps = memoryview(lps.tobytes())
        spelled = [_WORDS[t] for t in ids.tolist()]
        self._text = " ".join(spelled) + " "  # every word ends with a space, the last one too
        ends = np.cumsum([len(w) + 1 for w in spelled])
        self._starts = array("q", [0, *ends.tolist()])
        """Character offset of each token's word; ``_starts[n]`` is the text's length. An array,
        not a list: a quarter of a million Python ints would hold about 9 MB."""

    @staticmethod
    def _runs(start: int, count: int) -> list[tuple[int, int]]:
        """The window as runs [a, b) of stream positions, split where it wraps around."""
        runs = []
        start %= _STREAM_TOKENS
        while count > 0:
            end = min(start + count, _STREAM_TOKENS)
            runs.append((start, end))
            count -= end - start
            start = 0
        return runs

    def window(self, start: int, count: int) -> tuple[array[int], array[float], str]:
        """Token ids, logprobs and text of ``count`` tokens from stream position ``start``."""
        token_ids, logprobs = array("i"), array("f")
        runs = self._runs(start, count)
        for a, b in runs:
            token_ids.frombytes(self._ids[4 * a : 4 * b])
            logprobs.frombytes(self._lps[4 * a : 4 * b])
        starts, text = self._starts, self._text
        if len(runs) == 1:
            [(a, b)] = runs
            return token_ids, logprobs, text[starts[a] : starts[b] - 1]
        return token_ids, logprobs, "".join(text[starts[a] : starts[b]] for a, b in runs)[:-1]


@functools.cache
def _stream() -> _Stream:
    """Built on first use (tens of milliseconds), so importing the engine costs nothing."""
    return _Stream()


@functools.lru_cache(maxsize=4096)
def _prompt_ids(text: str) -> array[int]:
    """A prompt's token ids, one per byte of its first 512; the siblings of a group share the
    array (a sample's buffers are never mutated)."""
    return array("i", list(text.encode()[:512]))


_WORDS = [f"t{t}" for t in range(_VOCAB)]
"""The word of each token id: a sample's text is one word per token."""


def _text(token_ids: array[int]) -> str:
    return " ".join(map(_WORDS.__getitem__, token_ids))
