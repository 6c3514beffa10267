"""Where generation goes and the engine's own signals, from a real controller and the synthetic
engine through the catalogue's instruments (an in-memory reader)."""

from __future__ import annotations

import pytest

from rolloutd.domain.controller import Controller, ControllerConfig
from rolloutd.domain.fate import EngineState, TokenFate
from rolloutd.domain.group import Prompt
from rolloutd.domain.sampler import Sampler
from rolloutd.domain.spec import SamplingParams
from rolloutd.engines.synthetic import SyntheticConfig, SyntheticEngine
from rolloutd.telemetry.metrics import MetricsObserver
from rolloutd.telemetry.sources import CheckpointState, status_snapshot
from tests.controllers import fetch
from tests.fakes import settle
from tests.telemetry.test_metrics import collect, points, value

PROMPTS = [Prompt(f"p{i}", f"question number {i}") for i in range(100)]


async def test_a_run_reports_token_fates_engine_time_and_the_engines_signals(metric_reader):
    provider, reader = metric_reader
    engine = SyntheticEngine(SyntheticConfig(tokens_per_s=2000, kv_cache_sequences=4))
    controller = Controller(
        ControllerConfig(
            group_size=4, max_in_flight=3, buffer_capacity=4, sampling=SamplingParams(max_tokens=32)
        ),
        engine,
        Sampler(PROMPTS, seed=0),
    )
    observer = MetricsObserver(provider)
    engine.report_requests(observer)
    observer.register_sources(
        engine.counters,
        engine.name,
        lambda: status_snapshot(controller.status()),
        CheckpointState,
        model="synthetic",
    )
    controller.start()
    try:
        # nobody fetches: the buffer fills and the engine waits for room
        await settle(lambda: controller.status().buffer.committed == 4)
        await settle(
            lambda: controller.token_account().engine_seconds[EngineState.IDLE_BUFFER_FULL] > 0
        )
        lease, _ = await fetch(controller, 2, 5_000, "trainer")
        await controller.ack(lease.lease_id, 1)
    finally:
        await controller.stop()

    account = controller.token_account()
    m = collect(reader)
    fates = {f: value(m["rolloutd.tokens"], fate=f.value) for f in TokenFate}
    assert sum(fates.values()) == account.generated == sum(account.fates.values())
    assert fates == dict(account.fates)
    assert fates[TokenFate.DELIVERED] > 0 and fates[TokenFate.BUFFERED] > 0
    assert value(m["rolloutd.goodput"]) == pytest.approx(account.goodput)
    seconds = {s: value(m["rolloutd.engine.time"], state=s.value) for s in EngineState}
    assert seconds[EngineState.GENERATING] > 0 and seconds[EngineState.IDLE_BUFFER_FULL] > 0

    # 12 sequences at once in a cache of 4; a group's later siblings find its prompt cached
    assert value(m["rolloutd.engine.preemptions"], engine="synthetic") > 0
    assert value(m["rolloutd.engine.prefix_cache.hit_ratio"], engine="synthetic") >= 0.5
    gen_ai = {
        "gen_ai.operation.name": "text_completion",
        "gen_ai.provider.name": "synthetic",
        "gen_ai.request.model": "synthetic",
    }
    counters = engine.counters()
    output = value(m["gen_ai.client.token.usage"], **gen_ai, **{"gen_ai.token.type": "output"})
    assert output.sum == counters.generation_tokens
    finished = value(m["gen_ai.server.request.duration"], **gen_ai)
    assert finished.count == output.count > 0
    first = value(m["gen_ai.server.time_to_first_token"], **gen_ai)
    assert first.count == finished.count and 0 < first.sum < finished.sum
    assert value(m["gen_ai.server.time_per_output_token"], **gen_ai).count == finished.count
    assert all(p.count for p in points(m["gen_ai.client.token.usage"]).values())
