"""Control plane: groups acked per second and RPC latencies with 1, 8 and 64 concurrent trainers.

The real CLI (``rolloutd serve --engine synthetic``) runs as a subprocess with an instant engine
(``ROLLOUTD_ENGINE__SYNTHETIC__TOKENS_PER_S=0``) and short samples, so generation never waits and
what limits the figures is the service's own work on the trainer path: admission, staging and
commits feeding the buffer, ``FetchGroups`` leases, ``AckGroups`` (durable before it returns), and,
in the second series, a checkpoint every 0.5 s taking the barrier exclusively.

The load generator is this process: N trainers, each a coroutine on one ``grpc.aio`` channel,
looping ``FetchGroups(max_groups=1)`` then ``AckGroups`` of that lease with its own step counter.
After a warm-up, a measured window counts acked groups and records every call's latency:

- ``groups_per_s``: groups acked in the window / window length;
- ``ack_p99_ms``: 99th percentile of ``AckGroups`` latency;
- ``fetch_ack_p50_ms``: median of one trainer's ``FetchGroups`` + ``AckGroups`` round trip.

Both series run against one fresh service each (checkpoints off, then every 0.5 s), the trainer
counts in order 1, 8, 64. The load generator shares the machine's CPUs with the service, as a
trainer's client library on the same host would; its own CPU time is reported.

Usage: ``python benchmarks/control_plane.py [--quick] [--json FILE]``.
"""

from __future__ import annotations

import asyncio
import re
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import common
import grpc

from rolloutd.v1 import rollout_pb2 as pb
from rolloutd.v1 import rollout_pb2_grpc as pb_grpc

NAME = "control_plane"
TARGETS = {"groups_per_s": 1_000.0, "ack_p99_ms": 100.0, "fetch_ack_p50_ms": 3.0}
"""Targets at 64 trainers with checkpoints every 0.5 s, and for one trainer's round trip."""


@dataclass(frozen=True)
class Plan:
    trainers: tuple[int, ...] = (1, 8, 64)
    checkpoint_intervals: tuple[float, ...] = (0.0, 0.5)
    """Seconds between periodic checkpoints; 0 disables them."""
    warmup_s: float = 3.0
    window_s: float = 15.0
    group_size: int = 8
    max_tokens: int = 32
    max_in_flight: int = 512
    buffer_capacity: int = 1024


FULL = Plan()
QUICK = Plan(warmup_s=1.5, window_s=4.0)
QUICK_CHANGES = "--quick: a 4 s measured window after 1.5 s of warm-up instead of 15 s after 3 s"


# --- the service ------------------------------------------------------------------------------


class Service(common.Serve):
    """The real CLI with the instant synthetic engine; its port is read from the log."""

    def __init__(self, plan: Plan, interval_s: float, workdir: Path) -> None:
        args = [
            "--engine", "synthetic",
            "--grpc-port", "0",
            "--http-port", "0",
            "--group-size", str(plan.group_size),
            "--max-tokens", str(plan.max_tokens),
            "--checkpoint-dir", str(workdir / "checkpoints"),
            "--checkpoint-interval", str(interval_s),
            "--restore", "none",
        ]  # fmt: skip
        env = {
            "ROLLOUTD_ENGINE__SYNTHETIC__TOKENS_PER_S": "0",
            "ROLLOUTD_LIMITS__MAX_IN_FLIGHT": str(plan.max_in_flight),
            "ROLLOUTD_LIMITS__BUFFER_CAPACITY": str(plan.buffer_capacity),
        }
        super().__init__(args, env, workdir, workdir / "service.log")

    def checkpoints(self) -> int:
        """Completed checkpoints so far, from the service's own log lines."""
        return len(re.findall(r"checkpoint \d+ completed in", self.log_path.read_text()))


# --- the trainers -----------------------------------------------------------------------------


@dataclass
class Window:
    """What the trainers recorded while ``measuring`` was set."""

    measuring: bool = False
    groups: int = 0
    fetch_s: list[float] = field(default_factory=list)
    ack_s: list[float] = field(default_factory=list)
    round_trip_s: list[float] = field(default_factory=list)
    empty_fetches: int = 0


