"""The pipeline's seams: a finishing stage decides each finished group outside the barrier, and a
sibling runner decides how a sibling is produced."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import replace

from rolloutd.domain.controller import Controller, ControllerConfig
from rolloutd.domain.engine import DeltaSink, EngineError, GenerationRequest
from rolloutd.domain.finishing import COMMIT, FinishingGroup, Verdict
from rolloutd.domain.group import GroupState, Prompt, Sample
from rolloutd.domain.observer import GroupDropped, GroupFinished, NullObserver
from rolloutd.domain.partial import PartialSibling
from rolloutd.domain.runner import SiblingJob
from rolloutd.domain.sampler import Sampler
from tests.controllers import fetch
from tests.fakes import GatedEngine, settle

PROMPTS = [Prompt(f"p{i}", f"question {i}") for i in range(10)]


def make(engine, **kw) -> Controller:  # type: ignore[no-untyped-def]
    cfg = ControllerConfig(group_size=2, max_in_flight=16, buffer_capacity=32, reap_interval_s=0.02)
    return Controller(cfg, engine, Sampler(PROMPTS, seed=0, epochs=1), **kw)


def odd(group: FinishingGroup) -> bool:
    return int(group.prompt.prompt_id[1:]) % 2 == 1


class DropOdd:
    """Drops the groups of odd-numbered prompts, with a reason."""

    def __init__(self) -> None:
        self.seen: list[int] = []

    async def finish(self, group: FinishingGroup) -> Verdict:
        self.seen.append(group.group_id)
        assert group.position is not None and len(group.samples) == 2
        return Verdict("odd", f"prompt {group.prompt.prompt_id}") if odd(group) else COMMIT


async def _drain(c: Controller, n: int) -> list[str]:
    prompt_ids = []
    while len(prompt_ids) < n:
        got = await fetch(c, 16, 2000, "t")
        assert got is not None
        lease, groups = got
        prompt_ids += [g.meta.prompt.prompt_id for g in groups]
        await c.ack(lease.lease_id, 1)
    return prompt_ids


async def test_a_stage_that_drops_every_other_group_consumes_their_positions(caplog):
    caplog.set_level(logging.DEBUG, logger="rolloutd.domain.drops")
    stage = DropOdd()
    c = make(GatedEngine(auto=True), stage=stage)
    c.start()
    try:
        await settle(lambda: c.rooms.sampler.exhausted and not c.rooms.flight.groups, within_s=10)
        delivered = await _drain(c, 5)
        assert sorted(delivered) == [f"p{i}" for i in range(0, 10, 2)]
        assert (
            c.rooms.accounting.counters.dropped_groups == 5
            and c.rooms.accounting.counters.admitted_groups == 10
        )
        assert (
            c.rooms.accounting.counters.dropped_by_reason == {"odd": 5}
            and c.rooms.accounting.counters.dropped_tokens == 5 * 10
        )
        assert len(stage.seen) == 10 == len(set(stage.seen))  # each group decided once
        assert not c.rooms.sampler.has_next()  # a dropped position is consumed, not admitted again
        assert "(prompt p1) dropped: odd: prompt p1" in caplog.text
    finally:
        await c.stop()


class Gate:
    """Commits the groups of even-numbered prompts at once; holds the others until released."""

    def __init__(self) -> None:
        self.released = asyncio.Event()
        self.held: set[int] = set()

    async def finish(self, group: FinishingGroup) -> Verdict:
        if odd(group):
            self.held.add(group.group_id)
            await self.released.wait()
        return COMMIT


async def test_a_blocked_stage_holds_no_barrier():
    gate = Gate()
    c = make(GatedEngine(auto=True), stage=gate)
    c.start()
    try:
        await settle(lambda: len(gate.held) == 5 and c.rooms.buffer.ready_count == 5, within_s=10)
        assert c.status().buffer.finishing == 5
        assert sorted(await _drain(c, 5)) == [f"p{i}" for i in range(0, 10, 2)]  # fetch, ack
        async with asyncio.timeout(5), c.barrier.exclusive():  # what a checkpoint takes
            state = c.capture()
        finishing = [m for m in state.buffer.groups.values() if m and m.state.value == "finishing"]
        assert sorted(m.group_id for m in finishing) == sorted(gate.held)
        gate.released.set()
        await settle(lambda: c.rooms.buffer.ready_count == 5)
        assert c.status().buffer.finishing == 0
    finally:
        await c.stop()


async def test_drops_after_a_capture_are_not_in_it():
    """A snapshot's counters are encoded after the hold ends: drops counted meanwhile belong to
    the next snapshot (a restore from this one drops those groups again and counts them then)."""

    class HoldThenDropOdd(Gate):
        async def finish(self, group: FinishingGroup) -> Verdict:
            await super().finish(group)
            return Verdict("odd", "") if odd(group) else COMMIT

    gate = HoldThenDropOdd()
    c = make(GatedEngine(auto=True), stage=gate)
    c.start()
    try:
        await settle(lambda: len(gate.held) == 5 and c.rooms.buffer.ready_count == 5, within_s=10)
        async with asyncio.timeout(5), c.barrier.exclusive():
            state = c.capture()
        gate.released.set()
        await settle(lambda: c.rooms.accounting.counters.dropped_groups == 5)
        assert c.rooms.accounting.counters.dropped_by_reason == {"odd": 5}
        assert state.counters.dropped_groups == 0 and state.counters.dropped_by_reason == {}
    finally:
        await c.stop()


async def test_a_stage_that_fails_drops_its_group_with_the_error():
    class Broken:
        async def finish(self, group: FinishingGroup) -> Verdict:
            raise ValueError("no reward for you")

    c = make(GatedEngine(auto=True), stage=Broken())
    c.start()
    try:
        await settle(lambda: c.rooms.accounting.counters.dropped_groups == 10, within_s=10)
        assert c.fatal is None and not c.rooms.buffer.groups
        assert c.rooms.accounting.counters.dropped_by_reason == {"stage_failed": 10}
    finally:
        await c.stop()


class Drops(NullObserver):
    def __init__(self) -> None:
        self.finished: list[GroupFinished] = []
        self.dropped: list[GroupDropped] = []

    def group_finished(self, event: GroupFinished) -> None:
        self.finished.append(event)

    def group_dropped(self, event: GroupDropped) -> None:
        self.dropped.append(event)


class FailsOnPrompt(GatedEngine):
    """Every sibling of one prompt's group fails with an engine error."""

    def __init__(self, prompt_id: str) -> None:
        super().__init__(auto=True)
        self.prompt_id = prompt_id

    async def generate(
        self, request: GenerationRequest, on_delta: DeltaSink | None = None
    ) -> Sample:
        if request.prompt.prompt_id == self.prompt_id:
            raise EngineError("out of blocks")
        return await super().generate(request, on_delta)


