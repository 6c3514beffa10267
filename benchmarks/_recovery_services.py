"""The services of ``recovery.py``: ``rolloutd serve`` on vLLM, and one restored per setting that
a trainer drains and that then takes its turn in the throughput comparison."""

from __future__ import annotations

import ast
import contextlib
import os
import re
import shutil
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import common
import grpc
import psutil

from rolloutd.v1 import rollout_pb2 as pb
from rolloutd.v1 import rollout_pb2_grpc as pb_grpc

RESTORED = re.compile(r"restored snapshot (\d+) .* tokens (\{.*?\})")
IN_FLIGHT = 16
"""``limits.max_in_flight``: groups generated at once. They start together and their siblings
are as long, so groups commit in waves of about this many."""
POLL_S = 0.05
"""How often a window reads the committed counters; its ends lag their commits by at most this."""


@dataclass(frozen=True)
class Setting:
    """One side of the throughput comparison: how the service keeps unfinished groups."""

    label: str
    granularity: str
    interval_s: float
    """``checkpoint.interval_s``; 0: no periodic checkpoints."""


OFF = Setting("off", "sibling", 0.0)
STREAMING = Setting("streaming", "token", 0.0)
ON = Setting("on", "token", 2.0)


class Service(common.Serve):
    """``rolloutd serve`` with vLLM on the tiny model, its log in a file.

    Eager on CPU, as in ``throughput.py``: there vLLM compiles without Inductor, which adds
    20-40 s to every start and made no difference to decode speed."""

    def __init__(
        self,
        work: Path,
        cache: Path,
        label: str,
        store: Path,
        setting: Setting,
        *,
        max_tokens: int,
        restore: str = "none",
    ) -> None:
        env = {
            "OTEL_SDK_DISABLED": "true",
            "VLLM_CPU_KVCACHE_SPACE": "1",
            "ROLLOUTD_ENGINE__CACHE_DIR": str(cache),
            "ROLLOUTD_ENGINE__VLLM__DTYPE": "float32",
            "ROLLOUTD_ENGINE__VLLM__ENFORCE_EAGER": "true",
            "ROLLOUTD_ENGINE__VLLM__KV_CACHE_MEMORY_GIB": "1",
            "ROLLOUTD_ENGINE__VLLM__MAX_MODEL_LEN": "2048",
            "ROLLOUTD_ENGINE__VLLM__LOG_PATH": str(work / f"vllm-{label}.log"),
            "ROLLOUTD_ENGINE__TEMPERATURE": "0",
            "ROLLOUTD_LIMITS__MAX_IN_FLIGHT": str(IN_FLIGHT),
            "ROLLOUTD_RECOVERY__GRANULARITY": setting.granularity,
        }
        args = [
            "--engine", "vllm", "--dataset", str(work / "prompts.jsonl"), "--group-size", "2",
            "--max-tokens", str(max_tokens), "--grpc-port", "0", "--http-port", "0",
            "--checkpoint-dir", str(store), "--checkpoint-interval", str(setting.interval_s),
            "--restore", restore,
        ]  # fmt: skip
        super().__init__(args, env, work, work / f"serve-{label}.log")

    def restored(self) -> dict[str, int]:
        """What the restore did with the partial tokens the snapshot held (its log line)."""
        m = RESTORED.search(self.log_path.read_text())
        if m is None:
            common.fail(f"no restore line in {self.log_path}")
        tokens: dict[str, int] = ast.literal_eval(m[2])
        return tokens


@dataclass(frozen=True)
class Reading:
    at: float
    """Monotonic time of the reading."""
    tokens: int
    groups: int
    service_cpu_s: float
    engine_cpu_s: float


