"""The limit on groups in flight: fixed, or following the engine's KV cache and preemptions."""

import asyncio
from dataclasses import replace

from rolloutd.domain.concurrency import (
    ConcurrencyConfig,
    ConcurrencyState,
    EngineReading,
    InFlightLimit,
    InFlightReason,
)
from rolloutd.domain.controller import Controller, ControllerConfig
from rolloutd.domain.group import Prompt
from rolloutd.domain.sampler import Sampler
from tests.fakes import GatedEngine, settle

CONFIG = ConcurrencyConfig(ceiling=64, kv_cache_soft_limit=0.9, initial=4)


class Engine:
    """What the limit reads, moved by the test: a reading at a time."""

    def __init__(self, limit: InFlightLimit) -> None:
        self.limit = limit
        self.usage = 0.0
        self.preemptions = 0
        self.departed = 0

    def read(self, in_flight: int | None = None) -> bool:
        busy = self.limit.value if in_flight is None else in_flight
        return self.limit.observe(EngineReading(self.usage, self.preemptions, busy, self.departed))

    def turn_over(self, in_flight: int | None = None) -> bool:
        """Every group in flight finishes and is replaced; returns whether the limit changed."""
        self.read(in_flight)
        self.departed += self.limit.value if in_flight is None else in_flight
        return self.read(in_flight)


def test_a_fixed_limit_never_moves():
    limit = InFlightLimit(16)
    engine = Engine(limit)
    engine.preemptions = 9
    assert not engine.turn_over() and not engine.turn_over()
    assert (limit.value, limit.reason, limit.adaptive) == (16, InFlightReason.FIXED, False)
    assert limit.state() == ConcurrencyState(None)


def test_it_grows_only_once_the_groups_in_flight_have_turned_over():
    limit = InFlightLimit(64, CONFIG)
    engine = Engine(limit)
    assert (limit.value, limit.reason) == (4, InFlightReason.STARTING)
    engine.read()
    engine.departed += 3  # not yet all 4
    assert not engine.read()
    engine.departed += 1
    assert engine.read()
    assert (limit.value, limit.reason) == (8, InFlightReason.GROWING)


def test_growth_stops_where_usage_in_proportion_reaches_the_soft_limit():
    limit = InFlightLimit(64, CONFIG)
    engine = Engine(limit)
    engine.usage = 0.3  # at 4 groups: 12 groups would use 0.9
    engine.turn_over()
    assert limit.value == 8  # at most doubled
    engine.usage = 0.6
    engine.turn_over()
    assert limit.value == 12  # 8 x 0.9 / 0.6
    engine.usage = 0.85
    assert not engine.turn_over()
    assert (limit.value, limit.reason) == (12, InFlightReason.KV_CACHE_HIGH)  # 12.7 rounds down


def test_the_peak_sizes_a_jump_and_past_it_it_creeps_while_the_mean_has_room():
    limit = InFlightLimit(64, CONFIG)
    engine = Engine(limit)
    for usage in (0.2, 0.45, 0.3):  # peak 0.45 at 4 groups: 8 would peak at 0.9
        engine.usage = usage
        engine.read()
    engine.departed += 4
    assert engine.read()
    assert (limit.value, limit.reason) == (8, InFlightReason.GROWING)
    for usage in (0.4, 1.0, 0.5):  # a peak at the cache's edge, mean 0.6 at 8 groups
        engine.usage = usage
        engine.read()
    engine.departed += 8
    engine.usage = 0.5
    assert engine.read()
    assert limit.value == 9  # past the peak: one group, as the mean has room for it
    engine.usage = 0.82  # 0.82 x 10 / 9 = 0.91: one group more would reach the soft limit
    assert not engine.turn_over()
    assert (limit.value, limit.reason) == (9, InFlightReason.KV_CACHE_HIGH)


def test_a_preemption_backs_off_once_per_turnover():
    limit = InFlightLimit(64, replace(CONFIG, initial=32))
    engine = Engine(limit)
    engine.preemptions = 7  # before its first reading: not its doing
    engine.read()
    assert limit.value == 32
    engine.preemptions += 3
    assert engine.read()
    assert (limit.value, limit.reason) == (16, InFlightReason.PREEMPTED)
    engine.preemptions += 5  # the 32 groups still in flight go on overflowing
    assert not engine.read(in_flight=32)
    assert limit.value == 16
    engine.departed += 32  # they have all left: the cooling window ends, growth is judged anew
    assert not engine.read(in_flight=16)
    assert (limit.value, limit.reason) == (16, InFlightReason.PREEMPTED)
    engine.preemptions += 1
    assert engine.read(in_flight=16)
    assert limit.value == 8


def test_it_grows_back_half_way_to_what_overflowed_then_probes_above_it_slowly():
    limit = InFlightLimit(64, replace(CONFIG, initial=20, probe_after=3))
    engine = Engine(limit)
    engine.read()
    engine.preemptions += 1
    engine.read()  # 20 overflowed: back to 10
    engine.departed += 20
    engine.read(in_flight=10)  # the cooling turnover ends
    engine.usage = 0.3
    values = []
    while engine.turn_over():
        values.append(limit.value)
    assert values == [15, 17, 18, 19]  # never 20 again
    assert limit.reason is InFlightReason.PREEMPTED
    for _ in range(2):
        assert not engine.turn_over()
        assert (limit.value, limit.reason) == (19, InFlightReason.PREEMPTED)
    assert engine.turn_over()  # the third quiet turnover lets it try 20
    assert limit.value == 20


