"""Throughput: committed tokens/s through the service on vLLM versus the raw engine.

And what checkpoints every 2 s and telemetry cost, measured in the same run. One ``VLLMEngine``
serves the tiny model (float32; eager on CPU, see :func:`engine_overrides`) in this process for
the whole run: starting it takes most of a minute on CPU, so every variant shares it. Each round
runs every variant once:

- **engine**: the engine called directly with the work the service would ask for, at the same
  concurrency: ``max_in_flight`` slots, each taking the next prompt from a ``Sampler`` seeded as
  the service's is and generating its ``group_size`` siblings at once with the siblings' seeds
  and the service's sampling parameters; a group counts when its last sibling is done. That its
  first wave of requests equals the service's (prompts, seeds, parameters) is checked.
- **service**: a real ``RolloutService`` on the same engine (through :class:`SharedEngine`, whose
  ``stop`` leaves the engine running) with the example trainer (``rolloutd trainer``, gRPC) in
  its own process fetching and acking as fast as groups come; checkpoints and telemetry off.
- **service+checkpoints**: the same with a checkpoint every 2 s into a local temporary directory.
- **service+telemetry**: the same with the OpenTelemetry SDK on: spans and metrics (every second)
  exported over OTLP/gRPC to a sink in a process of its own, ``/metrics`` scraped every second
  (the sink and scraper of ``telemetry_overhead.py``).

The order of the variants rotates from round to round, so drift in the machine's load weighs on
every variant alike; a ratio is taken within each round and the median over rounds is reported.
A variant is measured after a warm-up (for the service, one that starts once the trainer has
acked its first groups), from the committed group and token counters read every 10 ms; the CPU
time of this process (the service and vLLM's frontend), of the engine's processes and of the
trainer is read at both ends of the measured span.

Generation comes in waves: the groups of a wave are admitted together, their siblings decode in
lockstep to ``max_tokens``, and the wave commits within a fraction of a second, about 4,000 tokens.
Over a window of a few seconds the delta of committed tokens therefore moves by up to a whole wave
depending on where the window's ends fall. The figure reported is measured between wave ends
instead: from the first time the committed group count reaches a multiple of ``max_in_flight``
after the warm-up to the first such time at least ``window_s`` later, a whole number of waves.
The plain fixed-window delta is kept beside it (``fixed_window_tokens_per_s``).

The trainer is not the bottleneck: the buffer holds ``buffer_capacity`` = 16 waves of groups, so
admission never waits for the trainer unless it falls 15 waves behind; the most groups ever
committed and not yet acked during a measured span is recorded for every run (one wave, 16, when
the trainer keeps up), with the trainer's CPU.

Usage: ``python benchmarks/throughput.py [--quick] [--json FILE]``.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import common
import psutil
from telemetry_overhead import OtlpSink, Scraper

from rolloutd.config import Config, load_config
from rolloutd.dataset import load_prompts
from rolloutd.domain.engine import DeltaSink, EngineCounters, GenerationRequest
from rolloutd.domain.group import GroupMeta, Prompt, Sample
from rolloutd.domain.sampler import Sampler
from rolloutd.domain.weights import WeightsTimeline
from rolloutd.server import RolloutService
from rolloutd.telemetry.providers import ExporterName, OtlpProtocol, Telemetry, setup_telemetry

if TYPE_CHECKING:
    from rolloutd.engines.vllm import VLLMEngine

NAME = "throughput"
ROOT = Path(__file__).resolve().parent.parent


class Variant(enum.Enum):
    ENGINE = "engine"
    SERVICE = "service"
    CHECKPOINTS = "service+checkpoints"
    TELEMETRY = "service+telemetry"


RATIOS = {
    "service_vs_engine": (Variant.SERVICE, Variant.ENGINE, 0.95),
    "checkpoint_on_vs_off": (Variant.CHECKPOINTS, Variant.SERVICE, 0.99),
    "telemetry_on_vs_off": (Variant.TELEMETRY, Variant.SERVICE, 0.99),
}
"""Ratio name -> (numerator, denominator, target it is reported against)."""


@dataclass(frozen=True)
class Load:
    """The work every variant does; the service's defaults unless said otherwise."""

    group_size: int = 4
    max_in_flight: int = 16
    """Groups generating at once: ``max_in_flight * group_size`` concurrent engine requests."""
    max_tokens: int = 64
    temperature: float = 1.0
    top_p: float = 1.0
    buffer_capacity: int = 256
    """16 waves of ``max_in_flight`` groups: admission waits for the trainer only if it falls 15
    waves behind."""
    checkpoint_interval_s: float = 2.0
    trainer_groups_per_step: int = 8
    metric_export_interval_s: float = 1.0
    scrape_interval_s: float = 1.0
    poll_interval_s: float = 0.01
    """How often the committed counters are read."""


