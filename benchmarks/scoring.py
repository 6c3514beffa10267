"""Scoring: dynamic sampling's drop rate across SIGKILLs, and what a verifier costs throughput.

Two parts, in one run:

1. **The filter** (the real ``rolloutd serve`` on the synthetic engine). Each prompt of a data
   set is admitted once (one epoch), as a group of 4, scored by ``_verifiers:first_token_even``
   (reward 1 when the first generated token id is even; the synthetic engine's token ids are
   uniform, so the pass rate is about one half) with ``filter.zero_variance`` on. A group has
   zero variance when its 4 rewards are equal: the expected dropped fraction is
   ``p^4 + (1 - p)^4`` = 2 x 0.5^4 = 12.5%. A trainer in this process fetches and acks (all at
   step 1, so every scored group stays in each snapshot) while ``GetStatus`` is polled every
   20 ms for the groups in flight (generating + finishing). Checkpoints run every 0.5 s; at
   evenly spaced points of the data set the service is SIGKILLed (its engine and scoring workers
   with it) and started again with ``--restore latest``. The verifier appends one line per call
   to a file, with its service's process id, so the calls each run of the service made are
   known by prompt:

   - ``dropped_fraction``: dropped / admitted groups (``GetStatus``'s durable counters at the
     end), against the 99% binomial interval around the expected fraction;
   - ``zero_variance_delivered``: delivered groups whose rewards are all equal (0);
   - ``scorer_calls_after_restore``: verifier calls a restarted service made for groups the
     snapshot it restored holds as scored (committed, leased or acked), or as ``finishing`` but
     the trainer acked before the kill (journal replay settles those): 0, since scores are in
     the snapshot. The other ``finishing`` groups must be scored again, and are counted;
   - ``oversample_peak_ratio``: the most groups in flight seen / ``limits.max_in_flight``, at
     most ``1 + filter.max_oversample_ratio``;
   - every prompt is delivered once or dropped once: none twice, none both, none missing.

2. **The cost** (``scoring_on_vs_off``, vLLM on the tiny model in this process). Committed
   tokens/s with a verifier that takes 1 ms (``_verifiers:sleep_1ms``, in the service's default
   2 scoring workers, no filter) against no verifier, measured as ``throughput.py`` measures the
   service: one engine shared by both variants, the example trainer fetching and acking in its
   own process, measured between wave ends after a warm-up. Each round runs both variants, the
   order swapped from round to round; the figure is the median over rounds of each round's
   ratio.

``--quick``: 256 prompts and 2 kills; 4 rounds of 3 s windows (full: 1,024 prompts and 3 kills;
8 rounds of 12 s windows).

Usage: ``python benchmarks/scoring.py [--quick] [--json FILE]``.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import re
import tempfile
import threading
import time
from collections import Counter, defaultdict
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import common
import grpc
from _verifiers import CALLS_ENV
from throughput import (
    CpuClock,
    Load,
    Meter,
    SharedEngine,
    Tick,
    TrainerProcess,
    Variant,
    engine_overrides,
    measure,
    service_config,
    start_engine,
)

from rolloutd.checkpoint.store import SnapshotStore
from rolloutd.server import RolloutService
from rolloutd.telemetry.providers import setup_telemetry
from rolloutd.v1 import rollout_pb2 as pb
from rolloutd.v1 import rollout_pb2_grpc as pb_grpc

NAME = "scoring"
HERE = Path(__file__).resolve().parent
RESTORED = re.compile(r"restored snapshot (\d+) ")
SCORED_STATES = {"committed", "leased", "acked"}
"""States of a group whose scores its snapshot holds."""
RATIO_TARGET = 0.97
INTERVAL_LEVEL = 0.99


@dataclass(frozen=True)
class Plan:
    prompts: int = 1024
    """Groups admitted by the filter part: the data set, one epoch."""
    kills: int = 3
    """SIGKILL / ``--restore latest`` cycles in the filter part."""
    rounds: int = 8
    """Rounds of the throughput part; each runs both variants."""
    warmup_s: float = 3.0
    window_s: float = 12.0
    engine_warmup_s: float = 5.0


FULL = Plan()
QUICK = Plan(prompts=256, kills=2, rounds=4, warmup_s=1.0, window_s=3.0, engine_warmup_s=2.0)
QUICK_CHANGES = (
    "quick: 256 prompts and 2 kills, 4 rounds of 3 s windows after 1 s of warm-up "
    "(full: 1,024 prompts and 3 kills, 8 rounds of 12 s after 3 s)"
)


@dataclass(frozen=True)
class FilterLoad:
    """The filter part's service: synthetic engine, groups of 4, one epoch."""

    group_size: int = 4
    pass_rate: float = 0.5
    """The verifier's nominal pass rate; the measured one is reported beside it."""
    max_in_flight: int = 8
    max_oversample_ratio: float = 0.5
    max_tokens: int = 32
    tokens_per_s: float = 100.0
    """One synthetic request's speed: 8-32 tokens take 0.08-0.32 s, so groups are in flight
    long enough to fill the over-sampling headroom and to be caught by a kill."""
    checkpoint_interval_s: float = 0.5
    lease_timeout_s: float = 5.0
    poll_interval_s: float = 0.02
    """How often ``GetStatus`` is read for the groups in flight."""

    @property
    def expected_dropped_fraction(self) -> float:
        p, g = self.pass_rate, self.group_size
        return p**g + (1 - p) ** g


