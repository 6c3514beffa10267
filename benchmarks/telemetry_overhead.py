"""Telemetry overhead: committed tokens/s through the real service, telemetry fully on versus off.

Every run starts the real CLI (``rolloutd serve``, synthetic engine) as a subprocess, with the same
load: 1,024 requests in flight generating at 100 tokens/s each, like a busy multi-GPU node. The
engine is not instant, so it cannot be what saturates, and the service's own work (admission,
staging, commits, leases, acks, gRPC encoding, periodic checkpoints, and telemetry when on) is
what takes the CPU; the synthetic engine makes its token ids in the service's process, so its CPU
time counts too. A trainer thread in this process leases and acks groups as fast as they come.
After a warm-up, committed tokens/s is the service's own counter (``GetStatus``
``counters.committed_tokens``) over a measured window; the CPU time the service process used in
that window is reported per million committed tokens.

- **on**: ``OTEL_SDK_DISABLED=false``; traces (a span per RPC and per checkpoint phase) and the
  metric catalogue exported over OTLP/gRPC to a sink, metrics every second; the admin
  ``/metrics`` endpoint scraped every second (both 15 times as often as the deployment's 15 s).
  The sink and the scraper run in processes of their own, as a collector and Prometheus would.
- **off**: ``OTEL_SDK_DISABLED=true``.

Runs alternate in ABBA order (on, off, off, on, ...) so a drift in the machine's load over the
invocation weighs on both modes alike. ``telemetry_on_vs_off`` (target >= 0.99) is the median,
over the pairs of neighbouring runs, of on / off committed tokens/s; ``on_tokens_per_s`` and
``off_tokens_per_s`` are the means of each mode.

Usage: ``python benchmarks/telemetry_overhead.py [--quick] [--json FILE]``.
"""

from __future__ import annotations

import multiprocessing
import queue
import tempfile
import threading
import time
from concurrent import futures
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import common
import grpc
import httpx
from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2, metrics_service_pb2_grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

from rolloutd.client import RolloutClient
from rolloutd.v1 import rollout_pb2 as pb

NAME = "telemetry_overhead"
TARGET = 0.99


@dataclass(frozen=True)
class Load:
    """The workload every run serves, on and off alike."""

    group_size: int = 8
    max_in_flight: int = 128
    """Groups generating at once: ``max_in_flight * group_size`` concurrent requests (a busy
    multi-GPU node)."""
    tokens_per_s: float = 100.0
    """Decode speed of one request, as a GPU batching hundreds of sequences gives each."""
    max_tokens: int = 128
    """Completions are uniform in [8, max_tokens] tokens."""
    checkpoint_interval_s: float = 2.0
    fetch_groups: int = 16
    """Groups one trainer fetch asks for."""
    metric_export_interval_ms: int = 1000
    scrape_interval_s: float = 1.0


@dataclass(frozen=True)
class Plan:
    pairs: int = 6
    """Runs of each mode."""
    warmup_s: float = 3.0
    """Served before the window opens (generation in flight reaches its steady state)."""
    window_s: float = 10.0


FULL = Plan()
QUICK = Plan(pairs=3, warmup_s=1.5, window_s=3.0)
QUICK_CHANGES = (
    "quick: 3 runs of each mode, 3 s windows after 1.5 s of warm-up (full: 6, 10 s, 3 s)"
)


# --- the telemetry backends: an OTLP sink and a Prometheus scraper, each in its own process ------
#
# As in production, the collector and Prometheus do not share a process (and its GIL) with the
# trainer: in "on" runs they would slow the trainer down, and with it what it can consume.

SPAWN = multiprocessing.get_context("spawn")


class _Traces(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self, spans: Any):
        self._spans = spans

    def Export(self, request: Any, context: Any) -> Any:
        n = sum(len(ss.spans) for rs in request.resource_spans for ss in rs.scope_spans)
        with self._spans.get_lock():
            self._spans.value += n
        return trace_service_pb2.ExportTraceServiceResponse()


class _Metrics(metrics_service_pb2_grpc.MetricsServiceServicer):
    def __init__(self, points: Any):
        self._points = points

    def Export(self, request: Any, context: Any) -> Any:
        n = 0
        for rm in request.resource_metrics:
            for sm in rm.scope_metrics:
                for m in sm.metrics:
                    if (kind := m.WhichOneof("data")) is not None:
                        n += len(getattr(m, kind).data_points)
        with self._points.get_lock():
            self._points.value += n
        return metrics_service_pb2.ExportMetricsServiceResponse()