def test_a_try_that_preempts_goes_back_to_the_value_that_held():
    """And a preemption at a value that held goes one below it."""
    limit = InFlightLimit(64, replace(CONFIG, initial=10))
    engine = Engine(limit)
    engine.usage = 0.3
    assert engine.turn_over()
    assert limit.value == 20  # held 10 through a turnover, grew
    engine.preemptions += 2
    assert engine.read()
    assert (limit.value, limit.reason) == (10, InFlightReason.PREEMPTED)  # back, not 20 / 2
    engine.departed += 20
    assert not engine.read(in_flight=10)  # the cooling turnover
    assert engine.turn_over()
    assert limit.value == 15  # half way to the 20 that overflowed
    engine.preemptions += 1
    assert engine.read()
    assert limit.value == 10  # the value it grew from, which turned over quietly
    engine.departed += 15
    assert not engine.read(in_flight=10)  # the cooling turnover
    assert engine.turn_over()
    assert limit.value == 12  # half way to the 15 that overflowed
    engine.read(in_flight=9)
    engine.departed += 12
    assert not engine.read(in_flight=9)
    assert limit.reason is InFlightReason.NOT_LIMITING  # a quiet turnover at 12
    engine.preemptions += 1
    assert engine.read()
    assert limit.value == 11  # 12 itself held once: one below it
    engine.departed += 12
    engine.read(in_flight=11)  # the cooling turnover
    engine.preemptions += 1  # 11 preempts before it ever turned over quietly: heavier samples
    assert engine.read()
    assert limit.value == 5


def test_a_lighter_turnover_after_a_full_one_jumps_again():
    limit = InFlightLimit(64, replace(CONFIG, initial=10))
    engine = Engine(limit)
    engine.usage = 0.92
    assert not engine.turn_over()
    assert limit.reason is InFlightReason.KV_CACHE_HIGH
    engine.usage = 0.5  # lighter samples: in proportion 18 groups peak at 0.9
    assert engine.turn_over()
    assert (limit.value, limit.reason) == (18, InFlightReason.GROWING)


def test_an_engine_that_restarted_counts_from_zero_without_a_back_off():
    limit = InFlightLimit(64, CONFIG)
    engine = Engine(limit)
    engine.preemptions = 50
    engine.read()
    engine.preemptions = 0
    engine.read()
    engine.preemptions = 0
    assert not engine.read()
    assert limit.reason is InFlightReason.STARTING


def test_it_never_goes_above_the_ceiling_nor_below_one():
    limit = InFlightLimit(64, replace(CONFIG, ceiling=6))
    engine = Engine(limit)
    engine.turn_over()
    assert limit.value == 6
    assert not engine.turn_over()
    assert limit.reason is InFlightReason.CEILING
    for _ in range(5):
        engine.preemptions += 1
        engine.read()
        engine.departed += 6
        engine.read()
    assert limit.value == 1


def test_a_limit_nothing_reaches_does_not_grow():
    limit = InFlightLimit(64, CONFIG)
    engine = Engine(limit)
    assert not engine.turn_over(in_flight=2)
    assert (limit.value, limit.reason) == (4, InFlightReason.NOT_LIMITING)


def test_its_value_is_restored_within_the_ceiling():
    limit = InFlightLimit(64, replace(CONFIG, ceiling=20))
    limit.restore(ConcurrencyState(13))
    assert (limit.value, limit.reason) == (13, InFlightReason.STARTING)
    limit.restore(ConcurrencyState(90))
    assert limit.value == 20
    limit.restore(ConcurrencyState(None))  # a snapshot from before it: the value stays
    assert limit.value == 20
    fixed = InFlightLimit(16)
    fixed.restore(ConcurrencyState(13))
    assert fixed.value == 16


# --- in the controller ----------------------------------------------------------------------


class KVEngine(GatedEngine):
    def __init__(self) -> None:
        super().__init__()
        self.usage = 0.0
        self.preempted = 0

    def counters(self):
        return replace(super().counters(), kv_cache_usage=self.usage, preemptions=self.preempted)


async def test_admission_follows_the_limit_the_engine_signals_set():
    engine = KVEngine()
    cfg = ControllerConfig(
        group_size=2,
        max_in_flight=6,
        buffer_capacity=200,
        staleness_gating=False,
        concurrency=ConcurrencyConfig(ceiling=6, initial=2, interval_s=0.005),
    )
    prompts = [Prompt(f"p{i}", f"question {i}") for i in range(500)]
    c = Controller(cfg, engine, Sampler(prompts, seed=0))
    c.start()
    seen: list[tuple[int, int]] = []

    async def generate() -> None:  # the engine finishes whatever is in flight, over and over
        while True:
            seen.append((c.rooms.flight.groups, c.rooms.admitter.limit.value))
            engine.release()
            await asyncio.sleep(0.01)

    task = asyncio.create_task(generate())
    try:
        await settle(lambda: c.admission_status().in_flight_reason is InFlightReason.CEILING)
        assert c.admission_status().in_flight_limit == 6
        growing = list(seen)
        engine.preempted, engine.usage = 4, 0.95  # and the cache stays full: no growing back
        await settle(lambda: c.admission_status().in_flight_reason is InFlightReason.PREEMPTED)
        status = c.status().admission
        # 6 had turned over without a preemption: one below it, not 6 x 0.5
        assert (status.in_flight_limit, status.adaptive, status.in_flight_ceiling) == (5, True, 6)
        mark = len(seen) + 2  # the groups in flight at the back-off finish within two rounds
        await settle(lambda: len(seen) > mark + 10)
        assert c.admission_status().in_flight_reason is InFlightReason.KV_CACHE_HIGH
    finally:
        task.cancel()
        await c.stop()
    assert all(in_flight <= limit for in_flight, limit in growing)
    assert max(in_flight for in_flight, _ in growing) == 6
    assert all(in_flight <= 5 for in_flight, _ in seen[mark:])