async def trainer(stub: Any, name: str, window: Window, halt: asyncio.Event) -> None:
    step = 0
    while not halt.is_set():
        started = time.perf_counter()
        got = await stub.FetchGroups(
            pb.FetchGroupsRequest(max_groups=1, wait_ms=1000, consumer=name)
        )
        fetched = time.perf_counter()
        if not got.lease_id:
            window.empty_fetches += window.measuring
            continue
        step += 1
        await stub.AckGroups(pb.AckGroupsRequest(lease_id=got.lease_id, trainer_step=step))
        done = time.perf_counter()
        if window.measuring:
            window.groups += len(got.groups)
            window.fetch_s.append(fetched - started)
            window.ack_s.append(done - fetched)
            window.round_trip_s.append(done - started)


async def measure(address: str, trainers: int, plan: Plan) -> dict[str, Any]:
    """``trainers`` concurrent trainers, each on its own channel, for warm-up plus a window."""
    window, halt = Window(), asyncio.Event()
    channels = [grpc.aio.insecure_channel(address) for _ in range(trainers)]
    stubs = [pb_grpc.RolloutServiceStub(c) for c in channels]
    tasks = [
        asyncio.create_task(trainer(stub, f"trainer-{i}", window, halt))
        for i, stub in enumerate(stubs)
    ]
    try:
        await asyncio.sleep(plan.warmup_s)
        own = time.process_time()
        window.measuring = True
        started = time.perf_counter()
        await asyncio.sleep(plan.window_s)
        window.measuring = False
        seconds = time.perf_counter() - started
        own = time.process_time() - own
        halt.set()
        await asyncio.wait_for(asyncio.gather(*tasks), 30)
    finally:
        for task in tasks:
            task.cancel()
        for channel in channels:
            await channel.close()
    if not window.ack_s:
        common.fail(f"{trainers} trainers acked nothing in {seconds:.1f} s")
    return {
        "trainers": trainers,
        "window_s": seconds,
        "groups": window.groups,
        "groups_per_s": window.groups / seconds,
        "fetch_ms": common.summary(window.fetch_s, 1e3),
        "ack_ms": common.summary(window.ack_s, 1e3),
        "fetch_ack_ms": common.summary(window.round_trip_s, 1e3),
        "empty_fetches": window.empty_fetches,
        "load_generator_cpu_s_per_s": own / seconds,
    }


async def series(plan: Plan, interval_s: float, root: Path) -> list[dict[str, Any]]:
    workdir = root / f"interval-{interval_s}"
    workdir.mkdir()
    service = Service(plan, interval_s, workdir)
    label = f"checkpoints every {interval_s} s" if interval_s else "no checkpoints"
    try:
        service.wait_listening(60.0)
        common.progress(f"{label}: rolloutd listening on {service.address}")
        points = []
        for n in plan.trainers:
            cpu, checkpoints = service.cpu_s(), service.checkpoints()
            point = await measure(service.address, n, plan)
            elapsed = plan.warmup_s + point["window_s"]
            point["service_cpu_s_per_s"] = (service.cpu_s() - cpu) / elapsed
            point["checkpoints"] = service.checkpoints() - checkpoints
            points.append(point)
            common.progress(
                f"{label}, {n} trainers: {point['groups_per_s']:,.0f} groups/s, ack p50 "
                f"{point['ack_ms']['p50']:.2f} ms p99 {point['ack_ms']['p99']:.2f} ms, fetch+ack "
                f"p50 {point['fetch_ack_ms']['p50']:.2f} ms; {point['checkpoints']} checkpoints; "
                f"service CPU {point['service_cpu_s_per_s']:.2f} s/s, load generator "
                f"{point['load_generator_cpu_s_per_s']:.2f} s/s"
            )
    finally:
        service.stop(60.0)
    return points


async def run(plan: Plan, quick: bool) -> dict[str, Any]:
    started = time.time()
    results: dict[str, list[dict[str, Any]]] = {}
    with tempfile.TemporaryDirectory(prefix="rolloutd-control-plane-") as tmp:
        for interval in plan.checkpoint_intervals:
            results[str(interval)] = await series(plan, interval, Path(tmp))
    return assemble(plan, quick, results, started)


