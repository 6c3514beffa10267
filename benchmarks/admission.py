"""Admission: concurrency that follows the engine's KV cache, and staleness gating, on vLLM.

One ``VLLMEngine`` serves the tiny model (float32; eager on CPU, as ``throughput.py`` runs it)
in this process for the whole run, with a KV cache of :attr:`Plan.kv_blocks` blocks of 32
tokens (``engine.vllm.block_size``): small enough that 64 groups of 4 siblings in flight overflow
it. A sequence takes more blocks as it grows, so vLLM admits as many sequences as have blocks
for their prompt and preempts (frees a running sequence's cache, to compute it again later)
when they grow and none is free. Every
run is a real ``RolloutService`` (gRPC and all) on that engine, through ``throughput``'s
``SharedEngine``, with a trainer in this process calling it over gRPC.

1. **Concurrency.** Each round runs every variant once, in an order rotated from round to round:
   ``limits.max_in_flight`` 8, 16, 32 and 64 (static), and ``auto`` (ceiling 64). The prompts are
   the bundled set, each with its own ``generation.max_tokens`` drawn from :attr:`Plan.lengths`
   (8-96): the tiny model never stops early, and real samples end at different lengths
   (``--lockstep``: every sample runs to ``max_tokens``, so the groups in flight start and finish
   in waves, the hardest case for a limit that avoids preemption). The trainer
   fetches and acks as fast as groups come and never changes the weights (staleness gating has
   nothing to hold back). A run warms up for ``warm_up_turnovers`` turnovers of the groups in
   flight (``auto``, which starts at 8 groups and may change once per turnover: one more, at a
   limit that did not change), then measures generated tokens/s (the engine's own counter; committed
   tokens/s beside it move in steps of a group) over a window of ``window_tokens`` generated
   tokens. Warm-up and window are work, not seconds, so a loaded machine measures as many engine
   steps as an idle one, only slower. Preemptions are the engine's own count
   (``IterationStats.num_preempted_reqs``, through ``EngineCounters.preemptions``) from the
   service's start to the end of its window, the warm-up included.

   - ``preemptions_static_64`` and ``preemptions_auto``: medians over rounds;
     ``preemption_reduction``: 1 - auto / static 64, per round, median (target >= 0.9);
   - ``static_sweep_tokens_per_s``: each static limit's median; ``auto_vs_best_static``: auto's
     tokens/s over the best static limit's (by median) in the same round, median (target >= 0.9).

2. **Staleness.** A trainer slower than generation: each step it fetches ``batch`` groups, trains
   for ``train_s`` and publishes new weights (``UpdateWeights`` with the tiny model's own files,
   a real load); ``limits.max_staleness`` 1, ``limits.max_in_flight`` = ``batch`` (the pace the
   gate assumes before it has seen one: no surplus to evict at the start), shorter samples
   (``staleness_max_tokens``). After ``steps`` steps admission stops and the trainer goes on
   until nothing is left, so every generated token has its final fate. Gated
   (``limits.staleness_gating: true``, the default) and ungated, each round:

   - ``evicted_groups_gated`` (target 0) and ``evicted_groups_ungated`` (today's behaviour);
   - ``max_version_lag_delivered``: the most policy versions between the trainer's weights at a
     fetch and the weights a delivered group was admitted under, over every gated run (target
     <= ``max_staleness``);
   - ``goodput_gated``: tokens of the delivered groups over every token the engine generated in
     the run (its own counter), median over rounds (target >= 0.95);
   - ``buckets_sum_vs_generated``: the service's token fates (``rolloutd.tokens{fate}``, from
     its token account: delivered, evicted, dropped, regenerated, failed and buffered, nothing
     buffered after the drain) over the engine's generated tokens: how far the service's own
     accounting is from the engine's (target 1). The run also checks that the delivered fate
     holds exactly the tokens the trainer received.

``--quick``: 3 rounds of 16,000-token windows after one turnover, 8 trainer steps (full: 4 rounds
of 48,000 tokens after two turnovers; 2 staleness rounds of 20 steps).

Usage: ``python benchmarks/admission.py [--quick] [--lockstep] [--json FILE]``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import common
import grpc
from throughput import SharedEngine, engine_overrides

from rolloutd.config import Config, load_config
from rolloutd.dataset import load_prompts
from rolloutd.domain.engine import GenerationRequest, SamplingParams
from rolloutd.domain.fate import TokenFate
from rolloutd.domain.group import Prompt
from rolloutd.engines.tiny_model import ensure_tiny_model
from rolloutd.engines.vllm_kv_cache import GIB, kv_bytes_per_token, read_model_config
from rolloutd.server import RolloutService
from rolloutd.telemetry.providers import setup_telemetry
from rolloutd.v1 import rollout_pb2 as pb
from rolloutd.v1 import rollout_pb2_grpc as pb_grpc

if TYPE_CHECKING:
    from rolloutd.engines.vllm import VLLMEngine

NAME = "admission"
ROOT = Path(__file__).resolve().parent.parent
STATIC = (8, 16, 32, 64)
AUTO = "auto"


@dataclass(frozen=True)
class Plan:
    rounds: int = 4
    warm_up_turnovers: int = 2
    """Turnovers of the groups in flight before measuring (with ``auto``, at a settled limit)."""
    window_tokens: int = 48_000
    """Generated tokens a measured window lasts: work, not seconds, so that a window holds as
    many of the engine's steps on a loaded machine as on an idle one."""
    max_window_s: float = 300.0
    steps: int = 20
    """Trainer steps of a staleness run before admission stops."""
    staleness_rounds: int = 2
    group_size: int = 4
    max_tokens: int = 48
    """Tokens a sample runs to in the staleness part, and in the concurrency part when
    ``lengths`` is None."""
    lengths: tuple[int, int] | None = (8, 96)
    """Concurrency part: each prompt's own ``generation.max_tokens``, drawn uniformly from this
    range (seeded). The tiny model never stops early, so without it every sample runs to
    ``max_tokens`` and the groups in flight start and finish in lockstep waves: KV-cache usage
    swings from a wave's start to its end, and no limit that never preempts can use the cache
    between peaks. Real samples stop at their own length."""
    max_model_len: int = 256
    block_size: int = 32
    """Tokens per KV-cache block (``engine.vllm.block_size``; vLLM's CPU default is 128, which a
    short sample never outgrows)."""
    kv_blocks: int = 320
    """KV-cache size in blocks: a sibling of a ~35-token prompt takes 2 blocks when it starts and
    up to 5 at 96 new tokens, so 16 groups of 4 keep about half of it busy and 32 overflow it as
    they grow."""
    ceiling: int = 64
    staleness_max_tokens: int = 16
    batch: int = 4
    """Groups the trainer takes per step in the staleness part (and its limits.max_in_flight)."""
    train_s: float = 2.0
    """The trainer's step time besides fetching: slower than the engine generates a batch."""
    max_staleness: int = 1
    poll_s: float = 0.05