# --- statistics -------------------------------------------------------------------------------


def binomial_interval(n: int, p: float, level: float) -> tuple[int, int]:
    """The central ``level`` interval of Binomial(n, p) as counts [lo, hi]: at most
    ``(1 - level) / 2`` of the probability lies below ``lo`` and as much above ``hi``."""
    log_pmf = [
        math.lgamma(n + 1) - math.lgamma(k + 1) - math.lgamma(n - k + 1)
        + k * math.log(p) + (n - k) * math.log1p(-p)
        for k in range(n + 1)
    ]  # fmt: skip
    pmf = [math.exp(v) for v in log_pmf]
    tail = (1 - level) / 2

    def first_past(order: range) -> int:
        total = 0.0
        for k in order:
            total += pmf[k]
            if total > tail:
                return k
        raise AssertionError("the probabilities sum to less than the tail")

    return first_past(range(n + 1)), first_past(range(n, -1, -1))


# --- part 1: the filter across SIGKILLs -------------------------------------------------------


def write_prompts(path: Path, n: int) -> None:
    path.write_text(
        "".join(json.dumps({"id": f"p{i}", "prompt": f"Problem {i}: {i} + {7 * i} = ?"}) + "\n"
                for i in range(n))
    )  # fmt: skip


class Service(common.Serve):
    """``rolloutd serve`` on the synthetic engine with the filter on."""

    def __init__(self, work: Path, life: int, load: FilterLoad, restore: str) -> None:
        path = os.pathsep.join(p for p in (str(HERE), os.environ.get("PYTHONPATH")) if p)
        env = {
            "PYTHONPATH": path,
            "OTEL_SDK_DISABLED": "true",
            CALLS_ENV: str(work / "calls.txt"),
            "ROLLOUTD_SCORING__VERIFIER": "_verifiers:first_token_even",
            "ROLLOUTD_FILTER__ZERO_VARIANCE": "true",
            "ROLLOUTD_FILTER__MAX_OVERSAMPLE_RATIO": str(load.max_oversample_ratio),
            "ROLLOUTD_LIMITS__MAX_IN_FLIGHT": str(load.max_in_flight),
            "ROLLOUTD_LIMITS__LEASE_TIMEOUT_S": str(load.lease_timeout_s),
            "ROLLOUTD_ENGINE__SYNTHETIC__TOKENS_PER_S": str(load.tokens_per_s),
            # every snapshot is kept, so the one a restart restored can still be read after it
            "ROLLOUTD_CHECKPOINT__KEEP_LATEST": "100000",
        }
        args = [
            "--engine", "synthetic", "--dataset", str(work / "prompts.jsonl"), "--epochs", "1",
            "--group-size", str(load.group_size), "--max-tokens", str(load.max_tokens),
            "--grpc-port", "0", "--http-port", "0", "--checkpoint-dir", str(work / "store"),
            "--checkpoint-interval", str(load.checkpoint_interval_s), "--restore", restore,
        ]  # fmt: skip
        super().__init__(args, env, work, work / f"serve-{life}.log")

    def restored_sequence(self) -> int | None:
        m = RESTORED.search(self.log_path.read_text())
        return int(m[1]) if m else None


class InFlightPoller:
    """Reads ``GetStatus`` every ``interval_s`` on a thread: (time, generating, finishing)."""

    def __init__(self, address: str, interval_s: float) -> None:
        self.samples: list[tuple[float, int, int]] = []
        self._channel = grpc.insecure_channel(address)
        self._stub = pb_grpc.RolloutServiceStub(self._channel)
        self._interval = interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            buffer = self._stub.GetStatus(pb.GetStatusRequest(), timeout=10).buffer
            self.samples.append((time.time(), buffer.generating, buffer.finishing))

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
        self._channel.close()


