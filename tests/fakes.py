"""Small hand-written fakes for domain tests."""

from __future__ import annotations

import asyncio
import time
from array import array
from dataclasses import replace

from rolloutd.domain.engine import DeltaSink, EngineCounters, GenerationRequest
from rolloutd.domain.group import Sample
from rolloutd.domain.partial import TokenDelta, join_parts
from rolloutd.domain.weights import WeightsTimeline


class GatedEngine:
    """Each request waits until the test releases it; records every request it saw.

    With a delta sink, the first ``early`` tokens are handed over before the request waits and
    the rest once released. A request with a prefix continues after the prefix's tokens."""

    name = "gated"

    def __init__(self, *, auto: bool = False, tokens: int = 5, early: int = 0) -> None:
        self.auto = auto
        self.tokens = tokens
        self.early = early
        self.requests: list[GenerationRequest] = []
        self.aborted: list[str] = []
        self._gates: dict[str, asyncio.Event] = {}
        self._version = 0
        self.generated = 0

    @property
    def policy_version(self) -> int:
        return self._version

    async def start(self) -> None:
        return None

    async def stop(self) -> None:
        return None

    def counters(self) -> EngineCounters:
        return EngineCounters(generation_tokens=self.generated, requests_running=len(self._gates))

    def check_alive(self) -> None:
        return None

    def release(self, n: int | None = None) -> int:
        pending = [rid for rid, gate in self._gates.items() if not gate.is_set()]
        for rid in pending[:n]:
            self._gates[rid].set()
        return len(pending[:n])

    async def generate(
        self, request: GenerationRequest, on_delta: DeltaSink | None = None
    ) -> Sample:
        self.requests.append(request)
        prefix = request.prefix
        done = len(prefix) if prefix is not None else 0
        ids = array("i", [request.seed % 1000 + i for i in range(done, self.tokens)])
        lps = array("f", [-0.5 - i / 100 for i in range(done, self.tokens)])
        version = self._version
        if on_delta is not None and self.early:
            on_delta(TokenDelta(ids[: self.early], lps[: self.early], version))
        gate = self._gates.setdefault(request.request_id, asyncio.Event())
        if self.auto:
            gate.set()
        try:
            await gate.wait()
        finally:
            self._gates.pop(request.request_id, None)
        if on_delta is not None and ids[self.early :]:
            on_delta(TokenDelta(ids[self.early :], lps[self.early :], version))
        self.generated += len(ids)
        sample = Sample(
            index=request.index,
            token_ids=ids,
            logprobs=lps,
            text="x",
            finish_reason="stop",
            policy_version=version,
            prompt_token_ids=array("i", [1, 2]),
            seed=request.seed,
            started_at=time.time(),
            finished_at=time.time(),
        )
        if prefix is None:
            return sample
        parts = join_parts(prefix.parts(), done, version, len(ids))
        return replace(
            sample,
            token_ids=prefix.token_ids() + ids,
            logprobs=prefix.logprobs() + lps,
            policy_version=min(p.policy_version for p in parts),
            resumed_at=done,
            parts=parts,
        )

    async def abort(self, request_ids: list[str]) -> None:
        self.aborted.extend(request_ids)

    async def update_weights(
        self,
        path: str,
        version: int,
        *,
        timeline: WeightsTimeline | None = None,
        only: tuple[str, ...] | None = None,
    ) -> None:
        self._version = version


async def settle(predicate, within_s: float = 30.0) -> None:
    """Yields to the loop until ``predicate()`` holds."""
    deadline = time.monotonic() + within_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(0.005)