@dataclass(frozen=True)
class Plan:
    rounds: int = 6
    """Runs of each variant."""
    warmup_s: float = 3.0
    """Served before measuring (after the trainer's first ack for the service variants)."""
    window_s: float = 12.0
    """Shortest measured span; it ends at the first wave end after this long."""
    engine_warmup_s: float = 5.0
    """Generation right after the engine starts, not measured (the first batches are slow)."""


FULL = Plan()
QUICK = Plan(rounds=3, warmup_s=1.0, window_s=3.0, engine_warmup_s=2.0)
QUICK_CHANGES = "quick: 3 rounds, 3 s windows after 1 s of warm-up (full: 6 rounds, 12 s, 3 s)"


# --- the shared engine ----------------------------------------------------------------------


class SharedEngine:
    """The run's one ``VLLMEngine``, lent to each ``RolloutService`` in turn.

    A service starts its engine and stops it on shutdown; this adapter leaves both to the
    benchmark, which starts the engine once and stops it at the end. Everything else goes to the
    engine unchanged. It keeps the first requests it is given, to check that the engine variant
    asks for the same work.
    """

    def __init__(self, engine: VLLMEngine, keep: int) -> None:
        self._engine = engine
        self.name = engine.name
        self._keep = keep
        self.first_requests: list[GenerationRequest] = []

    async def start(self) -> None:
        return None

    async def stop(self) -> None:
        return None

    async def generate(
        self, request: GenerationRequest, on_delta: DeltaSink | None = None
    ) -> Sample:
        if len(self.first_requests) < self._keep:
            self.first_requests.append(request)
        return await self._engine.generate(request, on_delta)

    async def abort(self, request_ids: list[str]) -> None:
        await self._engine.abort(request_ids)

    async def update_weights(
        self,
        path: str,
        version: int,
        *,
        timeline: WeightsTimeline | None = None,
        only: tuple[str, ...] | None = None,
    ) -> None:
        await self._engine.update_weights(path, version, timeline=timeline, only=only)

    def counters(self) -> EngineCounters:
        return self._engine.counters()

    def check_alive(self) -> None:
        self._engine.check_alive()

    @property
    def policy_version(self) -> int:
        return self._engine.policy_version


def group_seed(root_seed: int, group_id: int) -> int:
    """A group's seed, as ``Controller._new_group`` derives it (checked: see ``same_work``)."""
    return (root_seed * 7_919 + group_id * 104_729) % (2**31 - 1)


def work_of(requests: Sequence[GenerationRequest]) -> set[tuple[str, int, int, Any]]:
    """What a request asks the engine for, without its id."""
    return {(r.prompt.prompt_id, r.index, r.seed, r.params) for r in requests}