def _serve_sink(port: Any, spans: Any, points: Any, stop: Any) -> None:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(_Traces(spans), server)
    metrics_service_pb2_grpc.add_MetricsServiceServicer_to_server(_Metrics(points), server)
    port.value = server.add_insecure_port("127.0.0.1:0")
    server.start()
    stop.wait()
    server.stop(grace=None)


class OtlpSink:
    """OTLP/gRPC trace and metric services that count spans and data points and keep nothing."""

    def __init__(self) -> None:
        self._port = SPAWN.Value("i", 0)
        self._spans = SPAWN.Value("q", 0)
        self._points = SPAWN.Value("q", 0)
        self._stop = SPAWN.Event()
        self._process = SPAWN.Process(
            target=_serve_sink,
            args=(self._port, self._spans, self._points, self._stop),
            name="otlp-sink",
            daemon=True,
        )
        self.port = 0

    def totals(self) -> tuple[int, int]:
        return self._spans.value, self._points.value

    def __enter__(self) -> OtlpSink:
        self._process.start()
        deadline = time.monotonic() + 60
        while not self._port.value:
            if not self._process.is_alive() or time.monotonic() > deadline:
                common.fail("the OTLP sink did not start")
            time.sleep(0.05)
        self.port = self._port.value
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._process.join(30)


def _scrape(targets: Any, interval_s: float, scrapes: Any, series: Any) -> None:
    """Scrapes the last URL received, every ``interval_s``; an empty URL pauses, None ends."""
    url = ""
    with httpx.Client(timeout=10) as http:
        while True:
            try:
                url = targets.get(timeout=interval_s if url else None)
            except queue.Empty:
                response = http.get(url)
                response.raise_for_status()
                series.value = sum(1 for line in response.text.splitlines() if line[:1] != "#")
                scrapes.value += 1
                continue
            if url is None:
                return


class Scraper:
    """Scrapes ``/metrics`` at a fixed interval, like Prometheus; one process for every run."""

    def __init__(self, interval_s: float):
        self._targets: Any = SPAWN.Queue()
        self._scrapes = SPAWN.Value("i", 0)
        self._series = SPAWN.Value("i", 0)
        self._process = SPAWN.Process(
            target=_scrape,
            args=(self._targets, interval_s, self._scrapes, self._series),
            name="scraper",
            daemon=True,
        )

    def __enter__(self) -> Scraper:
        self._process.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._targets.put(None)
        self._process.join(30)

    def start(self, address: str) -> None:
        self._scrapes.value = self._series.value = 0
        self._targets.put(f"http://{address}/metrics")

    def pause(self) -> tuple[int, int]:
        """(scrapes, series in the last one) since :meth:`start`."""
        self._targets.put("")
        if not self._process.is_alive():
            common.fail(f"scraping /metrics failed (exit code {self._process.exitcode})")
        return int(self._scrapes.value), int(self._series.value)


# --- the service and the trainer -------------------------------------------------------------


class Service(common.Serve):
    """The real CLI in a subprocess; its log goes to a file, its ports are read from the log."""

    def __init__(self, load: Load, env: dict[str, str], workdir: Path, log_path: Path):
        args = [
            "--engine", "synthetic",
            "--grpc-port", "0",
            "--http-port", "0",
            "--group-size", str(load.group_size),
            "--max-tokens", str(load.max_tokens),
            "--checkpoint-dir", str(workdir / "checkpoints"),
            "--checkpoint-interval", str(load.checkpoint_interval_s),
            "--restore", "none",
        ]  # fmt: skip
        full_env = {
            "ROLLOUTD_ENGINE__SYNTHETIC__TOKENS_PER_S": str(load.tokens_per_s),
            "ROLLOUTD_LIMITS__MAX_IN_FLIGHT": str(load.max_in_flight),
            "ROLLOUTD_LIMITS__BUFFER_CAPACITY": str(max(256, 8 * load.max_in_flight)),
            **env,
        }
        super().__init__(args, full_env, workdir, log_path)