class Restored:
    """A service restoring its own copy of the crash run's store with ``setting``, and a trainer
    that fetches and acks whatever it delivers.

    The trainer keeps the groups of the snapshot as they come back (:attr:`delivered`); once
    all have, the service generates only new groups of the dataset, with ``max_tokens`` (the
    restored groups keep their own). It is then one side of the throughput comparison: frozen
    (SIGSTOP of its process group: the service and vLLM's engine processes take no CPU) except
    while :meth:`measure` reads one of its windows."""

    def __init__(
        self,
        work: Path,
        cache: Path,
        crash_store: Path,
        groups: set[int],
        setting: Setting,
        max_tokens: int,
    ) -> None:
        self.setting = setting
        store = work / f"{setting.label}-store"
        shutil.copytree(crash_store, store)
        self.service = Service(
            work, cache, setting.label, store, setting, max_tokens=max_tokens, restore="latest"
        )
        self.delivered: dict[int, pb.Group] = {}
        """Groups of the snapshot delivered since the restore, by id."""
        self._wanted = frozenset(groups)
        self._back = threading.Event()
        self._active = threading.Event()
        self._idle = threading.Event()
        self._closed = threading.Event()
        self._failed: BaseException | None = None
        self._trainer = threading.Thread(target=self._train, daemon=True)
        self._main: psutil.Process | None = None
        self._engine: list[psutil.Process] = []

    def start(self) -> dict[str, int]:
        """Waits until the service serves and starts the trainer; what the restore did with the
        snapshot's partial tokens."""
        self.service.wait_listening(600.0, poll_s=0.2)
        self._main = psutil.Process(self.service.proc.pid)
        # vLLM's engine core and worker; the reaper only waits on its stdin.
        self._engine = [
            p
            for p in self._main.children(recursive=True)
            if "rolloutd.engines.reaper" not in p.cmdline()
        ]
        self._active.set()
        self._trainer.start()
        return self.service.restored()

    def _train(self) -> None:
        try:
            with grpc.insecure_channel(self.service.address) as channel:
                stub = pb_grpc.RolloutServiceStub(channel)
                while not self._closed.is_set():
                    if not self._active.is_set():
                        self._idle.set()
                        self._active.wait(0.1)
                        continue
                    r = stub.FetchGroups(
                        pb.FetchGroupsRequest(max_groups=16, wait_ms=500), timeout=60
                    )
                    if not r.lease_id:
                        continue  # nothing ready within the wait
                    for g in r.groups:
                        if g.group_id in self._wanted:
                            self.delivered[g.group_id] = g
                    stub.AckGroups(
                        pb.AckGroupsRequest(lease_id=r.lease_id, trainer_step=1), timeout=60
                    )
                    if self._wanted <= self.delivered.keys():
                        self._back.set()
        except BaseException as exc:  # the benchmark fails with it rather than waiting
            self._failed = exc
            self._idle.set()
            self._back.set()

    def _check(self) -> None:
        if self._failed is not None:
            common.fail(f"{self.setting.label}: the trainer failed: {self._failed!r}")
        if self.service.proc.poll() is not None:
            common.fail(f"{self.setting.label}: rolloutd exited; see {self.service.log_path}")

    def drained(self) -> bool:
        """Whether every group of the snapshot was delivered."""
        self._check()
        return self._back.is_set()

    def missing(self) -> int:
        return len(self._wanted - self.delivered.keys())

    def freeze(self) -> None:
        """Stops the trainer between two calls, then the service's process group."""
        self._idle.clear()
        self._active.clear()
        if not self._idle.wait(120):
            common.fail(f"{self.setting.label}: the trainer did not pause within 120 s")
        self._check()
        os.killpg(self.service.proc.pid, signal.SIGSTOP)

    def thaw(self) -> None:
        os.killpg(self.service.proc.pid, signal.SIGCONT)
        self._active.set()

    def close(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.service.proc.pid, signal.SIGCONT)
        self._closed.set()
        self._active.set()
        if self._trainer.is_alive():
            self._trainer.join()
        self.service.stop(120.0)

    def measure(self, name: str, window_s: float, waves: int) -> dict[str, float]:
        """One window, between a thaw and a freeze: committed tokens/s from one commit to
        another at least ``window_s`` and ``waves`` waves of groups later, after a warm-up of
        one wave (the groups the freeze caught mid-way commit first: their tokens were generated
        before the window). Also the CPU seconds per 1,000 committed tokens of the service
        process and of vLLM's engine processes over the window (less sensitive to other work
        on the machine than the rate)."""
        main_proc = self._main
        assert main_proc is not None
        self.thaw()
        with grpc.insecure_channel(self.service.address) as channel:
            stub = pb_grpc.RolloutServiceStub(channel)

            def counted() -> tuple[int, int]:
                c = stub.GetStatus(pb.GetStatusRequest(), timeout=30).counters
                return c.committed_tokens, c.committed_groups

            def commit_after(groups: int, not_before: float) -> Reading:
                """A reading just after a commit (within POLL_S) with at least ``groups``
                committed, at ``not_before`` or later."""
                deadline = time.monotonic() + 600
                _, before = counted()
                while True:
                    time.sleep(POLL_S)
                    tokens, now = counted()
                    at = time.monotonic()
                    if now > before and now >= groups and at >= not_before:
                        return Reading(
                            at, tokens, now, _cpu_s(main_proc), sum(map(_cpu_s, self._engine))
                        )
                    if at > deadline:
                        self._check()
                        common.fail(f"{name}: {groups} groups not committed within 600 s")
                    before = now

            t0 = commit_after(counted()[1] + IN_FLIGHT, 0.0)
            t1 = commit_after(t0.groups + waves * IN_FLIGHT, t0.at + window_s)
        self.freeze()
        tokens = t1.tokens - t0.tokens
        run = {
            "tokens_per_s": tokens / (t1.at - t0.at),
            "seconds": t1.at - t0.at,
            "service_cpu_s_per_ktok": 1000 * (t1.service_cpu_s - t0.service_cpu_s) / tokens,
            "engine_cpu_s_per_ktok": 1000 * (t1.engine_cpu_s - t0.engine_cpu_s) / tokens,
        }
        common.progress(
            f"{name}: {run['tokens_per_s']:.0f} committed tokens/s over {run['seconds']:.1f} s; "
            f"CPU s per 1k tokens: service {run['service_cpu_s_per_ktok']:.3f}, "
            f"engine {run['engine_cpu_s_per_ktok']:.3f}"
        )
        return run