class EngineDriver:
    """Asks the engine directly for what the service would: ``max_in_flight`` group slots, each
    admitting the next prompt of an identically seeded sampler and generating its siblings at
    once; a group is counted (as the service commits it) when its last sibling is done."""

    def __init__(self, engine: VLLMEngine, config: Config, prompts: Sequence[Prompt]) -> None:
        self._engine = engine
        self._ctl = config.controller()
        ds = config.dataset
        self._sampler = Sampler(prompts, seed=ds.seed, shuffle=ds.shuffle, epochs=ds.epochs)
        self._next_gid = 1
        self.groups = 0
        self.tokens = 0
        self.requests: list[GenerationRequest] = []
        self._slots: list[asyncio.Task[None]] = []

    async def _slot(self) -> None:
        ctl = self._ctl
        while (admission := self._sampler.next()) is not None:
            gid, self._next_gid = self._next_gid, self._next_gid + 1
            group = GroupMeta(
                group_id=gid,
                prompt=admission.prompt,
                position=admission.position,
                group_size=ctl.group_size,
                policy_version=self._engine.policy_version,
                admitted_at=time.time(),
                seed=group_seed(ctl.seed, gid),
            )
            requests = [
                GenerationRequest(
                    request_id=f"engine-g{gid}-s{i}",
                    group_id=gid,
                    index=i,
                    prompt=group.prompt,
                    seed=group.sibling_seed(i),
                    params=ctl.sampling,
                )
                for i in range(ctl.group_size)
            ]
            if len(self.requests) < ctl.max_in_flight * ctl.group_size:
                self.requests += requests
            samples = await asyncio.gather(*(self._engine.generate(r) for r in requests))
            self.groups += 1
            self.tokens += sum(len(s.token_ids) for s in samples)

    def start(self) -> None:
        self._slots = [asyncio.create_task(self._slot()) for _ in range(self._ctl.max_in_flight)]

    async def stop(self) -> None:
        """Cancels every slot; the engine aborts their requests."""
        for task in self._slots:
            task.cancel()
        results = await asyncio.gather(*self._slots, return_exceptions=True)
        failed = [r for r in results if not isinstance(r, asyncio.CancelledError)]
        if failed:
            common.fail(f"the engine variant failed: {failed[0]!r}")


# --- reading the counters -------------------------------------------------------------------


@dataclass(frozen=True)
class Tick:
    at: float
    groups: int
    """Committed groups so far."""
    tokens: int
    """Committed tokens so far."""
    backlog: int = 0
    """Groups committed but not yet acked (ready or leased): what the trainer has not consumed."""
    acked: int = 0
    """Groups acked so far."""