class Trainer(threading.Thread):
    """Leases and acks groups as fast as they come; counts the tokens it received."""

    def __init__(self, address: str, fetch_groups: int):
        super().__init__(name="trainer", daemon=True)
        self._client = RolloutClient(address, interceptors=(), timeout_s=30)
        self._fetch_groups = fetch_groups
        self._halt = threading.Event()
        self.tokens = 0
        self.groups = 0
        self.error: BaseException | None = None

    def run(self) -> None:
        step = 0
        try:
            while not self._halt.is_set():
                lease = self._client.fetch(self._fetch_groups, wait_ms=200)
                if lease is None:
                    continue
                step += 1
                self.groups += len(lease.groups)
                self.tokens += sum(len(s.token_ids) for g in lease.groups for s in g.samples)
                self._client.ack(lease, step)
        except grpc.RpcError as exc:
            if not self._halt.is_set():
                self.error = exc
        finally:
            self._client.close()

    def status(self) -> pb.GetStatusResponse:
        return next(iter(self._client.status().values()))

    def stop(self) -> None:
        self._halt.set()
        self.join(30)


# --- one run, and the alternation ------------------------------------------------------------


@dataclass(frozen=True)
class Sample:
    """The counters a window is measured between."""

    at: float
    committed_tokens: int
    ready_groups: int
    """Committed groups waiting for the trainer (many: the trainer, not the service, limits)."""
    trainer_tokens: int
    cpu_s: float

    @classmethod
    def take(cls, trainer: Trainer, service: Service) -> Sample:
        status = trainer.status()
        return cls(
            time.monotonic(),
            status.counters.committed_tokens,
            status.buffer.committed,
            trainer.tokens,
            service.cpu_s(),
        )


@dataclass(frozen=True)
class Backends:
    """Where telemetry goes in "on" runs."""

    sink: OtlpSink
    scraper: Scraper


def run_once(mode: str, load: Load, plan: Plan, to: Backends, workdir: Path) -> dict[str, Any]:
    on = mode == "on"
    env = (
        {
            "OTEL_SDK_DISABLED": "false",
            "OTEL_SERVICE_NAME": "rolloutd-bench",
            "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{to.sink.port}",
            "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc",
            "OTEL_METRIC_EXPORT_INTERVAL": str(load.metric_export_interval_ms),
        }
        if on
        else {"OTEL_SDK_DISABLED": "true"}
    )
    spans0, points0 = to.sink.totals()
    scrapes = series = 0
    service = Service(load, env, workdir, workdir / "rolloutd.log")
    service.wait_listening(60.0)
    trainer = Trainer(service.address, load.fetch_groups)
    trainer.start()
    if on:
        to.scraper.start(service.http)
    try:
        time.sleep(plan.warmup_s)
        start = Sample.take(trainer, service)
        time.sleep(plan.window_s)
        end = Sample.take(trainer, service)
    finally:
        if on:
            scrapes, series = to.scraper.pause()
        trainer.stop()
        code = service.stop(60.0)
    if trainer.error is not None:
        common.fail(f"the trainer failed: {trainer.error}")
    if code != 0:
        common.fail(f"rolloutd exited with {code}:\n{service.log_path.read_text()[-4000:]}")
    spans1, points1 = to.sink.totals()  # the service flushed its telemetry as it stopped
    if on and not (spans1 > spans0 and points1 > points0 and series):
        common.fail(f"telemetry was not on: {service.log_path.read_text()[-4000:]}")
    seconds = end.at - start.at
    committed = end.committed_tokens - start.committed_tokens
    cpu_s = end.cpu_s - start.cpu_s
    return {
        "mode": mode,
        "tokens_per_s": committed / seconds,
        "trainer_tokens_per_s": (end.trainer_tokens - start.trainer_tokens) / seconds,
        "service_cpu_s_per_mtok": cpu_s / committed * 1e6 if committed else None,
        "service_cpu_share": cpu_s / seconds,
        "window_s": seconds,
        "ready_groups_at_end": end.ready_groups,
        "spans_exported": spans1 - spans0,
        "metric_points_exported": points1 - points0,
        "scrapes": scrapes,
        "scraped_series": series,
    }


def schedule(pairs: int) -> list[str]:
    """ABBA: on, off, off, on, on, off, ..."""
    return [m for i in range(pairs) for m in (("on", "off") if i % 2 == 0 else ("off", "on"))]


def pair_ratios(runs: list[dict[str, Any]]) -> list[float]:
    """on / off committed tokens/s of each pair of neighbouring runs (the schedule's pairs)."""
    ratios = []
    for a, b in zip(runs[::2], runs[1::2], strict=True):
        on, off = (a, b) if a["mode"] == "on" else (b, a)
        ratios.append(on["tokens_per_s"] / off["tokens_per_s"])
    return ratios