def drain(services: list[Restored], timeout_s: float = 1800.0) -> None:
    """Until every service delivered the groups of the snapshot; each is frozen as soon as it
    has, so that the others finish sooner."""
    deadline = time.monotonic() + timeout_s
    waiting = list(services)
    while waiting:
        for s in [s for s in waiting if s.drained()]:
            s.freeze()
            waiting.remove(s)
            common.progress(f"{s.setting.label}: the snapshot's groups delivered; frozen")
        if waiting and time.monotonic() > deadline:
            common.fail(
                "groups of the snapshot not delivered within "
                f"{timeout_s:.0f} s: { ({s.setting.label: s.missing() for s in waiting}) }"
            )
        time.sleep(0.1)


def _cpu_s(proc: psutil.Process) -> float:
    times = proc.cpu_times()
    return float(times.user + times.system)


def schedule(settings: list[Restored], round_index: int) -> list[Restored]:
    """A round measures every setting once; every other round reverses the order, so that no
    side always comes first after a switch, and a round's sides are neighbours."""
    return settings if round_index % 2 == 0 else settings[::-1]


def throughput(
    services: list[Restored], rounds: int, window_s: float, waves: int
) -> dict[str, list[dict[str, float]]]:
    """``rounds`` rounds of one window per service (see :func:`schedule`), the others frozen."""
    runs: dict[str, list[dict[str, float]]] = {s.setting.label: [] for s in services}
    for r in range(rounds):
        for s in schedule(services, r):
            runs[s.setting.label].append(s.measure(f"{s.setting.label}-{r}", window_s, waves))
    return runs