FULL = Plan()
QUICK = Plan(rounds=3, warm_up_turnovers=1, window_tokens=16_000, steps=8, staleness_rounds=1)
QUICK_CHANGES = (
    "quick: 3 rounds of 16,000-token windows after 1 turnover, 1 staleness round of 8 steps "
    "(full: 4 rounds of 48,000 tokens after 2 turnovers; 2 staleness rounds of 20 steps)"
)


# --- the service and its trainer ------------------------------------------------------------


def config(
    plan: Plan,
    workdir: Path,
    max_tokens: int | None = None,
    dataset: Path | None = None,
    **limits: Any,
) -> Config:
    """The service's configuration: ``limits`` are ``limits.*`` keys."""
    return load_config(
        overrides={
            **engine_overrides(),
            "dataset.path": str(dataset) if dataset else None,
            "engine.vllm.max_model_len": plan.max_model_len,
            "engine.vllm.block_size": plan.block_size,
            "engine.max_tokens": max_tokens or plan.max_tokens,
            "engine.temperature": 1.0,
            "group_size": plan.group_size,
            "grpc.host": "127.0.0.1",
            "grpc.port": 0,
            "grpc.grace_s": 1.0,
            "http.enabled": False,
            "checkpoint.dir": str(workdir / "checkpoints"),
            "checkpoint.interval_s": 0,
            "restore": "none",
            **{f"limits.{k}": v for k, v in limits.items()},
        },
        environ={},
    )