def assemble(
    runs: list[dict[str, Any]], load: Load, plan: Plan, quick: bool, started: float
) -> dict[str, Any]:
    def mean_of(mode: str, key: str) -> float:
        values = [r[key] for r in runs if r["mode"] == mode and r[key] is not None]
        return sum(values) / len(values)

    # Neighbouring runs share the machine's conditions, and the schedule puts "on" first in
    # half of the pairs: the median of the pair ratios cancels drift and shrugs off a run that
    # a burst of load elsewhere on the machine slowed down.
    ratios = pair_ratios(runs)
    ratio = common.median(ratios)
    on, off = mean_of("on", "tokens_per_s"), mean_of("off", "tokens_per_s")
    cpu_on = mean_of("on", "service_cpu_s_per_mtok")
    cpu_off = mean_of("off", "service_cpu_s_per_mtok")
    return {
        "benchmark": NAME,
        "quick": quick,
        "quick_changes": QUICK_CHANGES if quick else "",
        "conditions": common.conditions(started),
        "load": asdict(load),
        "plan": asdict(plan),
        "telemetry_on_vs_off": ratio,
        "ratio_statistic": "median over the pairs of neighbouring runs of on / off tokens/s",
        "on_tokens_per_s": on,
        "off_tokens_per_s": off,
        "ratio_of_means": on / off,
        "pair_ratios": ratios,
        "telemetry_on_vs_off_noise": common.noise(ratios),
        "on_service_cpu_s_per_mtok": cpu_on,
        "off_service_cpu_s_per_mtok": cpu_off,
        "cpu_per_token_on_vs_off": cpu_on / cpu_off,
        "runs": runs,
        "headline": [
            common.headline(
                "telemetry_on_vs_off (committed tokens/s)", ratio, "", f">= {TARGET}",
                ratio >= TARGET,
                f"{common.noise_note(ratios)}; mean on {on:,.0f}, off {off:,.0f} tokens/s",
            ),
            common.headline(
                "service CPU per committed token, on / off", cpu_on / cpu_off, "", "", None,
                f"on {cpu_on:.3g}, off {cpu_off:.3g} CPU-s per million tokens",
            ),
        ],
    }  # fmt: skip


def table(runs: list[dict[str, Any]]) -> str:
    return common.markdown_table(
        ["#", "mode", "committed tok/s", "trainer tok/s", "ready groups", "CPU-s/Mtok", "service CPU",
         "spans exported", "metric points exported", "scrapes"],
        [
            (i + 1, r["mode"], r["tokens_per_s"], r["trainer_tokens_per_s"], r["ready_groups_at_end"],
             r["service_cpu_s_per_mtok"], f"{r['service_cpu_share']:.0%}",
             r["spans_exported"], r["metric_points_exported"], r["scrapes"])
            for i, r in enumerate(runs)
        ],
    )  # fmt: skip


def main() -> None:
    args = common.parse_args(__doc__.splitlines()[0])
    plan, load = (QUICK if args.quick else FULL), Load()
    if args.quick:
        common.progress(QUICK_CHANGES)
    common.progress(
        f"load: {load.max_in_flight} groups x {load.group_size} requests at "
        f"{load.tokens_per_s:g} tokens/s each, up to {load.max_tokens} tokens"
    )
    started = time.time()
    runs: list[dict[str, Any]] = []
    modes = schedule(plan.pairs)
    with (
        OtlpSink() as sink,
        Scraper(load.scrape_interval_s) as scraper,
        tempfile.TemporaryDirectory(prefix="rolloutd-bench-") as tmp,
    ):
        for i, mode in enumerate(modes):
            workdir = Path(tmp) / f"run-{i}"
            workdir.mkdir()
            r = run_once(mode, load, plan, Backends(sink, scraper), workdir)
            runs.append(r)
            common.progress(
                f"run {i + 1}/{len(modes)} {mode:>3}: {r['tokens_per_s']:,.0f} committed tokens/s, "
                f"service CPU {r['service_cpu_share']:.0%}, "
                f"{r['spans_exported']:,} spans and {r['metric_points_exported']:,} metric points "
                f"exported, {r['scrapes']} scrapes"
            )
    result = assemble(runs, load, plan, args.quick, started)
    print()
    print(table(runs))
    print(common.headline_table(result["headline"]))
    common.publish(
        result, args.json, NAME, table(runs) + "\n" + common.headline_table(result["headline"])
    )


if __name__ == "__main__":
    main()