@dataclass
class Delivered:
    """One group the trainer acked."""

    prompt_id: str
    rewards: list[float]
    first_tokens: list[int]
    reward_std: float
    life: int


@dataclass
class Life:
    """One run of the service, from its start to its SIGKILL (or its graceful stop)."""

    index: int
    pid: int
    restored_sequence: int | None
    restored_scored: set[str]
    """Prompts of groups the restored snapshot holds as scored."""
    restored_finishing: set[str]
    """Prompts of groups the restored snapshot holds as finishing (to be scored again)."""
    killed_at_position: int | None = None


def snapshot_groups(store: Path, sequence: int) -> list[dict[str, Any]]:
    snapshot = SnapshotStore(str(store)).resolve(sequence).snapshot
    assert snapshot is not None
    return [json.loads(g) for g in snapshot.group_json()]


def holds_scored_group(store: Path) -> bool:
    snapshot = SnapshotStore(str(store)).resolve("latest").snapshot
    if snapshot is None:
        return False
    return any(json.loads(g)["state"] in SCORED_STATES for g in snapshot.group_json())


def start_life(work: Path, life: int, load: FilterLoad) -> tuple[Service, Life]:
    service = Service(work, life, load, restore="none" if life == 0 else "latest")
    service.wait_listening(120.0, poll_s=0.1)
    sequence = service.restored_sequence()
    scored: set[str] = set()
    finishing: set[str] = set()
    if sequence is not None:
        for g in snapshot_groups(work / "store", sequence):
            if g["state"] in SCORED_STATES:
                scored.add(g["prompt"]["id"])
            elif g["state"] == "finishing":
                finishing.add(g["prompt"]["id"])
    return service, Life(life, service.proc.pid, sequence, scored, finishing)


@dataclass
class Trace:
    """What the filter part saw, over every run of the service."""

    delivered: list[Delivered] = field(default_factory=list)
    lives: list[Life] = field(default_factory=list)
    in_flight: list[tuple[float, int, int]] = field(default_factory=list)
    """(wall time, generating, finishing) from every ``GetStatus`` poll."""
    kills: list[float] = field(default_factory=list)


def serve_until(
    stub: pb_grpc.RolloutServiceStub,
    life: Life,
    kill_at: int | None,
    plan: Plan,
    trace: Trace,
    store: Path,
    deadline: float,
) -> pb.GetStatusResponse | None:
    """Fetches and acks until the cursor reaches ``kill_at`` with a scored group in the latest
    snapshot (None: time to kill), or, with no ``kill_at``, until every group is settled (the
    final status)."""
    while time.monotonic() < deadline:
        r = stub.FetchGroups(pb.FetchGroupsRequest(max_groups=16, wait_ms=100), timeout=30)
        if r.groups:
            stub.AckGroups(pb.AckGroupsRequest(lease_id=r.lease_id, trainer_step=1), timeout=30)
            trace.delivered += [
                Delivered(
                    g.prompt_id,
                    [s.reward for s in g.samples],
                    [s.token_ids[0] if s.token_ids else -1 for s in g.samples],
                    g.reward_std,
                    life.index,
                )
                for g in r.groups
            ]
        status = stub.GetStatus(pb.GetStatusRequest(), timeout=30)
        position = status.cursor_epoch * plan.prompts + status.cursor_offset
        if kill_at is not None:
            if position >= kill_at and holds_scored_group(store):
                life.killed_at_position = position
                return None
            continue
        b = status.buffer
        if status.dataset_exhausted and not (
            b.generating or b.finishing or b.committed or b.leased
        ):
            return status
    common.fail("the filter run did not finish within 600 s")
    raise AssertionError("unreachable")