@dataclass
class Served:
    service: RolloutService
    channel: grpc.aio.Channel
    stub: pb_grpc.RolloutServiceStub


@contextlib.asynccontextmanager
async def served(cfg: Config, engine: SharedEngine):  # type: ignore[no-untyped-def]
    service = RolloutService(cfg, engine=engine, telemetry=setup_telemetry(disabled=True))
    addresses = await service.start()
    channel = grpc.aio.insecure_channel(addresses.grpc)
    try:
        yield Served(service, channel, pb_grpc.RolloutServiceStub(channel))
    finally:
        await channel.close()
        await service.shutdown(final_checkpoint=False)


async def greedy_trainer(stub: pb_grpc.RolloutServiceStub) -> None:
    """Fetches and acks as fast as groups come, forever (cancelled when the run ends)."""
    step = 0
    while True:
        r = await stub.FetchGroups(pb.FetchGroupsRequest(max_groups=16, wait_ms=500, consumer="t"))
        if r.lease_id:
            step += 1
            await stub.AckGroups(pb.AckGroupsRequest(lease_id=r.lease_id, trainer_step=step))


# --- part 1: concurrency ----------------------------------------------------------------------


@dataclass
class Sampled:
    """The engine's and the controller's state read every ``poll_s`` during a run."""

    usage: list[float] = field(default_factory=list)
    limit: list[tuple[float, int, str]] = field(default_factory=list)
    in_flight: list[int] = field(default_factory=list)


async def sample(served_: Served, engine: SharedEngine, into: Sampled, poll_s: float) -> None:
    started = time.monotonic()
    controller = served_.service.controller
    while True:
        into.usage.append(engine.counters().kv_cache_usage)
        a = controller.admission_status()
        into.limit.append((time.monotonic() - started, a.in_flight_limit, a.in_flight_reason.value))
        into.in_flight.append(controller.rooms.flight.groups)
        await asyncio.sleep(poll_s)


async def idle(engine: SharedEngine, timeout_s: float = 120.0) -> None:
    """Until the engine holds no request: the previous run's aborted requests must not count
    against the next one (their KV cache, their preemptions). vLLM reports its scheduler's state
    after each step, and an abort takes none, so a one-token probe makes it report afresh."""
    deadline = time.monotonic() + timeout_s
    probe = 0
    while True:
        probe += 1
        await engine.generate(probe_request(f"idle-{time.monotonic_ns()}-{probe}", max_tokens=1))
        c = engine.counters()
        if not (c.requests_running or c.requests_waiting):
            return
        if time.monotonic() > deadline:
            common.fail(f"the engine did not become idle in {timeout_s:.0f} s: {c}")
        await asyncio.sleep(0.1)


def probe_request(request_id: str, max_tokens: int) -> GenerationRequest:
    params = SamplingParams(max_tokens=max_tokens)
    return GenerationRequest(request_id, -1, 0, Prompt(request_id, "warm up"), 0, params)


