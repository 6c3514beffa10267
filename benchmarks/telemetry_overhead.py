"""Telemetry's own cost: the service's CPU per 1,000 committed tokens with every span and metric
on and exported over OTLP, against telemetry off, measured side by side.

Two services run at once, each the real CLI (``rolloutd serve``, synthetic engine) in a process of
its own with the same load: 1,024 requests in flight generating at 100 tokens/s each, like a busy
multi-GPU node, and checkpoints every 2 s. The engine is not instant, so it cannot be what
saturates; the service's own work (admission, staging, commits, leases, acks, gRPC encoding,
checkpoints, and telemetry when on) is what takes its CPU, the synthetic engine's token ids
included. Each service has a trainer, in a process of its own, leasing and acking groups as fast
as they come.

- **on**: ``OTEL_SDK_DISABLED=false``; every span (one per RPC, per group's generation, per
  checkpoint phase; fetches linked to the generations they lease) and every metric of the
  catalogue, exported over OTLP/gRPC to a receiver at the deployment's cadence (metrics every
  15 s, ``k8s/base/config/otel.env``; spans in the SDK's batches), and ``/metrics`` scraped every
  15 s (``otel/prometheus.yml``).
- **off**: ``OTEL_SDK_DISABLED=true``: the no-op SDK, no span and no metric at all (``/metrics``
  serves no ``rolloutd_*`` series, and nobody scrapes it).

The receiver (an OTLP/gRPC sink that counts spans and data points) and the scraper run in
processes of their own, as a collector and Prometheus would: their CPU is not the service's, and
the receiver's is reported apart.

Every ``window_s`` the CPU time each service's process tree used (``/proc``, all its threads)
and the tokens it committed (``GetStatus`` ``counters.committed_tokens``) are read, one service
right after the other. A window's ratio is on / off CPU per committed token: both services lived
through the same seconds of the machine's load, so its drift (other users of the two cores)
weighs on both alike. Sessions swap which service starts first and is read first.
``service_cpu_per_1k_tokens_on_vs_off`` (target <= 1.02) is the median of the windows' ratios,
reported with their spread.

Usage: ``python benchmarks/telemetry_overhead.py [--quick] [--json FILE]``.
"""

from __future__ import annotations

import multiprocessing
import queue
import tempfile
import time
from concurrent import futures
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import common
import grpc
import httpx
import psutil
from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2, metrics_service_pb2_grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

from rolloutd.client import RolloutClient

NAME = "telemetry_overhead"
TARGET = 1.02
MODES = ("on", "off")


@dataclass(frozen=True)
class Load:
    """The workload each service serves, on and off alike."""

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
    metric_export_interval_ms: int = 15_000
    scrape_interval_s: float = 15.0


@dataclass(frozen=True)
class Plan:
    sessions: int = 6
    """Pairs of services started; they alternate which one starts (and is read) first. Each
    process has a speed of its own (windows of one session resemble each other more than those
    of two), so more sessions of fewer windows average more of it out."""
    warmup_s: float = 10.0
    """Served before the first window (generation in flight reaches its steady state)."""
    windows: int = 5
    """Windows measured per session."""
    window_s: float = 15.0
    """One metric export and one scrape per window."""


FULL = Plan()
QUICK = Plan(sessions=2, warmup_s=8.0, windows=4)
QUICK_CHANGES = "quick: 2 sessions of 4 windows of 15 s (full: 6 sessions of 5)"

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

    def cpu_s(self) -> float:
        assert self._process.pid is not None
        return tree_cpu_s(self._process.pid)

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


# --- the services and their trainers -----------------------------------------------------------


