"""Small hand-written fakes for domain tests."""

from __future__ import annotations

import asyncio
import time
from array import array

from rolloutd.domain.engine import EngineCounters, GenerationRequest
from rolloutd.domain.group import Sample
from rolloutd.domain.weights import WeightsTimeline


class GatedEngine:
    """Each request waits until the test releases it; records every request it saw."""

    name = "gated"

    def __init__(self, *, auto: bool = False, tokens: int = 5) -> None:
        self.auto = auto
        self.tokens = tokens
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

    def release(self, n: int | None = None) -> int:
        pending = [rid for rid, gate in self._gates.items() if not gate.is_set()]
        for rid in pending[:n]:
            self._gates[rid].set()
        return len(pending[:n])

    async def generate(self, request: GenerationRequest) -> Sample:
        self.requests.append(request)
        gate = self._gates.setdefault(request.request_id, asyncio.Event())
        if self.auto:
            gate.set()
        try:
            await gate.wait()
        finally:
            self._gates.pop(request.request_id, None)
        self.generated += self.tokens
        return Sample(
            index=request.index,
            token_ids=array("i", [request.seed % 1000 + i for i in range(self.tokens)]),
            logprobs=array("f", [-0.5] * self.tokens),
            text="x",
            finish_reason="stop",
            policy_version=self._version,
            prompt_token_ids=array("i", [1, 2]),
            seed=request.seed,
            started_at=time.time(),
            finished_at=time.time(),
        )

    async def abort(self, request_ids: list[str]) -> None:
        self.aborted.extend(request_ids)

    async def update_weights(
        self, path: str, version: int, *, timeline: WeightsTimeline | None = None
    ) -> None:
        self._version = version


async def settle(predicate, within_s: float = 2.0) -> None:
    """Yields to the loop until ``predicate()`` holds."""
    deadline = time.monotonic() + within_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(0.005)