async def until(condition: Callable[[], bool], timeout_s: float, every_s: float = 0.02) -> bool:
    """Waits for ``condition``; False if ``timeout_s`` passed first."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(every_s)
    return True


async def warm_up_run(s: Served, plan: Plan, adaptive: bool) -> float:
    """Until the groups in flight have turned over ``warm_up_turnovers`` times at the limit;
    with ``auto``, until the limit has not changed for one turnover more than that, counted in
    the groups in flight when it last changed (after a back-off, those that overflowed: the
    controller's next decision comes only after they left). Returns how long it took. Measured
    in groups, not seconds, so that a loaded machine warms up as far as an idle one."""
    started = time.monotonic()
    rooms = s.service.controller.rooms
    turnovers = plan.warm_up_turnovers + (1 if adaptive else 0)
    deadline = started + plan.max_window_s
    value, since, span = -1, 0, 1
    while time.monotonic() < deadline:
        if rooms.admitter.limit.value != value:
            value, since = rooms.admitter.limit.value, rooms.flight.departed
            span = max(value, rooms.flight.groups)
        elif rooms.flight.departed - since >= turnovers * span:
            break
        await asyncio.sleep(0.02)
    return time.monotonic() - started


async def run_concurrency(
    plan: Plan, engine: SharedEngine, variant: int | str, workdir: Path, dataset: Path | None
) -> dict[str, Any]:
    limits: dict[str, Any] = {"max_in_flight": variant, "buffer_capacity": 256}
    if variant == AUTO:
        limits["max_in_flight_ceiling"] = plan.ceiling
    cfg = config(plan, workdir, dataset=dataset, **limits)
    await idle(engine)
    preempted0 = engine.counters().preemptions
    sampled = Sampled()
    async with served(cfg, engine) as s:
        counters = s.service.controller.rooms.accounting.counters
        tasks = [
            asyncio.create_task(greedy_trainer(s.stub)),
            asyncio.create_task(sample(s, engine, sampled, plan.poll_s)),
        ]
        try:
            warmed = await warm_up_run(s, plan, variant == AUTO)
            e0, t0, tokens0 = engine.counters(), time.monotonic(), counters.committed_tokens
            await until(
                lambda: (
                    engine.counters().generation_tokens - e0.generation_tokens >= plan.window_tokens
                ),
                plan.max_window_s,
            )
            e1, t1, tokens1 = engine.counters(), time.monotonic(), counters.committed_tokens
            final = s.service.controller.admission_status()
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
    return {
        "variant": str(variant),
        "warm_up_s": warmed,
        "window_s": t1 - t0,
        "tokens_per_s": (e1.generation_tokens - e0.generation_tokens) / (t1 - t0),
        "committed_tokens_per_s": (tokens1 - tokens0) / (t1 - t0),
        "preemptions": e1.preemptions - preempted0,
        "preemptions_in_window": e1.preemptions - e0.preemptions,
        "kv_usage_max": max(sampled.usage),
        "kv_usage_mean": sum(sampled.usage) / len(sampled.usage),
        "in_flight_mean": sum(sampled.in_flight) / len(sampled.in_flight),
        "final_limit": final.in_flight_limit,
        "final_reason": final.in_flight_reason.value,
        "limit_trajectory": compress(sampled.limit) if variant == AUTO else [],
    }


def compress(points: Sequence[tuple[float, int, str]]) -> list[tuple[float, int, str]]:
    """The points where the limit or its reason changed."""
    out: list[tuple[float, int, str]] = []
    for p in points:
        if not out or out[-1][1:] != p[1:]:
            out.append((round(p[0], 2), p[1], p[2]))
    return out


def schedule(round_index: int) -> list[int | str]:
    order: list[int | str] = [*STATIC, AUTO]
    k = round_index % len(order)
    return order[k:] + order[:k]


def varied_lengths(plan: Plan, path: Path) -> Path | None:
    """The bundled prompts, each with its own ``generation.max_tokens`` from ``plan.lengths``
    (None: no lengths, the bundled set as it is)."""
    if plan.lengths is None:
        return None
    low, high = plan.lengths
    rng = random.Random(0)
    with path.open("w") as out:
        for p in load_prompts(None)[0]:
            row = {"id": p.prompt_id, "prompt": p.text}
            out.write(json.dumps({**row, "generation": {"max_tokens": rng.randint(low, high)}}))
            out.write("\n")
    return path


# --- part 2: staleness ------------------------------------------------------------------------


async def run_staleness(
    plan: Plan, engine: SharedEngine, gated: bool, weights: Path, workdir: Path
) -> dict[str, Any]:
    cfg = config(
        plan,
        workdir,
        plan.staleness_max_tokens,
        max_in_flight=plan.batch,
        max_staleness=plan.max_staleness,
        staleness_gating=gated,
        buffer_capacity=256,
    )
    await idle(engine)
    generated0 = engine.counters().generation_tokens
    version = engine.policy_version
    delivered_tokens = delivered_groups = 0
    lags: list[int] = []
    async with served(cfg, engine) as s:
        controller = s.service.controller

        def settled() -> bool:
            """Admission stopped and nothing is left to deliver."""
            b = controller.rooms.buffer.counts()
            return not (b.generating or b.finishing or b.committed)

        step = 0
        while True:
            draining = step >= plan.steps
            if draining and step == plan.steps:
                await controller.set_admitting(False)  # the run ends: deliver what is left
            if draining and settled():
                break
            taken = 0
            while taken < plan.batch and not (draining and settled()):
                r = await s.stub.FetchGroups(
                    pb.FetchGroupsRequest(max_groups=plan.batch - taken, wait_ms=500, consumer="t")
                )
                if not r.lease_id:
                    continue
                for g in r.groups:
                    lags.append(version - g.policy_version)
                    delivered_tokens += sum(len(x.token_ids) for x in g.samples)
                taken += len(r.groups)
                delivered_groups += len(r.groups)
                await s.stub.AckGroups(pb.AckGroupsRequest(lease_id=r.lease_id, trainer_step=step))
            await asyncio.sleep(plan.train_s)
            version += 1
            await s.stub.UpdateWeights(
                pb.UpdateWeightsRequest(version=version, weights_path=str(weights))
            )
            step += 1
        evicted_groups = controller.rooms.accounting.counters.evicted_groups
        fates = controller.token_account().fates
        in_flight = controller.rooms.flight.samples
    if fates[TokenFate.DELIVERED] != delivered_tokens:
        common.fail(
            f"the delivered fate holds {fates[TokenFate.DELIVERED]} tokens, the trainer "
            f"received {delivered_tokens}"
        )
    generated = engine.counters().generation_tokens - generated0
    counted = sum(fates.values())
    evicted_tokens = fates[TokenFate.EVICTED]
    dropped_tokens = fates[TokenFate.DROPPED] + fates[TokenFate.FAILED]
    return {
        "gated": gated,
        "steps": step,
        "drain_steps": step - plan.steps,
        "delivered_groups": delivered_groups,
        "delivered_tokens": delivered_tokens,
        "evicted_groups": evicted_groups,
        "evicted_tokens": evicted_tokens,
        "dropped_tokens": dropped_tokens,
        "generated_tokens": generated,
        "in_flight_at_end": in_flight,
        "max_version_lag": max(lags) if lags else 0,
        "goodput": delivered_tokens / generated if generated else float("nan"),
        "buckets_sum_vs_generated": counted / generated if generated else float("nan"),
    }


# --- the run ----------------------------------------------------------------------------------


async def start_engine(plan: Plan, base: Config) -> tuple[VLLMEngine, Path, dict[str, Any]]:
    from rolloutd.engines.vllm import VLLMEngine

    tiny = ensure_tiny_model(ROOT / base.engine.cache_dir)
    per_token = kv_bytes_per_token(read_model_config(tiny), base.engine.vllm.dtype)
    kv_bytes = plan.kv_blocks * plan.block_size * per_token
    settings = base.engine_factory().vllm

    engine = VLLMEngine(
        replace(settings, kv_cache_memory_gib=kv_bytes / GIB), tiny, max_sequences=256
    )
    await engine.start()
    return engine, tiny, {"kv_cache_bytes": kv_bytes, "kv_bytes_per_token": per_token}


async def warm_up(engine: SharedEngine) -> None:
    """A few short requests: the engine's first steps are slow and would count against whichever
    variant runs first."""
    await asyncio.gather(*(engine.generate(probe_request(f"warm-{i}", 8)) for i in range(8)))


async def run(plan: Plan, quick: bool) -> dict[str, Any]:
    started = time.time()
    concurrency: list[dict[str, Any]] = []
    staleness: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="rolloutd-admission-") as tmp:
        base = config(plan, Path(tmp))
        dataset = varied_lengths(plan, Path(tmp) / "prompts.jsonl")
        common.progress(
            f"starting vLLM on the tiny model with a KV cache of {plan.kv_blocks} blocks "
            f"of {plan.block_size} tokens ({plan.kv_blocks * plan.block_size:,} tokens)"
        )
        t = time.monotonic()
        engine, tiny, kv = await start_engine(plan, base)
        engine_start_s = time.monotonic() - t
        common.progress(f"engine started in {engine_start_s:.1f} s")
        shared = SharedEngine(engine, keep=0)
        try:
            await warm_up(shared)
            common.progress("engine warmed up")
            for i in range(plan.rounds):
                for variant in schedule(i):
                    workdir = Path(tmp) / f"c{i}-{variant}"
                    r = {
                        "round": i + 1,
                        **await run_concurrency(plan, shared, variant, workdir, dataset),
                    }
                    concurrency.append(r)
                    common.progress(describe_concurrency(r))
            for i in range(plan.staleness_rounds):
                for gated in (True, False) if i % 2 == 0 else (False, True):
                    workdir = Path(tmp) / f"s{i}-{gated}"
                    r = {"round": i + 1, **await run_staleness(plan, shared, gated, tiny, workdir)}
                    staleness.append(r)
                    common.progress(describe_staleness(r))
        finally:
            await engine.stop()
    return assemble(plan, quick, started, engine_start_s, kv, concurrency, staleness)


def describe_concurrency(r: dict[str, Any]) -> str:
    text = (
        f"round {r['round']} max_in_flight {r['variant']:>4}: {r['tokens_per_s']:7,.0f} tokens/s "
        f"generated ({r['committed_tokens_per_s']:,.0f} committed), "
        f"{r['preemptions']:5} preemptions ({r['preemptions_in_window']} in the window), KV "
        f"usage max {r['kv_usage_max']:.2f} mean {r['kv_usage_mean']:.2f}, "
        f"{r['in_flight_mean']:.1f} groups in flight"
    )
    if r["variant"] == AUTO:
        text += f"; limit {r['final_limit']} ({r['final_reason']})"
    return text


def describe_staleness(r: dict[str, Any]) -> str:
    return (
        f"round {r['round']} {'gated' if r['gated'] else 'ungated'}: {r['steps']} steps "
        f"({r['drain_steps']} draining), {r['delivered_groups']} groups delivered, "
        f"{r['evicted_groups']} evicted; goodput {r['goodput']:.3f}, most lag "
        f"{r['max_version_lag']}, counted/generated {r['buckets_sum_vs_generated']:.4f}"
    )


def assemble(
    plan: Plan,
    quick: bool,
    started: float,
    engine_start_s: float,
    kv: dict[str, Any],
    concurrency: list[dict[str, Any]],
    staleness: list[dict[str, Any]],
) -> dict[str, Any]:
    def of(variant: int | str, key: str) -> list[float]:
        return [r[key] for r in concurrency if r["variant"] == str(variant)]

    sweep = {str(v): common.median(of(v, "tokens_per_s")) for v in STATIC}
    best = max(STATIC, key=lambda v: sweep[str(v)])
    rounds = sorted({r["round"] for r in concurrency})

    def in_round(i: int, variant: int | str) -> dict[str, Any]:
        return next(r for r in concurrency if r["round"] == i and r["variant"] == str(variant))

    reductions = [
        1 - in_round(i, AUTO)["preemptions"] / in_round(i, 64)["preemptions"]
        if in_round(i, 64)["preemptions"]
        else float("nan")
        for i in rounds
    ]
    vs_best = [
        in_round(i, AUTO)["tokens_per_s"] / in_round(i, best)["tokens_per_s"] for i in rounds
    ]
    gated = [r for r in staleness if r["gated"]]
    ungated = [r for r in staleness if not r["gated"]]
    goodput = [r["goodput"] for r in gated]
    buckets = [r["buckets_sum_vs_generated"] for r in staleness]
    figures = {
        "preemptions_static_64": common.median(of(64, "preemptions")),
        "preemptions_auto": common.median(of(AUTO, "preemptions")),
        "preemption_reduction": common.median(reductions),
        "static_sweep_tokens_per_s": sweep,
        "auto_tokens_per_s": common.median(of(AUTO, "tokens_per_s")),
        "best_static": best,
        "auto_vs_best_static": common.median(vs_best),
        "auto_final_limit": [int(x) for x in of(AUTO, "final_limit")],
        "evicted_groups_gated": sum(r["evicted_groups"] for r in gated),
        "evicted_groups_ungated": sum(r["evicted_groups"] for r in ungated),
        "max_version_lag_delivered": max(r["max_version_lag"] for r in gated),
        "max_version_lag_delivered_ungated": max(r["max_version_lag"] for r in ungated),
        "goodput_gated": common.median(goodput),
        "goodput_ungated": common.median([r["goodput"] for r in ungated]),
        "buckets_sum_vs_generated": common.median(buckets),
        "buckets_sum_vs_generated_note": "the sum of the service's token fates "
        "(rolloutd.tokens{fate}, after a drain that leaves nothing buffered) / the engine's "
        "generated tokens",
    }
    noise = {
        "preemption_reduction_noise": common.noise(reductions),
        "auto_vs_best_static_noise": common.noise(vs_best),
        "goodput_gated_noise": common.noise(goodput),
        "buckets_sum_vs_generated_noise": common.noise(buckets),
    }
    f = figures
    headline = [
        common.headline(
            "preemption_reduction (auto vs static 64)", f["preemption_reduction"], "", ">= 0.9",
            f["preemption_reduction"] >= 0.9,
            f"{common.noise_note(reductions)}; preemptions static 64 "
            f"{f['preemptions_static_64']:,.0f}, auto {f['preemptions_auto']:,.0f} (medians)",
        ),
        common.headline(
            "auto_vs_best_static (generated tokens/s)", f["auto_vs_best_static"], "", ">= 0.9",
            f["auto_vs_best_static"] >= 0.9,
            f"{common.noise_note(vs_best)}; auto {f['auto_tokens_per_s']:,.0f}, best static "
            f"({best}) {sweep[str(best)]:,.0f} tokens/s",
        ),
        common.headline(
            "evicted_groups_gated", f["evicted_groups_gated"], "groups", "0",
            f["evicted_groups_gated"] == 0,
            f"ungated (today's behaviour): {f['evicted_groups_ungated']} groups",
        ),
        common.headline(
            "max_version_lag_delivered (gated)", f["max_version_lag_delivered"], "versions",
            f"<= {plan.max_staleness}", f["max_version_lag_delivered"] <= plan.max_staleness,
            f"limits.max_staleness {plan.max_staleness}",
        ),
        common.headline(
            "goodput_gated (delivered / generated tokens)", f["goodput_gated"], "", ">= 0.95",
            f["goodput_gated"] >= 0.95,
            f"{common.noise_note(goodput)}; ungated {f['goodput_ungated']:.3f}",
        ),
        common.headline(
            "buckets_sum_vs_generated", f["buckets_sum_vs_generated"], "", "1",
            abs(f["buckets_sum_vs_generated"] - 1) < 1e-3,
            f"{common.noise_note(buckets)}; token fates / engine-generated",
        ),
    ]  # fmt: skip
    return {
        "benchmark": NAME,
        "quick": quick,
        "quick_changes": QUICK_CHANGES if quick else "",
        "conditions": common.conditions(
            started,
            engine_start_s=engine_start_s,
            engine=engine_overrides(),
            **kv,
            vllm_cpu_kvcache_space_gib=os.environ.get("VLLM_CPU_KVCACHE_SPACE"),
        ),
        "plan": asdict(plan),
        **figures,
        **noise,
        "concurrency_runs": concurrency,
        "staleness_runs": staleness,
        "headline": headline,
    }


# --- results ----------------------------------------------------------------------------------


def lengths_note(p: dict[str, Any]) -> str:
    low_high = p["lengths"]
    staleness = f"{p['staleness_max_tokens']} tokens a sample in the staleness part"
    if low_high is None:
        return f"every sample runs to {p['max_tokens']} tokens (lockstep waves); {staleness}"
    low, high = low_high
    return (
        f"each prompt's max_tokens drawn from {low}-{high} in the concurrency part (the tiny "
        f"model runs every sample to it), {staleness}"
    )


def markdown(result: dict[str, Any]) -> str:
    p, c = result["plan"], result["conditions"]
    sweep = result["static_sweep_tokens_per_s"]
    out = [
        "# Admission benchmark\n",
        f"{'Quick run. ' + result['quick_changes'] + '.' if result['quick'] else 'Full run.'} "
        f"vLLM on the tiny model (float32, CPU) with a KV cache of {p['kv_blocks']} blocks "
        f"of {p['block_size']} tokens ({c['kv_cache_bytes'] / 2**20:.0f} MiB); "
        f"groups of {p['group_size']}; {lengths_note(p)}. Commit "
        f"{c['commit']}"
        + (f" with uncommitted {', '.join(c['uncommitted'])}" if c["uncommitted"] else "")
        + f"; {c['cpus']} CPUs shared with other work, load average "
        f"{c['load_avg_1m_5m_15m'][0]:.1f} at the end; engine start {c['engine_start_s']:.0f} s, "
        f"{c['duration_s']:.0f} s in all; {c['started_at']}.\n",
        common.headline_table(result["headline"]),
        "\n## Concurrency (medians over rounds)\n",
        common.markdown_table(
            ["limits.max_in_flight", "generated tokens/s", "preemptions"],
            [
                *[(v, sweep[v], common.median([r["preemptions"] for r in
                   result["concurrency_runs"] if r["variant"] == v])) for v in sweep],
                (AUTO, result["auto_tokens_per_s"], result["preemptions_auto"]),
            ],
        ),
        f"\n`auto` ended at {result['auto_final_limit']} groups in flight.\n",
        "\n## Every concurrency run\n",
        common.markdown_table(
            ["round", "max_in_flight", "tokens/s", "preemptions", "in window", "KV max",
             "KV mean", "groups in flight", "final limit"],
            [(r["round"], r["variant"], r["tokens_per_s"], r["preemptions"],
              r["preemptions_in_window"], r["kv_usage_max"], r["kv_usage_mean"],
              r["in_flight_mean"], f"{r['final_limit']} ({r['final_reason']})")
             for r in result["concurrency_runs"]],
        ),
        "\n## Staleness\n",
        common.markdown_table(
            ["round", "gating", "steps (draining)", "delivered groups", "evicted groups",
             "most lag", "goodput", "counted / generated"],
            [(r["round"], "on" if r["gated"] else "off", f"{r['steps']} ({r['drain_steps']})",
              r["delivered_groups"], r["evicted_groups"], r["max_version_lag"], r["goodput"],
              r["buckets_sum_vs_generated"]) for r in result["staleness_runs"]],
        ),
    ]  # fmt: skip
    return "\n".join(out)


def plot(result: dict[str, Any], path: Path) -> None:
    plt = common.pyplot()
    fig, (ax1, ax2, ax3) = plt.subplots(1, 3, figsize=(17, 5))
    runs = result["concurrency_runs"]
    variants = [*map(str, STATIC), AUTO]
    for i, v in enumerate(variants):
        mine = [r for r in runs if r["variant"] == v]
        ax1.plot([i] * len(mine), [r["tokens_per_s"] for r in mine], "o", color=f"C{i}")
        ax2.plot([i] * len(mine), [r["preemptions"] for r in mine], "o", color=f"C{i}")
    ax1.set_xticks(range(len(variants)), variants)
    ax1.set(xlabel="limits.max_in_flight", ylabel="generated tokens/s", ylim=(0, None))
    ax1.set_title("Throughput, each round")
    ax2.set_xticks(range(len(variants)), variants)
    ax2.set(xlabel="limits.max_in_flight", ylabel="preemptions per run")
    ax2.set_title("Preemptions, each round")
    for r in runs:
        if r["variant"] == AUTO and r["limit_trajectory"]:
            ts = [p[0] for p in r["limit_trajectory"]]
            ax3.step(ts, [p[1] for p in r["limit_trajectory"]], where="post",
                     label=f"round {r['round']}")  # fmt: skip
    ax3.set(xlabel="seconds since the service started", ylabel="groups in flight allowed")
    ax3.set_title("auto: the limit over a run")
    ax3.legend(fontsize=8)
    fig.suptitle("rolloutd admission on vLLM, tiny model, small KV cache" + (
        " (quick)" if result["quick"] else ""))  # fmt: skip
    common.save_figure(fig, path)


def lockstep_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--lockstep",
        action="store_true",
        help="every sample of the concurrency part runs to max_tokens: groups start and finish "
        "in waves (the hardest case for a limit that avoids preemption)",
    )


def main() -> None:
    args = common.parse_args(__doc__.splitlines()[0], extra=lockstep_flag)
    plan = QUICK if args.quick else FULL
    if args.lockstep:
        plan = replace(plan, lengths=None)
    # the KV cache is sized by engine.vllm.kv_cache_memory_gib here; vLLM's variable would win
    os.environ.pop("VLLM_CPU_KVCACHE_SPACE", None)
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    if args.quick:
        common.progress(QUICK_CHANGES)
    result = asyncio.run(run(plan, args.quick))
    common.publish(result, args.json, NAME, markdown(result), plot)
    print(json.dumps({k: result[k] for k in ("preemption_reduction", "auto_vs_best_static")}))


if __name__ == "__main__":
    main()