class Service(common.Serve):
    """The real CLI in a subprocess; its log goes to a file, its ports are read from the log."""

    def __init__(self, mode: str, load: Load, sink_port: int, workdir: Path):
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
        telemetry = (
            {
                "OTEL_SDK_DISABLED": "false",
                "OTEL_SERVICE_NAME": "rolloutd-bench",
                "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{sink_port}",
                "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc",
                "OTEL_METRIC_EXPORT_INTERVAL": str(load.metric_export_interval_ms),
            }
            if mode == "on"
            else {"OTEL_SDK_DISABLED": "true"}
        )
        env = {
            "PYTHONHASHSEED": "0",  # one source of a process's own speed the same in both
            "ROLLOUTD_ENGINE__SYNTHETIC__TOKENS_PER_S": str(load.tokens_per_s),
            "ROLLOUTD_LIMITS__MAX_IN_FLIGHT": str(load.max_in_flight),
            "ROLLOUTD_LIMITS__BUFFER_CAPACITY": str(max(256, 8 * load.max_in_flight)),
            **telemetry,
        }
        workdir.mkdir(parents=True)
        super().__init__(args, env, workdir, workdir / "rolloutd.log")
        self.mode = mode
        self._status: RolloutClient | None = None

    def committed_tokens(self) -> int:
        if self._status is None:
            self._status = RolloutClient(self.address, interceptors=(), timeout_s=30)
        return self._status.status_of(self.address).counters.committed_tokens

    def tree_cpu_s(self) -> float:
        return tree_cpu_s(self.proc.pid)

    def close(self) -> None:
        if self._status is not None:
            self._status.close()


def tree_cpu_s(pid: int) -> float:
    """User plus system CPU time of process ``pid`` (all its threads) and its child processes."""
    root = psutil.Process(pid)
    total = 0.0
    for process in (root, *root.children(recursive=True)):
        try:
            times = process.cpu_times()
        except psutil.NoSuchProcess:
            continue
        total += times.user + times.system
    return total


def _train(address: str, fetch_groups: int, stop: Any, failed: Any) -> None:
    """A trainer process: leases and acks groups as fast as they come, until ``stop``."""
    step = 0
    with RolloutClient(address, interceptors=(), timeout_s=30) as client:
        try:
            while not stop.is_set():
                lease = client.fetch(fetch_groups, wait_ms=200)
                if lease is not None:
                    step += 1
                    client.ack(lease, step)
        except grpc.RpcError as exc:
            if not stop.is_set():
                failed.value = 1
                raise SystemExit(f"the trainer failed: {exc}") from exc


class Trainer:
    def __init__(self, address: str, fetch_groups: int):
        self._stop = SPAWN.Event()
        self._failed = SPAWN.Value("i", 0)
        self._process = SPAWN.Process(
            target=_train,
            args=(address, fetch_groups, self._stop, self._failed),
            name="trainer",
            daemon=True,
        )
        self._process.start()

    def stop(self) -> None:
        self._stop.set()
        self._process.join(30)
        if self._failed.value:
            common.fail("a trainer failed (its error is above)")


# --- one session: two services side by side, measured window by window -------------------------


@dataclass(frozen=True)
class Reading:
    """A service's counters at one instant."""

    at: float
    cpu_s: float
    committed_tokens: int

    @classmethod
    def take(cls, service: Service) -> Reading:
        return cls(time.monotonic(), service.tree_cpu_s(), service.committed_tokens())


def read_all(services: list[Service]) -> dict[str, Reading]:
    return {s.mode: Reading.take(s) for s in services}


def window_figures(
    before: dict[str, Reading], after: dict[str, Reading], receiver_cpu_s: float
) -> dict[str, Any]:
    figures: dict[str, Any] = {}
    for mode in MODES:
        a, b = before[mode], after[mode]
        tokens = b.committed_tokens - a.committed_tokens
        cpu = b.cpu_s - a.cpu_s
        if tokens <= 0:
            common.fail(f"the {mode} service committed nothing in a window")
        figures[f"{mode}_cpu_ms_per_1k_tokens"] = cpu / tokens * 1e6
        figures[f"{mode}_tokens_per_s"] = tokens / (b.at - a.at)
        figures[f"{mode}_cpu_share"] = cpu / (b.at - a.at)
        figures[f"{mode}_tokens"] = tokens
        figures[f"{mode}_cpu_s"] = cpu
    figures["ratio"] = figures["on_cpu_ms_per_1k_tokens"] / figures["off_cpu_ms_per_1k_tokens"]
    figures["receiver_cpu_ms_per_1k_tokens"] = receiver_cpu_s / figures["on_tokens"] * 1e6
    return figures