def assemble(
    plan: Plan, quick: bool, results: dict[str, list[dict[str, Any]]], started: float
) -> dict[str, Any]:
    busiest = str(max(plan.checkpoint_intervals))
    top = results[busiest][-1]
    one = results[str(min(plan.checkpoint_intervals))][0]
    by_trainers = {
        interval: {
            str(p["trainers"]): {
                "groups_per_s": p["groups_per_s"],
                "ack_p99_ms": p["ack_ms"]["p99"],
                "fetch_ack_p50_ms": p["fetch_ack_ms"]["p50"],
            }
            for p in points
        }
        for interval, points in results.items()
    }
    when = f"{top['trainers']} trainers, checkpoints every {busiest} s"
    headline = [
        common.headline(
            "groups_per_s",
            top["groups_per_s"],
            "groups/s",
            f">= {TARGETS['groups_per_s']:,.0f}",
            top["groups_per_s"] >= TARGETS["groups_per_s"],
            when,
        ),
        common.headline(
            "ack_p99_ms",
            top["ack_ms"]["p99"],
            "ms",
            f"< {TARGETS['ack_p99_ms']:.0f} ms",
            top["ack_ms"]["p99"] < TARGETS["ack_p99_ms"],
            when,
        ),
        common.headline(
            "fetch_ack_p50_ms",
            one["fetch_ack_ms"]["p50"],
            "ms",
            f"< {TARGETS['fetch_ack_p50_ms']:.0f} ms",
            one["fetch_ack_ms"]["p50"] < TARGETS["fetch_ack_p50_ms"],
            "one trainer, FetchGroups + AckGroups round trip, no checkpoints",
        ),
    ]
    return {
        "benchmark": NAME,
        "quick": quick,
        "quick_changes": QUICK_CHANGES if quick else "",
        "conditions": common.conditions(started),
        "plan": asdict(plan),
        "groups_per_s": top["groups_per_s"],
        "ack_p99_ms": top["ack_ms"]["p99"],
        "fetch_ack_p50_ms": one["fetch_ack_ms"]["p50"],
        "by_checkpoint_interval_s": by_trainers,
        "runs": results,
        "headline": headline,
    }


# --- reporting ----------------------------------------------------------------------------------


def markdown(result: dict[str, Any]) -> str:
    plan = result["plan"]
    lines = [
        "# Control plane\n",
        f"`rolloutd serve --engine synthetic` at tokens_per_s 0, groups of {plan['group_size']} "
        f"samples of up to {plan['max_tokens']} tokens; N trainers looping FetchGroups(1) + "
        f"AckGroups, {plan['window_s']:.0f} s measured after {plan['warmup_s']:.1f} s of warm-up. "
        f"Commit {result['conditions']['commit'] or '?'}.\n",
    ]
    if result["quick"]:
        lines.append(f"{result['quick_changes']}.\n")
    lines.append(common.headline_table(result["headline"]))
    rows = []
    for interval, points in result["runs"].items():
        for p in points:
            rows.append(
                (
                    "off" if float(interval) == 0 else f"every {interval} s",
                    p["trainers"],
                    p["groups_per_s"],
                    p["fetch_ms"]["p50"],
                    p["ack_ms"]["p50"],
                    p["ack_ms"]["p99"],
                    p["fetch_ack_ms"]["p50"],
                    p["fetch_ack_ms"]["p99"],
                    p["checkpoints"],
                    p["service_cpu_s_per_s"],
                    p["load_generator_cpu_s_per_s"],
                )
            )
    lines.append(
        common.markdown_table(
            [
                "checkpoints",
                "trainers",
                "groups/s",
                "fetch p50 ms",
                "ack p50 ms",
                "ack p99 ms",
                "fetch+ack p50 ms",
                "fetch+ack p99 ms",
                "checkpoints done",
                "service CPU s/s",
                "load generator CPU s/s",
            ],
            rows,
        )
    )
    return "\n".join(lines)


def plot(result: dict[str, Any], path: Path) -> None:
    plt = common.pyplot()
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for interval, points in result["runs"].items():
        label = "no checkpoints" if float(interval) == 0 else f"checkpoint every {interval} s"
        trainers = [p["trainers"] for p in points]
        ax1.plot(trainers, [p["groups_per_s"] for p in points], "o-", label=label)
        ax2.plot(trainers, [p["ack_ms"]["p99"] for p in points], "o-", label=label)
    ax1.axhline(TARGETS["groups_per_s"], color="grey", ls=":", label="target")
    ax2.axhline(TARGETS["ack_p99_ms"], color="grey", ls=":", label="target")
    for ax, title in ((ax1, "groups acked / s"), (ax2, "AckGroups p99 (ms)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent trainers")
        ax.set_title(title)
        ax.legend()
    common.save_figure(fig, path)


def main() -> None:
    args = common.parse_args(__doc__.splitlines()[0])
    plan = QUICK if args.quick else FULL
    if args.quick:
        common.progress(QUICK_CHANGES)
    result = asyncio.run(run(plan, args.quick))
    common.publish(result, args.json, NAME, markdown(result), plot)


if __name__ == "__main__":
    main()