async def test_every_drop_is_reported_once_with_its_reason_and_wasted_tokens():
    observer = Drops()
    cfg = ControllerConfig(group_size=2, max_in_flight=16, buffer_capacity=32, sibling_retries=0)
    c = Controller(
        cfg,
        FailsOnPrompt("p0"),
        Sampler(PROMPTS, seed=0, epochs=1),
        stage=DropOdd(),
        observer=observer,
    )
    c.start()
    try:
        await settle(lambda: c.rooms.sampler.exhausted and not c.rooms.flight.groups, within_s=10)
        await settle(lambda: c.rooms.accounting.counters.dropped_groups == 6, within_s=10)
    finally:
        await c.stop()
    reasons = sorted(e.reason for e in observer.dropped)
    assert reasons == ["engine_error", "odd", "odd", "odd", "odd", "odd"]
    assert len({e.group_id for e in observer.dropped}) == 6
    assert sum(e.tokens for e in observer.dropped) == c.rooms.accounting.counters.dropped_tokens
    assert all(e.tokens == 2 * 5 for e in observer.dropped if e.reason == "odd")
    # the engine error never reached the stage: only the 9 groups generated whole finished
    assert len(observer.finished) == 9
    assert all(e.started_ns <= e.ended_ns for e in observer.finished)


async def test_stop_cancels_a_blocked_stage_and_keeps_the_group_finishing():
    gate = Gate()
    c = make(GatedEngine(auto=True), stage=gate)
    c.start()
    await settle(lambda: len(gate.held) == 5, within_s=10)
    await c.stop()
    held = {gid: c.rooms.buffer.groups[gid].state for gid in gate.held}
    assert set(held.values()) == {GroupState.FINISHING}


class TwoCalls:
    """Produces a sibling in two engine calls: the first ``first`` tokens, then the rest from
    them as a prefix; a restored prefix that covers the first call skips it."""

    def __init__(self, first: int) -> None:
        self.first = first
        self.calls: list[tuple[str, int]] = []

    async def run(self, job: SiblingJob) -> Sample:
        request, deltas = job.request, []
        prefix = request.prefix
        if prefix is None or len(prefix) < self.first:

            def sink(delta):  # type: ignore[no-untyped-def]
                deltas.append(delta)
                if job.on_delta is not None:
                    job.on_delta(delta)

            self.calls.append((request.request_id, 0 if prefix is None else len(prefix)))
            first = replace(request, params=replace(request.params, max_tokens=self.first))
            head = await job.engine.generate(first, sink)
            start = [] if prefix is None else list(prefix.deltas)
            prefix = PartialSibling(request.group_id, request.index, start + deltas, 0)
            prefix = replace(prefix, count=len(prefix.chunks))
            assert len(prefix) == len(head.token_ids)
        self.calls.append((request.request_id, len(prefix)))
        return await job.engine.generate(replace(request, prefix=prefix), job.on_delta)


async def test_a_runner_of_two_engine_calls_streams_both_into_one_sample():
    engine = GatedEngine(auto=True, tokens=5)
    runner = TwoCalls(first=3)
    c = make(engine, runner=runner)
    c.start()
    try:
        await settle(lambda: c.rooms.sampler.exhausted and not c.rooms.flight.groups, within_s=10)
        got = await fetch(c, 1, 1000, "t")
        assert got is not None
        [group] = got[1]
        for s in group.ordered_samples():
            assert len(s.token_ids) == 5 and s.resumed_at == 5  # GatedEngine ignores max_tokens
        assert len(runner.calls) == 2 * 2 * 10
        # every second engine call continues from the first call's tokens
        assert [r.prefix is not None for r in engine.requests] == [False, True] * 20
    finally:
        await c.stop()