def run_session(
    index: int, load: Load, plan: Plan, sink: OtlpSink, scraper: Scraper, workdir: Path
) -> list[dict[str, Any]]:
    order = list(MODES) if index % 2 == 0 else list(reversed(MODES))
    services = [Service(mode, load, sink.port, workdir / mode) for mode in order]
    trainers: list[Trainer] = []
    windows: list[dict[str, Any]] = []
    spans0, points0 = sink.totals()
    try:
        for service in services:
            service.wait_listening(60.0)
        on = next(s for s in services if s.mode == "on")
        trainers = [Trainer(s.address, load.fetch_groups) for s in services]
        scraper.start(on.http)
        time.sleep(plan.warmup_s)
        before, receiver_before = read_all(services), sink.cpu_s()
        next_at = time.monotonic()
        for w in range(plan.windows):
            next_at += plan.window_s
            time.sleep(max(0.0, next_at - time.monotonic()))
            after, receiver_after = read_all(services), sink.cpu_s()
            figures = window_figures(before, after, receiver_after - receiver_before)
            windows.append({"session": index, "window": w, "first": order[0], **figures})
            common.progress(
                f"session {index + 1}/{plan.sessions} window {w + 1}/{plan.windows}: "
                f"CPU per 1k tokens on {figures['on_cpu_ms_per_1k_tokens']:.2f} ms, "
                f"off {figures['off_cpu_ms_per_1k_tokens']:.2f} ms, "
                f"on/off {figures['ratio']:.3f}; tokens/s on {figures['on_tokens_per_s']:,.0f}, "
                f"off {figures['off_tokens_per_s']:,.0f}"
            )
            before, receiver_before = after, receiver_after
    finally:
        scrapes, series = scraper.pause()
        for trainer in trainers:
            trainer.stop()
        codes = {s.mode: s.stop(60.0) for s in services}
        for s in services:
            s.close()
    for s in services:
        if codes[s.mode] != 0:
            common.fail(f"rolloutd ({s.mode}) exited with {codes[s.mode]}:\n"
                        f"{s.log_path.read_text()[-4000:]}")  # fmt: skip
    spans1, points1 = sink.totals()  # the "on" service flushed its telemetry as it stopped
    if not (spans1 > spans0 and points1 > points0 and scrapes and series):
        common.fail("telemetry was not on: nothing exported or scraped")
    for w in windows:
        w.update(session_spans=spans1 - spans0, session_points=points1 - points0, scrapes=scrapes)
    return windows


# --- results ---------------------------------------------------------------------------------


def assemble(
    windows: list[dict[str, Any]], load: Load, plan: Plan, quick: bool, started: float
) -> dict[str, Any]:
    ratios = [w["ratio"] for w in windows]
    ratio = common.median(ratios)
    cpu = {m: sum(w[f"{m}_cpu_s"] for w in windows) for m in MODES}
    tokens = {m: sum(w[f"{m}_tokens"] for w in windows) for m in MODES}
    per_1k = {m: cpu[m] / tokens[m] * 1e6 for m in MODES}
    speed = [w["on_tokens_per_s"] / w["off_tokens_per_s"] for w in windows]
    receiver = sum(w["receiver_cpu_ms_per_1k_tokens"] * w["on_tokens"] for w in windows)
    receiver_per_1k = receiver / tokens["on"]
    sessions = sorted({w["session"] for w in windows})
    spans = sum(next(w["session_spans"] for w in windows if w["session"] == s) for s in sessions)
    return {
        "benchmark": NAME,
        "quick": quick,
        "quick_changes": QUICK_CHANGES if quick else "",
        "conditions": common.conditions(started),
        "load": asdict(load),
        "plan": asdict(plan),
        "service_cpu_per_1k_tokens_on_vs_off": ratio,
        "ratio_statistic": "median over the windows of on / off service CPU per committed token",
        "service_cpu_per_1k_tokens_on_vs_off_noise": common.noise(ratios),
        "ratio_of_totals": per_1k["on"] / per_1k["off"],
        "on_cpu_ms_per_1k_tokens": per_1k["on"],
        "off_cpu_ms_per_1k_tokens": per_1k["off"],
        "receiver_cpu_ms_per_1k_tokens": receiver_per_1k,
        "telemetry_on_vs_off": common.median(speed),
        "telemetry_on_vs_off_noise": common.noise(speed),
        "on_tokens_per_s": sum(w["on_tokens_per_s"] for w in windows) / len(windows),
        "off_tokens_per_s": sum(w["off_tokens_per_s"] for w in windows) / len(windows),
        "spans_exported": spans,
        "windows": windows,
        "headline": [
            common.headline(
                "service CPU per 1,000 committed tokens, telemetry on / off", ratio, "",
                f"<= {TARGET}", ratio <= TARGET,
                f"{common.noise_note(ratios)}; on {per_1k['on']:.3g}, off {per_1k['off']:.3g} "
                f"CPU-ms per 1k tokens; receiver {receiver_per_1k:.3g} apart",
            ),
            common.headline(
                "committed tokens/s, telemetry on / off", common.median(speed), "", "", None,
                f"{common.noise_note(speed)}; engine-bound, so the CPU is the figure",
            ),
        ],
    }  # fmt: skip