@dataclass
class Meter:
    """Reads the committed counters every ``interval_s`` on the event loop and notes each wave end:
    the first reading at which the committed group count reaches the next multiple of ``wave``."""

    read: Callable[[float], Tick]
    wave: int
    interval_s: float
    needs_ack: bool = False
    """Whether measuring waits for the first ack (the trainer is up)."""
    ready: asyncio.Event = field(default_factory=asyncio.Event)
    ticks: list[Tick] = field(default_factory=list)
    wave_ends: list[Tick] = field(default_factory=list)
    _task: asyncio.Task[None] | None = None

    async def _run(self) -> None:
        first = self.read(time.monotonic())
        self.ticks.append(first)
        target = (first.groups // self.wave + 1) * self.wave
        while True:
            await asyncio.sleep(self.interval_s)
            tick = self.read(time.monotonic())
            self.ticks.append(tick)
            if tick.acked or not self.needs_ack:
                self.ready.set()
            if tick.groups >= target:
                self.wave_ends.append(tick)
                target = (tick.groups // self.wave + 1) * self.wave

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="throughput-meter")

    async def stop(self) -> None:
        assert self._task is not None
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task

    async def wave_end_after(self, t: float, timeout_s: float = 120.0) -> Tick:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for tick in self.wave_ends:
                if tick.at >= t:
                    return tick
            await asyncio.sleep(self.interval_s)
        common.fail(f"no group committed for {timeout_s:.0f} s")
        raise AssertionError("unreachable")

    def at(self, t: float) -> Tick:
        """The last reading at or before ``t``."""
        return [k for k in self.ticks if k.at <= t][-1]


class CpuClock:
    """CPU seconds (user + system) of this process, the engine's processes and the trainer."""

    def __init__(self, engine_procs: Sequence[psutil.Process], trainer_pid: int | None) -> None:
        self._groups: dict[str, Sequence[psutil.Process]] = {
            "this_process": [psutil.Process()],
            "engine_processes": engine_procs,
            "trainer": [psutil.Process(trainer_pid)] if trainer_pid else [],
        }

    def read(self) -> dict[str, float]:
        out = {}
        for name, procs in self._groups.items():
            total = 0.0
            for p in procs:
                with contextlib.suppress(psutil.NoSuchProcess):
                    t = p.cpu_times()
                    total += t.user + t.system
            out[name] = total
        return out


async def measure(meter: Meter, plan: Plan, cpu: CpuClock) -> dict[str, Any]:
    """Warm up, then measure from a wave end to the first wave end ``window_s`` or more later."""
    await asyncio.wait_for(meter.ready.wait(), 120)
    await asyncio.sleep(plan.warmup_s)
    warm = time.monotonic()
    first = await meter.wave_end_after(warm)
    cpu0 = cpu.read()
    last = await meter.wave_end_after(first.at + plan.window_s)
    cpu1 = cpu.read()
    await asyncio.sleep(max(0.0, warm + plan.window_s - time.monotonic()) + meter.interval_s)
    span = last.at - first.at
    a, b = meter.at(warm), meter.at(warm + plan.window_s)
    inside = [k for k in meter.ticks if first.at <= k.at <= last.at]
    return {
        "tokens_per_s": (last.tokens - first.tokens) / span,
        "groups_per_s": (last.groups - first.groups) / span,
        "measured_s": span,
        "waves": (last.groups - first.groups) / meter.wave,
        "fixed_window_tokens_per_s": (b.tokens - a.tokens) / (b.at - a.at),
        "max_backlog_groups": max(k.backlog for k in inside),
        "backlog_groups_at_end": last.backlog,
        "cpu_share": {k: (cpu1[k] - cpu0[k]) / span for k in cpu0},
        "cpu_s_per_mtok": {
            k: (cpu1[k] - cpu0[k]) / (last.tokens - first.tokens) * 1e6 for k in cpu0
        },
    }


# --- one variant ----------------------------------------------------------------------------


class TrainerProcess:
    """The example trainer, ``rolloutd trainer``, in a process of its own: fetch up to
    ``groups_per_step`` groups, ack them, repeat, with no simulated training time."""

    def __init__(self, address: str, groups_per_step: int, log_path: Path) -> None:
        self.log_path = log_path
        self._log = log_path.open("w")
        self.proc = subprocess.Popen(
            [
                sys.executable, "-m", "rolloutd.cli", "--log-level", "WARNING", "trainer",
                "--target", address, "--groups-per-step", str(groups_per_step),
                "--idle-exit-s", "600",
            ],
            stdout=self._log,
            stderr=subprocess.STDOUT,
            cwd=log_path.parent,
        )  # fmt: skip

    def stop(self) -> None:
        """Ends the trainer, which must still have been running."""
        code = self.proc.poll()
        if code is None:
            self.proc.terminate()
            self.proc.wait(30)
        self._log.close()
        if code is not None:
            common.fail(f"the trainer exited with {code}:\n{self.log_path.read_text()[-4000:]}")


def service_config(
    load: Load,
    variant: Variant,
    workdir: Path,
    engine: dict[str, Any],
    extra: dict[str, Any] | None = None,
) -> Config:
    """The service's config for ``variant``; ``extra`` overrides go on top (``scoring.py`` adds
    its verifier)."""
    interval = load.checkpoint_interval_s if variant is Variant.CHECKPOINTS else 0
    return load_config(
        overrides={
            **engine,
            "engine.max_tokens": load.max_tokens,
            "engine.temperature": load.temperature,
            "engine.top_p": load.top_p,
            "group_size": load.group_size,
            "limits.max_in_flight": load.max_in_flight,
            "limits.buffer_capacity": load.buffer_capacity,
            "grpc.host": "127.0.0.1",
            "grpc.port": 0,
            "grpc.grace_s": 1.0,
            "http.host": "127.0.0.1",
            "http.port": 0,
            "checkpoint.dir": str(workdir / "checkpoints"),
            "checkpoint.interval_s": interval,
            "restore": "none",
            **(extra or {}),
        },
        environ={},
    )


def telemetry_for(variant: Variant, load: Load, sink: OtlpSink) -> Telemetry:
    if variant is not Variant.TELEMETRY:
        return setup_telemetry(disabled=True)
    telemetry = setup_telemetry(
        service_name="rolloutd-throughput",
        otlp_endpoint=f"http://127.0.0.1:{sink.port}",
        otlp_protocol=OtlpProtocol.GRPC,
        traces_exporters=(ExporterName.OTLP,),
        metrics_exporters=(ExporterName.OTLP,),
        metric_export_interval_s=load.metric_export_interval_s,
    )
    if not telemetry.enabled:
        common.fail("telemetry is disabled in this environment (OTEL_SDK_DISABLED?)")
    return telemetry


@dataclass
class Bench:
    """What every variant of the run shares."""

    load: Load
    engine: VLLMEngine
    engine_procs: list[psutil.Process]
    """The engine's own processes (engine core, workers), for CPU accounting."""
    shared: SharedEngine
    base: Config
    prompts: Sequence[Prompt]
    sink: OtlpSink
    scraper: Scraper


async def run_engine(bench: Bench, plan: Plan) -> dict[str, Any]:
    driver = EngineDriver(bench.engine, bench.base, bench.prompts)
    load = bench.load
    meter = Meter(
        lambda at: Tick(at, driver.groups, driver.tokens), load.max_in_flight, load.poll_interval_s
    )
    meter.start()
    driver.start()
    try:
        figures = await measure(meter, plan, CpuClock(bench.engine_procs, None))
    finally:
        await meter.stop()
        await driver.stop()
    return {**figures, "requests": driver.requests}


async def run_service(bench: Bench, variant: Variant, plan: Plan, workdir: Path) -> dict[str, Any]:
    load, sink = bench.load, bench.sink
    config = service_config(load, variant, workdir, engine_overrides())
    spans0, points0 = sink.totals()
    telemetry = telemetry_for(variant, load, sink)
    service = RolloutService(config, engine=bench.shared, telemetry=telemetry)
    addresses = await service.start()
    counters = service.controller.rooms.accounting.counters

    def read(at: float) -> Tick:
        c = counters
        backlog = c.committed_groups - c.acked_groups
        return Tick(at, c.committed_groups, c.committed_tokens, backlog, c.acked_groups)

    meter = Meter(read, load.max_in_flight, load.poll_interval_s, needs_ack=True)
    meter.start()
    trainer = TrainerProcess(addresses.grpc, load.trainer_groups_per_step, workdir / "trainer.log")
    scraping = variant is Variant.TELEMETRY and addresses.http is not None
    if scraping:
        assert addresses.http is not None
        bench.scraper.start(addresses.http)
    scrapes = 0
    try:
        cpu = CpuClock(bench.engine_procs, trainer.proc.pid)
        figures = await measure(meter, plan, cpu)
        figures["checkpoints"] = service.checkpointer.sequence
    finally:
        await meter.stop()
        trainer.stop()
        if scraping:
            scrapes, _ = bench.scraper.pause()
        await service.shutdown()
    lost = counters.dropped_groups + counters.evicted_groups + counters.requeued_groups
    if lost:
        common.fail(f"{variant.value}: {lost} groups dropped, evicted or requeued")
    spans, points = sink.totals()  # the service flushed its telemetry as it stopped
    extra: dict[str, Any] = {
        "spans_exported": spans - spans0,
        "metric_points_exported": points - points0,
        "scrapes": scrapes,
    }
    if variant is Variant.TELEMETRY and not (spans > spans0 and points > points0 and scrapes):
        common.fail("telemetry was on but nothing reached the OTLP sink or /metrics")
    return figures | extra


# --- the run --------------------------------------------------------------------------------


def schedule(round_index: int) -> list[Variant]:
    """Every variant once, the order rotated by one each round."""
    order = list(Variant)
    k = round_index % len(order)
    return order[k:] + order[:k]


def engine_overrides() -> dict[str, Any]:
    """The tiny model in float32, as ``rolloutd serve`` runs it; eager on CPU.

    On CPU vLLM compiles without Inductor: compiling adds 20-40 s to every start here and made
    no difference to decode speed when measured side by side, and the whole quick run must fit
    in three minutes. Elsewhere the service's default (compiled) is kept.
    """
    from vllm.platforms import current_platform

    return {"engine.vllm.dtype": "float32", "engine.vllm.enforce_eager": current_platform.is_cpu()}


async def start_engine(config: Config) -> tuple[VLLMEngine, list[psutil.Process]]:
    """The engine, started, and the processes it started."""
    from rolloutd.engines.tiny_model import ensure_tiny_model
    from rolloutd.engines.vllm import VLLMEngine

    me = psutil.Process()
    before = {p.pid for p in me.children(recursive=True)}
    tiny = ensure_tiny_model(ROOT / config.engine.cache_dir)
    engine = VLLMEngine(
        config.engine_factory().vllm,
        tiny,
        max_sequences=config.limits.in_flight_cap * config.group_size,
    )
    await engine.start()
    procs = [
        p
        for p in me.children(recursive=True)
        if p.pid not in before and "rolloutd.engines.reaper" not in p.cmdline()
    ]
    return engine, procs


async def run(plan: Plan, load: Load, quick: bool) -> dict[str, Any]:
    started = time.time()
    runs: list[dict[str, Any]] = []
    with (
        OtlpSink() as sink,
        Scraper(load.scrape_interval_s) as scraper,
        tempfile.TemporaryDirectory(prefix="rolloutd-throughput-") as tmp,
    ):
        base = service_config(load, Variant.SERVICE, Path(tmp), engine_overrides())
        common.progress("starting vLLM on the tiny model (float32)")
        t = time.monotonic()
        engine, procs = await start_engine(base)
        engine_start_s = time.monotonic() - t
        common.progress(f"engine started in {engine_start_s:.1f} s ({len(procs)} processes)")
        bench = Bench(
            load=load,
            engine=engine,
            engine_procs=procs,
            shared=SharedEngine(engine, keep=load.max_in_flight * load.group_size),
            base=base,
            prompts=load_prompts(base.dataset.path)[0],
            sink=sink,
            scraper=scraper,
        )
        engine_requests: list[GenerationRequest] = []
        try:
            warm = replace(plan, warmup_s=0.0, window_s=plan.engine_warmup_s)
            r = await run_engine(bench, warm)
            common.progress(f"engine warm-up: {r['tokens_per_s']:,.0f} tokens/s (not counted)")
            for i in range(plan.rounds):
                for variant in schedule(i):
                    workdir = Path(tmp) / f"round-{i}-{variant.name.lower()}"
                    workdir.mkdir()
                    if variant is Variant.ENGINE:
                        r = await run_engine(bench, plan)
                        engine_requests = r.pop("requests")
                    else:
                        r = await run_service(bench, variant, plan, workdir)
                    r = {"round": i + 1, "variant": variant.value, **r}
                    runs.append(r)
                    common.progress(describe(r))
        finally:
            await engine.stop()
    if work_of(engine_requests) != work_of(bench.shared.first_requests):
        common.fail("the engine variant did not ask for the same work as the service")
    return assemble(runs, load, plan, quick, started, engine_start_s)


def describe(r: dict[str, Any]) -> str:
    cpu = r["cpu_share"]
    text = (
        f"round {r['round']} {r['variant']:<20} {r['tokens_per_s']:7,.0f} tokens/s over "
        f"{r['waves']:.0f} waves ({r['measured_s']:.1f} s; fixed window "
        f"{r['fixed_window_tokens_per_s']:,.0f}); CPU: this process {cpu['this_process']:.0%}, "
        f"engine {cpu['engine_processes']:.0%}"
    )
    if r["variant"] != Variant.ENGINE.value:
        text += (
            f", trainer {cpu['trainer']:.0%}; backlog <= {r['max_backlog_groups']} groups, "
            f"{r['checkpoints']} checkpoints, {r['spans_exported']} spans, "
            f"{r['metric_points_exported']} metric points, {r['scrapes']} scrapes"
        )
    return text


def assemble(
    runs: list[dict[str, Any]],
    load: Load,
    plan: Plan,
    quick: bool,
    started: float,
    engine_start_s: float,
) -> dict[str, Any]:
    by_round: dict[int, dict[str, float]] = {}
    for r in runs:
        by_round.setdefault(r["round"], {})[r["variant"]] = r["tokens_per_s"]
    tokens_per_s = {
        v.value: common.median([r["tokens_per_s"] for r in runs if r["variant"] == v.value])
        for v in Variant
    }

    def medians(key: str) -> dict[str, dict[str, float]]:
        return {
            v.value: {
                k: common.median([r[key][k] for r in runs if r["variant"] == v.value])
                for k in runs[0][key]
            }
            for v in Variant
        }

    ratios, per_round = {}, {}
    for name, (num, den, _) in RATIOS.items():
        per_round[name] = [t[num.value] / t[den.value] for t in by_round.values()]
        ratios[name] = common.median(per_round[name])
    service_runs = [r for r in runs if r["variant"] != Variant.ENGINE.value]
    headline = [
        common.headline(
            f"{name} (committed tokens/s)", ratios[name], "", f">= {target}",
            ratios[name] >= target,
            f"{common.noise_note(per_round[name])}; {num.value} {tokens_per_s[num.value]:,.0f}, "
            f"{den.value} {tokens_per_s[den.value]:,.0f} tokens/s",
        )
        for name, (num, den, target) in RATIOS.items()
    ] + [
        common.headline(
            "service committed tokens/s", tokens_per_s[Variant.SERVICE.value], "tokens/s", "",
            None,
            f"{load.max_in_flight} groups x {load.group_size} siblings, {load.max_tokens} tokens "
            "max, tiny model on CPU",
        )
    ]  # fmt: skip
    return {
        "benchmark": NAME,
        "quick": quick,
        "quick_changes": QUICK_CHANGES if quick else "",
        "conditions": common.conditions(
            started,
            engine_start_s=engine_start_s,
            peak_rss_gib=common.peak_rss_gib(),
            vllm_cpu_kvcache_space_gib=os.environ.get("VLLM_CPU_KVCACHE_SPACE"),
            engine=engine_overrides(),
        ),
        "load": asdict(load),
        "plan": asdict(plan),
        "concurrency": {
            "groups": load.max_in_flight,
            "siblings_per_group": load.group_size,
            "engine_requests": load.max_in_flight * load.group_size,
        },
        "window_s": plan.window_s,
        "measured_s_median": common.median([r["measured_s"] for r in runs]),
        **ratios,
        "ratio_statistic": "median over rounds of the ratio of the two variants' tokens/s "
        "measured in the same round",
        "per_round_ratios": per_round,
        **{f"{name}_noise": common.noise(v) for name, v in per_round.items()},
        "tokens_per_s": tokens_per_s,
        "cpu_share": medians("cpu_share"),
        "cpu_s_per_mtok": medians("cpu_s_per_mtok"),
        "trainer_max_backlog_groups": max(r["max_backlog_groups"] for r in service_runs),
        "same_work": "the engine variant's first wave of requests equals the service's "
        "(prompts, sibling indices, seeds, sampling parameters)",
        "runs": runs,
        "headline": headline,
    }


# --- results --------------------------------------------------------------------------------


def markdown(result: dict[str, Any]) -> str:
    load, c = result["load"], result["conditions"]
    variants = [v.value for v in Variant]
    out = [
        "# Throughput benchmark\n",
        f"{'Quick run. ' + result['quick_changes'] + '.' if result['quick'] else 'Full run.'} "
        f"vLLM on the tiny model (float32, CPU), {load['max_in_flight']} groups of "
        f"{load['group_size']} siblings in flight ({result['concurrency']['engine_requests']} "
        f"engine requests), up to {load['max_tokens']} tokens each, temperature "
        f"{load['temperature']:g}; the bundled prompts. Commit {c['commit']}"
        + (f" with uncommitted {', '.join(c['uncommitted'])}" if c["uncommitted"] else "")
        + f"; {c['cpus']} CPUs shared with other work, load average "
        f"{c['load_avg_1m_5m_15m'][0]:.1f} at the end; engine start {c['engine_start_s']:.0f} s, "
        f"{c['duration_s']:.0f} s in all; {c['started_at']}.\n",
        common.headline_table(result["headline"]),
        "\n## Per variant (medians over rounds)\n",
        "Committed tokens/s between wave ends (a whole number of waves, at least "
        f"{result['window_s']:g} s) and the fixed-window delta beside it; CPU of this process "
        "(the service and vLLM's frontend), of the engine's processes and of the trainer, per "
        "second of the measured span (1.0 = one core) and in CPU-seconds per million committed "
        "tokens.\n",
        common.markdown_table(
            ["variant", "tokens/s", "fixed window tokens/s", "this process CPU",
             "engine CPU", "trainer CPU", "this process CPU-s/Mtok", "trainer CPU-s/Mtok"],
            [
                (
                    v,
                    result["tokens_per_s"][v],
                    common.median([r["fixed_window_tokens_per_s"] for r in result["runs"]
                                   if r["variant"] == v]),
                    f"{result['cpu_share'][v]['this_process']:.3f}",
                    f"{result['cpu_share'][v]['engine_processes']:.2f}",
                    f"{result['cpu_share'][v]['trainer']:.3f}",
                    result["cpu_s_per_mtok"][v]["this_process"],
                    result["cpu_s_per_mtok"][v]["trainer"],
                )
                for v in variants
            ],
        ),
        "\n## Every run\n",
        common.markdown_table(
            ["round", "variant", "tokens/s", "waves", "measured s", "fixed window tokens/s",
             "max trainer backlog (groups)", "checkpoints", "spans", "metric points"],
            [
                (r["round"], r["variant"], r["tokens_per_s"], r["waves"], r["measured_s"],
                 r["fixed_window_tokens_per_s"], r.get("max_backlog_groups"),
                 r.get("checkpoints"), r.get("spans_exported"), r.get("metric_points_exported"))
                for r in result["runs"]
            ],
        ),
    ]  # fmt: skip
    return "\n".join(out)


def plot(result: dict[str, Any], path: Path) -> None:
    plt = common.pyplot()
    variants = [v.value for v in Variant]
    runs = result["runs"]
    fig, (ax1, ax2, ax3) = plt.subplots(1, 3, figsize=(17, 5))

    for i, v in enumerate(variants):
        mine = [r for r in runs if r["variant"] == v]
        ax1.plot(
            [r["round"] for r in mine],
            [r["tokens_per_s"] for r in mine],
            "o-",
            color=f"C{i}",
            label=f"{v} (median {result['tokens_per_s'][v]:,.0f})",
        )
    ax1.set(xlabel="round", ylabel="committed tokens/s", ylim=(0, None))
    ax1.set_title("Each run, by round")
    ax1.legend(fontsize=8, loc="lower left")

    names = list(RATIOS)
    for i, name in enumerate(names):
        values = result["per_round_ratios"][name]
        ax2.plot([i] * len(values), values, "o", color=f"C{i + 1}", alpha=0.6)
        ax2.plot([i - 0.3, i + 0.3], [result[name]] * 2, "-", color=f"C{i + 1}", linewidth=3)
        ax2.plot([i - 0.4, i + 0.4], [RATIOS[name][2]] * 2, "r--")
    ax2.axhline(1.0, color="grey", linewidth=0.8)
    ax2.set_xticks(range(len(names)), names, rotation=10)
    ax2.set(ylabel="ratio")
    ax2.set_title("Ratios: each round (dots), median (bar), target (red)")

    for key, offset, label in (("this_process", -0.2, "this process"), ("trainer", 0.2, "trainer")):
        ax3.bar(
            [i + offset for i in range(len(variants))],
            [result["cpu_s_per_mtok"][v][key] for v in variants],
            width=0.4,
            label=label,
        )
    ax3.set_xticks(range(len(variants)), variants, rotation=10)
    ax3.set(ylabel="CPU-seconds per million committed tokens (median)")
    ax3.set_title("CPU outside the engine's processes")
    ax3.legend(fontsize=8)

    fig.suptitle(
        "rolloutd throughput on vLLM, tiny model, CPU" + (" (quick)" if result["quick"] else "")
    )
    common.save_figure(fig, path)


def main() -> None:
    args = common.parse_args(__doc__.splitlines()[0])
    plan, load = (QUICK if args.quick else FULL), Load()
    # 64 requests of ~100 tokens need little KV cache; vLLM's own CPU default is 4 GiB.
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    if args.quick:
        common.progress(QUICK_CHANGES)
    common.progress(
        f"load: {load.max_in_flight} groups x {load.group_size} siblings, up to "
        f"{load.max_tokens} tokens, trainer fetching {load.trainer_groups_per_step} groups a step"
    )
    result = asyncio.run(run(plan, load, args.quick))
    common.publish(result, args.json, NAME, markdown(result), plot)


if __name__ == "__main__":
    main()