def filter_run(work: Path, plan: Plan, load: FilterLoad) -> dict[str, Any]:
    write_prompts(work / "prompts.jsonl", plan.prompts)
    kill_at = [plan.prompts * (k + 1) // (plan.kills + 1) for k in range(plan.kills)]
    trace = Trace()
    started = time.time()
    deadline = time.monotonic() + 600
    final: pb.GetStatusResponse | None = None
    for index in range(plan.kills + 1):
        service, life = start_life(work, index, load)
        trace.lives.append(life)
        common.progress(
            f"filter run {index}: service up (pid {life.pid})"
            + (
                f", restored snapshot {life.restored_sequence}: {len(life.restored_scored)} "
                f"scored groups, {len(life.restored_finishing)} finishing"
                if life.restored_sequence is not None
                else ""
            )
        )
        poller = InFlightPoller(service.address, load.poll_interval_s)
        channel = grpc.insecure_channel(service.address)
        try:
            final = serve_until(
                pb_grpc.RolloutServiceStub(channel),
                life,
                kill_at[index] if index < plan.kills else None,
                plan,
                trace,
                work / "store",
                deadline,
            )
        except BaseException:
            service.kill()
            raise
        finally:
            poller.stop()
            trace.in_flight += poller.samples
            channel.close()
        if final is None:
            service.kill()
            trace.kills.append(time.time())
            common.progress(
                f"filter run {index}: SIGKILL at position {life.killed_at_position} of "
                f"{plan.prompts}, {len(trace.delivered)} groups delivered so far"
            )
        elif (code := service.stop(30.0)) != 0:
            common.fail(f"the service exited with {code} (see {service.log_path})")
    assert final is not None
    return assemble_filter(work, plan, load, final, trace, started)


def read_calls(path: Path) -> list[tuple[int, str, int, int, float]]:
    """The verifier's lines: (service pid, prompt id, index, first token id, reward)."""
    calls = []
    for line in path.read_text().splitlines():
        pid, prompt, index, first, reward = line.split()
        calls.append((int(pid), prompt, int(index), int(first), float(reward)))
    return calls


def assemble_filter(
    work: Path,
    plan: Plan,
    load: FilterLoad,
    final: pb.GetStatusResponse,
    trace: Trace,
    started: float,
) -> dict[str, Any]:
    delivered, lives, in_flight, kills = trace.delivered, trace.lives, trace.in_flight, trace.kills
    c = final.counters
    admitted = len(delivered) + c.dropped_groups
    dropped_fraction = c.dropped_groups / admitted
    expected = load.expected_dropped_fraction
    lo, hi = binomial_interval(admitted, expected, INTERVAL_LEVEL)

    calls = read_calls(work / "calls.txt")
    last_reward: dict[tuple[str, int], float] = {}
    for _, prompt, index, _, reward in calls:
        last_reward[(prompt, index)] = reward
    pass_rate = sum(last_reward.values()) / len(last_reward)
    by_life: dict[int, list[tuple[int, str, int, int, float]]] = defaultdict(list)
    for call in calls:
        by_life[call[0]].append(call)
    after_restore = rescored = unscored = 0
    restores = []
    for life in lives[1:]:
        # A group the snapshot held as finishing and the trainer acked before the kill was
        # scored, committed and delivered after the snapshot: journal replay settles it (its
        # prompt is consumed) and nothing scores it again. The others must be scored again.
        acked_before = {d.prompt_id for d in delivered if d.life < life.index}
        already = life.restored_scored | (life.restored_finishing & acked_before)
        again = life.restored_finishing - acked_before
        mine = [prompt for _, prompt, *_ in by_life[life.pid]]
        after_restore += sum(1 for prompt in mine if prompt in already)
        rescored += len(again & set(mine))
        unscored += len(again - set(mine))
        restores.append(
            {
                "life": life.index,
                "restored_sequence": life.restored_sequence,
                "groups_restored_scored": len(life.restored_scored),
                "groups_restored_finishing": len(life.restored_finishing),
                "finishing_groups_acked_before_the_kill": len(
                    life.restored_finishing & acked_before
                ),
                "already_scored_groups_scored_again": len(already & set(mine)),
                "finishing_groups_scored_again": len(again & set(mine)),
                "finishing_groups_not_scored_again": sorted(again - set(mine)),
            }
        )

    per_prompt = Counter(d.prompt_id for d in delivered)
    delivered_ids = set(per_prompt)
    all_ids = {f"p{i}" for i in range(plan.prompts)}
    # A prompt that was not delivered was dropped: its last scored rewards are all equal.
    dropped_ids = all_ids - delivered_ids
    rewards_of: defaultdict[str, dict[int, float]] = defaultdict(dict)
    for (prompt, index), reward in last_reward.items():
        rewards_of[prompt][index] = reward
    dropped_unequal = sorted(p for p in dropped_ids if len(set(rewards_of[p].values())) != 1)
    mismatched = sum(
        1
        for d in delivered
        for reward, first in zip(d.rewards, d.first_tokens, strict=True)
        if reward != (1.0 if first >= 0 and first % 2 == 0 else 0.0)
    )
    peak = max(g + f for _, g, f in in_flight)
    ratio_cap = 1 + load.max_oversample_ratio
    every_prompt_once = (
        max(per_prompt.values()) == 1
        and len(dropped_ids) == c.dropped_groups
        and not dropped_unequal
        and not (delivered_ids - all_ids)
    )
    return {
        "groups_admitted": admitted,
        "groups_delivered": len(delivered),
        "groups_dropped": c.dropped_groups,
        "dropped_by_reason": dict(c.dropped_by_reason),
        "dropped_by_reason_adds_up": sum(c.dropped_by_reason.values()) == c.dropped_groups,
        "dropped_tokens": c.dropped_tokens,
        "status_admitted_groups": c.admitted_groups,
        "dropped_fraction": dropped_fraction,
        "expected_dropped_fraction": expected,
        "interval_level": INTERVAL_LEVEL,
        "dropped_interval": [lo / admitted, hi / admitted],
        "dropped_within_interval": lo <= c.dropped_groups <= hi,
        "measured_pass_rate": pass_rate,
        "expected_at_measured_pass_rate": pass_rate**load.group_size
        + (1 - pass_rate) ** load.group_size,
        "zero_variance_delivered": sum(1 for d in delivered if len(set(d.rewards)) == 1),
        "zero_std_delivered": sum(1 for d in delivered if d.reward_std == 0),
        "rewards_unlike_verifier": mismatched,
        "scorer_calls": len(calls),
        "scorer_calls_after_restore": after_restore,
        "finishing_groups_scored_after_restore": rescored,
        "finishing_groups_not_scored_after_restore": unscored,
        "restores": restores,
        "kills": len(kills),
        "kill_positions": [life.killed_at_position for life in lives if life.killed_at_position],
        "every_prompt_once": every_prompt_once,
        "prompts_delivered_twice": sum(1 for n in per_prompt.values() if n > 1),
        "prompts_dropped_with_unequal_rewards": dropped_unequal,
        "max_in_flight": load.max_in_flight,
        "in_flight_cap": final.buffer.max_in_flight,
        "in_flight_peak": peak,
        "oversample_peak_ratio": peak / load.max_in_flight,
        "oversample_ratio_cap": ratio_cap,
        "oversample_within_cap": peak / load.max_in_flight <= ratio_cap,
        "status_polls": len(in_flight),
        "in_flight_series": [(round(t - started, 3), g, f) for t, g, f in in_flight],
        "kill_times_s": [round(t - started, 3) for t in kills],
        "seconds": time.time() - started,
    }


# --- part 2: scoring on versus off on vLLM ----------------------------------------------------


SCORING_ON = {"scoring.verifier": "_verifiers:sleep_1ms"}
VARIANTS = {"off": {}, "on": SCORING_ON}
"""Variant -> config overrides: no verifier, and the 1 ms verifier (no filter)."""


async def run_variant(
    engine: SharedEngine, procs: list[Any], load: Load, plan: Plan, variant: str, workdir: Path
) -> dict[str, Any]:
    config = service_config(load, Variant.SERVICE, workdir, engine_overrides(), VARIANTS[variant])
    service = RolloutService(config, engine=engine, telemetry=setup_telemetry(disabled=True))
    if (service.scoring is not None) != (variant == "on"):
        common.fail(f"variant {variant}: the scoring stage is {service.scoring!r}")
    addresses = await service.start()
    counters = service.controller.rooms.accounting.counters

    def read(at: float) -> Tick:
        c = counters
        backlog = c.committed_groups - c.acked_groups
        return Tick(at, c.committed_groups, c.committed_tokens, backlog, c.acked_groups)

    meter = Meter(read, load.max_in_flight, load.poll_interval_s, needs_ack=True)
    meter.start()
    trainer = TrainerProcess(addresses.grpc, load.trainer_groups_per_step, workdir / "trainer.log")
    try:
        figures = await measure(meter, plan, CpuClock(procs, trainer.proc.pid))
    finally:
        await meter.stop()
        trainer.stop()
        await service.shutdown()
    lost = counters.dropped_groups + counters.evicted_groups + counters.requeued_groups
    if lost:
        common.fail(f"scoring {variant}: {lost} groups dropped, evicted or requeued")
    return figures


async def on_vs_off(plan: Plan, tmp: Path) -> dict[str, Any]:
    load = Load()
    base = service_config(load, Variant.SERVICE, tmp, engine_overrides())
    common.progress("starting vLLM on the tiny model (float32)")
    t = time.monotonic()
    engine, procs = await start_engine(base)
    engine_start_s = time.monotonic() - t
    common.progress(f"engine started in {engine_start_s:.1f} s ({len(procs)} processes)")
    shared = SharedEngine(engine, keep=0)
    runs: list[dict[str, Any]] = []
    try:
        warm = replace(plan, warmup_s=0.0, window_s=plan.engine_warmup_s)
        r = await run_variant(shared, procs, load, warm, "off", tmp / "warm-up")
        common.progress(f"warm-up: {r['tokens_per_s']:,.0f} tokens/s (not counted)")
        for i in range(plan.rounds):
            order = ["off", "on"] if i % 2 == 0 else ["on", "off"]
            for variant in order:
                workdir = tmp / f"round-{i}-{variant}"
                workdir.mkdir()
                r = {"round": i + 1, "variant": variant}
                r |= await run_variant(shared, procs, load, plan, variant, workdir)
                runs.append(r)
                common.progress(
                    f"round {i + 1} scoring {variant:<3} {r['tokens_per_s']:7,.0f} tokens/s over "
                    f"{r['waves']:.0f} waves ({r['measured_s']:.1f} s); CPU: this process "
                    f"{r['cpu_share']['this_process']:.0%}, engine "
                    f"{r['cpu_share']['engine_processes']:.0%}"
                )
    finally:
        await engine.stop()
    by_round: dict[int, dict[str, float]] = defaultdict(dict)
    for r in runs:
        by_round[r["round"]][r["variant"]] = r["tokens_per_s"]
    ratios = [t["on"] / t["off"] for t in by_round.values()]
    return {
        "ratio": common.median(ratios),
        "per_round_ratios": ratios,
        "tokens_per_s": {
            v: common.median([r["tokens_per_s"] for r in runs if r["variant"] == v])
            for v in VARIANTS
        },
        "verifier": SCORING_ON["scoring.verifier"],
        "scoring_workers": base.scoring.workers,
        "engine_start_s": engine_start_s,
        "load": asdict(load),
        "runs": runs,
    }


# --- the run ----------------------------------------------------------------------------------


def run(plan: Plan, quick: bool) -> dict[str, Any]:
    started = time.time()
    load = FilterLoad()
    with tempfile.TemporaryDirectory(prefix="rolloutd-scoring-") as tmp:
        work = Path(tmp) / "filter"
        work.mkdir()
        common.progress(
            f"filter: {plan.prompts} prompts x {load.group_size}, first_token_even, "
            f"zero_variance on, {plan.kills} SIGKILL + --restore latest cycles"
        )
        filtered = filter_run(work, plan, load)
        common.progress(
            f"filter: {filtered['groups_dropped']} of {filtered['groups_admitted']} groups "
            f"dropped ({filtered['dropped_fraction']:.3f}; expected "
            f"{filtered['expected_dropped_fraction']:.3f}, 99% interval "
            f"{filtered['dropped_interval'][0]:.3f}-{filtered['dropped_interval'][1]:.3f}); "
            f"pass rate {filtered['measured_pass_rate']:.3f}; in flight at most "
            f"{filtered['in_flight_peak']} of {filtered['max_in_flight']} x "
            f"{filtered['oversample_ratio_cap']:g}; {filtered['scorer_calls_after_restore']} calls "
            "after restore for restored scored groups"
        )
        throughput = Path(tmp) / "throughput"
        throughput.mkdir()
        cost = asyncio.run(on_vs_off(plan, throughput))
    return assemble(plan, quick, started, filtered, cost)


def assemble(
    plan: Plan, quick: bool, started: float, f: dict[str, Any], cost: dict[str, Any]
) -> dict[str, Any]:
    ratios = cost["per_round_ratios"]
    headline = [
        common.headline(
            "dropped_fraction", f["dropped_fraction"], "",
            f"in the 99% interval {f['dropped_interval'][0]:.3f}-{f['dropped_interval'][1]:.3f}",
            f["dropped_within_interval"],
            f"{f['groups_dropped']} of {f['groups_admitted']} groups; expected "
            f"{f['expected_dropped_fraction']:.3f}; measured pass rate "
            f"{f['measured_pass_rate']:.3f}",
        ),
        common.headline(
            "zero_variance_delivered", f["zero_variance_delivered"], "groups", "0",
            f["zero_variance_delivered"] == 0, f"of {f['groups_delivered']} delivered",
        ),
        common.headline(
            "scorer_calls_after_restore", f["scorer_calls_after_restore"], "calls", "0",
            f["scorer_calls_after_restore"] == 0,
            f"{f['kills']} SIGKILLs; "
            f"{sum(r['groups_restored_scored'] for r in f['restores'])} scored groups restored",
        ),
        common.headline(
            "oversample_peak_ratio", f["oversample_peak_ratio"], "",
            f"<= {f['oversample_ratio_cap']:g}", f["oversample_within_cap"],
            f"at most {f['in_flight_peak']} groups in flight, limits.max_in_flight "
            f"{f['max_in_flight']}; {f['status_polls']} GetStatus polls",
        ),
        common.headline(
            "every_prompt_once", float(f["every_prompt_once"]), "", "1 (true)",
            f["every_prompt_once"], "delivered once or dropped once, none missing",
        ),
        common.headline(
            "dropped_by_reason (GetStatus)", sum(f["dropped_by_reason"].values()), "groups",
            f"= dropped_groups ({f['groups_dropped']})", f["dropped_by_reason_adds_up"],
            ", ".join(f"{k} {v}" for k, v in f["dropped_by_reason"].items()),
        ),
        common.headline(
            "scoring_on_vs_off (committed tokens/s)", cost["ratio"], "", f">= {RATIO_TARGET}",
            cost["ratio"] >= RATIO_TARGET,
            f"median of {len(ratios)} per-round ratios ({min(ratios):.2f} to "
            f"{max(ratios):.2f}); on {cost['tokens_per_s']['on']:,.0f}, off "
            f"{cost['tokens_per_s']['off']:,.0f} tokens/s",
        ),
    ]  # fmt: skip
    keys = (
        "groups_admitted", "groups_dropped", "dropped_fraction", "expected_dropped_fraction",
        "dropped_within_interval", "zero_variance_delivered", "scorer_calls_after_restore",
        "oversample_peak_ratio",
    )  # fmt: skip
    return {
        "benchmark": NAME,
        "quick": quick,
        "quick_changes": QUICK_CHANGES if quick else "",
        "conditions": common.conditions(
            started,
            peak_rss_gib=common.peak_rss_gib(),
            engine=engine_overrides(),
            engine_start_s=cost["engine_start_s"],
        ),
        "plan": asdict(plan),
        "filter_load": asdict(FilterLoad()),
        **{k: f[k] for k in keys},
        "scoring_on_vs_off": cost["ratio"],
        "scoring_on_vs_off_per_round": ratios,
        "filter": f,
        "cost": cost,
        "headline": headline,
    }


# --- results ----------------------------------------------------------------------------------


def markdown(result: dict[str, Any]) -> str:
    c, f, cost = result["conditions"], result["filter"], result["cost"]
    load = cost["load"]
    out = [
        "# Scoring benchmark\n",
        f"{'Quick run. ' + result['quick_changes'] + '.' if result['quick'] else 'Full run.'} "
        f"Commit {c['commit']}"
        + (f" with uncommitted {', '.join(c['uncommitted'])}" if c["uncommitted"] else "")
        + f"; {c['cpus']} CPUs shared with other work, load average "
        f"{c['load_avg_1m_5m_15m'][0]:.1f} at the end; {c['duration_s']:.0f} s in all; "
        f"{c['started_at']}.\n",
        common.headline_table(result["headline"]),
        "\n## The filter across SIGKILLs\n",
        f"Synthetic engine, {f['groups_admitted']} prompts in groups of "
        f"{result['filter_load']['group_size']}, `_verifiers:first_token_even`, "
        f"`filter.zero_variance` on, `limits.max_in_flight` {f['max_in_flight']} with "
        f"`filter.max_oversample_ratio` {result['filter_load']['max_oversample_ratio']:g} (cap "
        f"{f['in_flight_cap']}); {f['kills']} SIGKILLs at positions "
        f"{', '.join(map(str, f['kill_positions']))}, each followed by `--restore latest`. "
        f"Delivered {f['groups_delivered']}, dropped {f['groups_dropped']} "
        f"({f['dropped_by_reason']}, {f['dropped_tokens']:,} generated tokens wasted); "
        f"{f['scorer_calls']:,} verifier calls; verifier pass rate {f['measured_pass_rate']:.3f}, "
        f"for which {f['expected_at_measured_pass_rate']:.3f} of groups would be dropped.\n",
        "Per restart: the groups the restored snapshot holds as scored; those it holds as "
        "finishing, of which some were acked before the kill (delivered after the snapshot: "
        "settled by journal replay, never scored again) and the others must be scored again; "
        "and the restarted service's verifier calls for each kind.\n",
        common.markdown_table(
            ["restart", "snapshot", "scored groups restored", "finishing groups restored",
             "of them acked before the kill", "already scored, scored again",
             "finishing, scored again", "finishing, not scored again"],
            [
                (r["life"], r["restored_sequence"], r["groups_restored_scored"],
                 r["groups_restored_finishing"], r["finishing_groups_acked_before_the_kill"],
                 r["already_scored_groups_scored_again"], r["finishing_groups_scored_again"],
                 len(r["finishing_groups_not_scored_again"]))
                for r in f["restores"]
            ],
        ),
        "\n## Scoring on versus off (vLLM, tiny model)\n",
        f"{load['max_in_flight']} groups of {load['group_size']} siblings in flight, up to "
        f"{load['max_tokens']} tokens each; verifier `{cost['verifier']}` in "
        f"{cost['scoring_workers']} scoring workers against none; engine start "
        f"{cost['engine_start_s']:.0f} s. Committed tokens/s between wave ends.\n",
        common.markdown_table(
            ["round", "variant", "tokens/s", "waves", "measured s", "this process CPU",
             "engine CPU"],
            [
                (r["round"], r["variant"], r["tokens_per_s"], r["waves"], r["measured_s"],
                 f"{r['cpu_share']['this_process']:.3f}",
                 f"{r['cpu_share']['engine_processes']:.2f}")
                for r in cost["runs"]
            ],
        ),
    ]  # fmt: skip
    return "\n".join(out)


def plot(result: dict[str, Any], path: Path) -> None:
    plt = common.pyplot()
    f, cost = result["filter"], result["cost"]
    fig, (ax1, ax2, ax3) = plt.subplots(1, 3, figsize=(17, 5))

    lo, hi = f["dropped_interval"]
    ax1.bar([0], [f["dropped_fraction"]], color="C0", label="dropped fraction")
    ax1.errorbar(
        [0], [f["expected_dropped_fraction"]],
        yerr=[[f["expected_dropped_fraction"] - lo], [hi - f["expected_dropped_fraction"]]],
        fmt="o", color="r", capsize=8, label="expected, 99% interval",
    )  # fmt: skip
    ax1.set_xticks([0], [f"{f['groups_dropped']} of {f['groups_admitted']} groups"])
    ax1.set(ylabel="fraction of admitted groups", ylim=(0, max(hi, f["dropped_fraction"]) * 1.4))
    ax1.set_title("Zero-variance groups dropped")
    ax1.legend(fontsize=8)

    t: list[float] = []
    total: list[float] = []
    finishing: list[float] = []
    for at, generating, finishing_now in f["in_flight_series"]:
        if t and at - t[-1] > 1.0:  # the service was down: a gap, not a line across it
            for series in (t, total, finishing):
                series.append(math.nan)
        t.append(at)
        total.append(generating + finishing_now)
        finishing.append(finishing_now)
    ax2.plot(t, total, "-", lw=0.8, label="in flight")
    ax2.plot(t, finishing, "-", lw=0.8, label="of them finishing")
    ax2.axhline(f["max_in_flight"], color="grey", ls=":", label="limits.max_in_flight")
    ax2.axhline(f["max_in_flight"] * f["oversample_ratio_cap"], color="r", ls="--", label="cap")
    for k in f["kill_times_s"]:
        ax2.axvline(k, color="k", lw=1)
    ax2.set(xlabel="seconds (black: SIGKILL)", ylabel="groups (GetStatus)")
    ax2.set_title("Groups in flight")
    ax2.legend(fontsize=8, loc="lower right")

    for i, v in enumerate(("off", "on")):
        mine = [r for r in cost["runs"] if r["variant"] == v]
        ax3.plot(
            [r["round"] for r in mine],
            [r["tokens_per_s"] for r in mine],
            "o-",
            color=f"C{i}",
            label=f"scoring {v} (median {cost['tokens_per_s'][v]:,.0f})",
        )
    ax3.set(xlabel="round", ylabel="committed tokens/s", ylim=(0, None))
    ax3.set_title(f"1 ms verifier: on / off {cost['ratio']:.3f}")
    ax3.legend(fontsize=8, loc="lower left")

    fig.suptitle("rolloutd scoring" + (" (quick)" if result["quick"] else ""))
    common.save_figure(fig, path)


def main() -> None:
    args = common.parse_args(__doc__.splitlines()[0])
    plan = QUICK if args.quick else FULL
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    if args.quick:
        common.progress(QUICK_CHANGES)
    result = run(plan, args.quick)
    common.publish(result, args.json, NAME, markdown(result), plot)


if __name__ == "__main__":
    main()