def table(windows: list[dict[str, Any]]) -> str:
    return common.markdown_table(
        ["session", "window", "first", "on CPU-ms/1k tok", "off CPU-ms/1k tok", "on / off",
         "on tok/s", "off tok/s", "on CPU", "off CPU", "receiver CPU-ms/1k tok"],
        [
            (w["session"] + 1, w["window"] + 1, w["first"], w["on_cpu_ms_per_1k_tokens"],
             w["off_cpu_ms_per_1k_tokens"], w["ratio"], w["on_tokens_per_s"],
             w["off_tokens_per_s"], f"{w['on_cpu_share']:.0%}", f"{w['off_cpu_share']:.0%}",
             w["receiver_cpu_ms_per_1k_tokens"])
            for w in windows
        ],
    )  # fmt: skip


def plot(result: dict[str, Any], path: Path) -> None:
    plt = common.pyplot()
    windows = result["windows"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    x = list(range(1, len(windows) + 1))
    left.plot(x, [w["on_cpu_ms_per_1k_tokens"] for w in windows], "o-", label="telemetry on")
    left.plot(x, [w["off_cpu_ms_per_1k_tokens"] for w in windows], "s-", label="telemetry off")
    left.set_xlabel("window (sessions in turn)")
    left.set_ylabel("service CPU-ms per 1,000 committed tokens")
    left.set_ylim(bottom=0)
    left.legend()
    right.plot(x, [w["ratio"] for w in windows], "o", label="window")
    right.axhline(result["service_cpu_per_1k_tokens_on_vs_off"], color="C1", label="median")
    right.axhline(TARGET, color="C3", linestyle="--", label=f"target {TARGET}")
    right.axhline(1.0, color="grey", linewidth=0.8)
    right.set_xlabel("window")
    right.set_ylabel("CPU per token, on / off")
    right.legend()
    fig.suptitle("Telemetry's cost in service CPU (synthetic engine, side by side)")
    common.save_figure(fig, path)


def main() -> None:
    args = common.parse_args(__doc__.splitlines()[0])
    plan, load = (QUICK if args.quick else FULL), Load()
    if args.quick:
        common.progress(QUICK_CHANGES)
    common.progress(
        f"load per service: {load.max_in_flight} groups x {load.group_size} requests at "
        f"{load.tokens_per_s:g} tokens/s each, up to {load.max_tokens} tokens; metrics exported "
        f"every {load.metric_export_interval_ms / 1000:g} s, scraped every "
        f"{load.scrape_interval_s:g} s"
    )
    started = time.time()
    windows: list[dict[str, Any]] = []
    with (
        OtlpSink() as sink,
        Scraper(load.scrape_interval_s) as scraper,
        tempfile.TemporaryDirectory(prefix="rolloutd-bench-") as tmp,
    ):
        for i in range(plan.sessions):
            windows += run_session(i, load, plan, sink, scraper, Path(tmp) / f"session-{i}")
    result = assemble(windows, load, plan, args.quick, started)
    print()
    print(table(windows))
    print(common.headline_table(result["headline"]))
    common.publish(
        result,
        args.json,
        NAME,
        table(windows) + "\n" + common.headline_table(result["headline"]),
        plot,
    )


if __name__ == "__main__":
    main()
