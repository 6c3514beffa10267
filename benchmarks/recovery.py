"""Token-level recovery: what a SIGKILL mid-generation costs with ``recovery.granularity: token``.

The real ``rolloutd serve`` runs vLLM on the tiny model on CPU, greedy (temperature 0, float32),
with a ``max_tokens`` long enough that siblings are mid-way when the process is killed:

1. **Crash run** (granularity ``token``, checkpoints every 2 s). Once a snapshot holds partial
   siblings at least 60% of ``max_tokens`` long, the process is SIGKILLed 1 s after that
   snapshot's commit (the middle of the checkpoint interval). Meanwhile ``GetStatus`` is polled
   every 50 ms for the engine's cumulative generation tokens, so the tokens generated between the
   snapshot's cut and the kill (``lost_after_snapshot``: lost whatever the granularity) are known
   from the counter.
2. The store is copied; one copy is restored with granularity ``token``, the other with
   ``sibling``. Each restore logs what it did with the partial tokens the snapshot held.
   - ``token_reuse_fraction``: partial tokens of unfinished siblings the token restore continued
     from, over those the snapshot held.
   - ``regenerated_vs_sibling_mode``: tokens generated again after the restart, token over
     sibling mode, each ``lost_after_snapshot`` plus the partial tokens that restore discarded.
   - ``greedy_resume_identical``: the token restore delivers each resumed sibling; the same
     prompts, submitted again to that service, are generated without a crash; every resumed
     sibling must equal its uninterrupted twin token for token (and start with exactly the
     snapshot's tokens).
3. **Throughput** (``checkpoint_on_vs_off``): committed tokens/s while a trainer fetches and acks,
   over a window after warm-up that runs from one commit to another and spans at least three
   waves of the groups in flight, with partial capture and checkpoints every 2 s, versus
   granularity ``sibling`` and no checkpoints. The cost of streaming alone (granularity
   ``token``, no checkpoints) is measured in the full run. Each round runs every setting once,
   back to back (off, on, off, on, ...); the figure is the median over rounds of each round's
   ``on / off``, so a window that outside load slowed is compared with its neighbour rather than
   with a quiet one. Each run also reports the CPU seconds per 1,000 committed tokens of the
   service process and of vLLM's engine processes.

``--quick`` (meant to take about three minutes): siblings of at most 960 tokens (240 in the
throughput runs) and three rounds over 8 s windows, with one service per setting for all rounds:
both start side by side, and the one not being measured is frozen (SIGSTOP of its process group)
so that it takes no CPU; each window has its warm-up after the thaw. That makes five vLLM starts
in three steps (the crash run, the two restores side by side, the two throughput services side
by side) instead of nine one after another. The full run keeps 1920 tokens, starts a fresh
service for every 45 s window (three rounds) and also measures streaming alone. The 2 cores are
shared with other work: single windows vary by ±10-25% here, so every ratio is reported with its
rounds and their spread (``*_noise`` in the JSON): a ratio whose distance from 1 is within its
spread is noise, not a result.
"""

from __future__ import annotations

import ast
import contextlib
import json
import os
import re
import shutil
import signal
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import common
import grpc
import psutil

from rolloutd.checkpoint.store import SnapshotStore
from rolloutd.engines.tiny_model import ensure_tiny_model
from rolloutd.v1 import rollout_pb2 as pb
from rolloutd.v1 import rollout_pb2_grpc as pb_grpc

NAME = "recovery"
RESTORED = re.compile(r"restored snapshot (\d+) .* tokens (\{.*?\})")
MAX_TOKENS = 1920
MAX_TOKENS_QUICK = 960
KILL_AFTER_S = 1.0
"""The SIGKILL lands this long after a snapshot: the middle of the 2 s checkpoint interval."""
IN_FLIGHT = 16
"""``limits.max_in_flight``: groups generated at once."""
WAVES = 3
"""A throughput window spans at least this many waves of ``IN_FLIGHT`` committed groups."""
ROUNDS_QUICK = 3
ROUNDS_FULL = 3
"""Rounds of throughput runs; each round runs every setting once, in the same order."""
TARGETS = {
    "token_reuse_fraction": 0.99,
    "regenerated_vs_sibling_mode": 0.2,
    "checkpoint_on_vs_off_quick": 0.97,
    "checkpoint_on_vs_off": 0.99,
}


class Service(common.Serve):
    """``rolloutd serve`` with vLLM on the tiny model, its log in a file."""

    def __init__(
        self,
        work: Path,
        label: str,
        store: Path,
        *,
        granularity: str,
        interval_s: float,
        max_tokens: int,
        restore: str = "none",
    ) -> None:
        env = {
            "OTEL_SDK_DISABLED": "true",
            "VLLM_CPU_KVCACHE_SPACE": "1",
            "ROLLOUTD_ENGINE__CACHE_DIR": str(work / "cache"),
            "ROLLOUTD_ENGINE__VLLM__DTYPE": "float32",
            "ROLLOUTD_ENGINE__VLLM__KV_CACHE_MEMORY_GIB": "1",
            "ROLLOUTD_ENGINE__VLLM__MAX_MODEL_LEN": "2048",
            "ROLLOUTD_ENGINE__VLLM__LOG_PATH": str(work / f"vllm-{label}.log"),
            "ROLLOUTD_ENGINE__TEMPERATURE": "0",
            "ROLLOUTD_LIMITS__MAX_IN_FLIGHT": str(IN_FLIGHT),
            "ROLLOUTD_RECOVERY__GRANULARITY": granularity,
        }
        args = [
            "--engine", "vllm", "--dataset", str(work / "prompts.jsonl"), "--group-size", "2",
            "--max-tokens", str(max_tokens), "--grpc-port", "0", "--http-port", "0",
            "--checkpoint-dir", str(store), "--checkpoint-interval", str(interval_s),
            "--restore", restore,
        ]  # fmt: skip
        super().__init__(args, env, work, work / f"serve-{label}.log")

    def restored(self) -> dict[str, int]:
        m = RESTORED.search(self.log_path.read_text())
        if m is None:
            common.fail(f"no restore line in {self.log_path}")
        tokens: dict[str, int] = ast.literal_eval(m[2])
        return tokens


def write_prompts(path: Path, n: int) -> None:
    path.write_text(
        "".join(
            json.dumps({"id": f"q{i}", "prompt": f"Question {i}: what is {i} plus {3 * i}?"}) + "\n"
            for i in range(n)
        )
    )


class StatusPoller:
    """Polls GetStatus for the engine's cumulative generation tokens, (wall time, tokens)."""

    def __init__(self, address: str, every_s: float = 0.05) -> None:
        self.samples: list[tuple[float, int]] = []
        self._stub = pb_grpc.RolloutServiceStub(grpc.insecure_channel(address))
        self._every = every_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.poll()
            time.sleep(self._every)

    def poll(self) -> None:
        status = self._stub.GetStatus(pb.GetStatusRequest(), timeout=10)
        self.samples.append((time.time(), status.counters.generation_tokens))

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def at(self, t: float) -> float:
        """Tokens at wall time ``t``, interpolated between the polls around it."""
        before = [s for s in self.samples if s[0] <= t]
        after = [s for s in self.samples if s[0] > t]
        if not before or not after:
            raise ValueError(f"no polls around {t}")
        (t0, c0), (t1, c1) = before[-1], after[0]
        return c0 + (c1 - c0) * (t - t0) / (t1 - t0)


def crash(work: Path, max_tokens: int, min_prefix: int) -> dict[str, Any]:
    """The crash run: returns the snapshot's figures and the tokens lost after it."""
    store_dir = work / "crash-store"
    service = Service(
        work, "crash", store_dir, granularity="token", interval_s=2.0, max_tokens=max_tokens
    )
    service.wait_listening(600.0, poll_s=0.2)
    common.progress(f"crash run: service up at {service.address}; waiting for partial siblings")
    poller = StatusPoller(service.address)
    store = SnapshotStore(str(store_dir))
    deadline = time.monotonic() + 600
    try:
        while True:
            if time.monotonic() > deadline:
                common.fail("no snapshot with partial siblings mid-way within 600 s")
            snapshot = store.resolve("latest").snapshot
            if snapshot is not None:
                partials = store.read_partials(snapshot.manifest)
                if any(min_prefix <= len(p) < max_tokens for p in partials):
                    break
            time.sleep(0.05)
        # Kill in the middle of the checkpoint interval: 1 s after that snapshot's commit.
        time.sleep(max(0.0, snapshot.manifest.created_at + KILL_AFTER_S - time.time()))
        poller.stop()
        poller.poll()
        service.kill()
    finally:
        if service.proc.poll() is None:
            service.kill()
    killed_at, tokens_at_kill = poller.samples[-1]
    snapshot = store.resolve("latest").snapshot
    assert snapshot is not None
    manifest = snapshot.manifest
    # The cut is taken just before the snapshot's files are written; created_at is its commit.
    lost = tokens_at_kill - poller.at(manifest.created_at)
    groups = {g["group_id"]: g for g in map(json.loads, snapshot.group_json())}
    staged = {(gid, s.index) for _, gid, s in snapshot.rows()}
    held = [
        p
        for p in store.read_partials(manifest)
        if groups[p.group_id]["state"] == "generating" and (p.group_id, p.index) not in staged
    ]
    common.progress(
        f"killed {killed_at - manifest.created_at:.2f} s after snapshot {manifest.sequence}: "
        f"{len(held)} partial siblings, {sum(map(len, held))} tokens held, "
        f"{lost:.0f} tokens generated after the cut"
    )
    return {
        "store": store_dir,
        "sequence": manifest.sequence,
        "held": held,
        "groups": groups,
        "lost_after_snapshot": lost,
        "kill_after_snapshot_s": killed_at - manifest.created_at,
    }


def start_restore(
    work: Path, crashed: dict[str, Any], granularity: str, max_tokens: int
) -> Service:
    """A service restoring a copy of the crash run's store with ``granularity``; not waited for,
    so that two restores start side by side."""
    store_dir = work / f"{granularity}-store"
    shutil.copytree(crashed["store"], store_dir)
    return Service(
        work,
        f"restore-{granularity}",
        store_dir,
        granularity=granularity,
        interval_s=0,
        max_tokens=max_tokens,
        restore="latest",
    )


def restore_token(service: Service, crashed: dict[str, Any]) -> dict[str, Any]:
    """The token restore (see :func:`start_restore`): compares resumed siblings with
    uninterrupted ones (the same prompts submitted again)."""
    service.wait_listening(600.0, poll_s=0.2)
    tokens = service.restored()
    common.progress(f"token restore: {tokens}; fetching resumed siblings and their twins")
    held, groups = crashed["held"], crashed["groups"]
    prompts = {
        groups[p.group_id]["prompt"]["id"]: groups[p.group_id]["prompt"]["text"] for p in held
    }
    try:
        with grpc.insecure_channel(service.address) as channel:
            stub = pb_grpc.RolloutServiceStub(channel)
            stub.SubmitPrompts(
                pb.SubmitPromptsRequest(
                    prompts=[pb.Prompt(prompt_id=f"ref-{i}", text=t) for i, t in prompts.items()]
                ),
                timeout=30,
            )
            seen: dict[int, pb.Group] = {}
            twins: dict[str, pb.Group] = {}
            wanted = {p.group_id for p in held}
            while not (wanted <= set(seen) and len(twins) == len(prompts)):
                r = stub.FetchGroups(
                    pb.FetchGroupsRequest(max_groups=16, wait_ms=60_000), timeout=300
                )
                if not r.lease_id:
                    continue  # nothing ready within the wait (generation is slow under load)
                seen.update({g.group_id: g for g in r.groups})
                twins.update({g.prompt_id: g for g in r.groups if g.prompt_id.startswith("ref-")})
                stub.AckGroups(pb.AckGroupsRequest(lease_id=r.lease_id, trainer_step=1), timeout=30)
    finally:
        service.stop(120.0)
    identical = prefix_exact = 0
    for p in held:
        [s] = [s for s in seen[p.group_id].samples if s.index == p.index]
        twin = twins[f"ref-{groups[p.group_id]['prompt']['id']}"].samples[p.index]
        n = len(p)
        prefix_exact += (
            s.resumed_at == n
            and list(s.token_ids[:n]) == p.token_ids().tolist()
            and list(s.logprobs[:n]) == p.logprobs().tolist()
        )
        identical += list(s.token_ids) == list(twin.token_ids)
    return {"tokens": tokens, "identical": identical, "prefix_exact": prefix_exact}


def restore_sibling(service: Service) -> dict[str, int]:
    """The sibling restore (see :func:`start_restore`): only its restore line is needed."""
    service.wait_listening(600.0, poll_s=0.2)
    tokens = service.restored()
    service.stop(120.0)
    common.progress(f"sibling restore: {tokens}")
    return tokens


class Generator:
    """A throughput service with a trainer fetching and acking; :meth:`measure` reads one window.

    ``--quick`` keeps one generator per setting for all rounds and freezes (SIGSTOP, the whole
    process group: the service and vLLM's engine processes) the one not being measured, so a
    round costs no vLLM start; the full run starts a fresh one for every window."""

    def __init__(
        self, work: Path, label: str, granularity: str, interval_s: float, max_tokens: int
    ) -> None:
        self.label = label
        self.service = Service(
            work,
            label,
            work / f"{label}-store",
            granularity=granularity,
            interval_s=interval_s,
            max_tokens=max_tokens,
        )
        self._active = threading.Event()
        self._idle = threading.Event()
        self._closed = threading.Event()
        self._trainer = threading.Thread(target=self._train, daemon=True)
        self._main: psutil.Process | None = None
        self._engine: list[psutil.Process] = []

    def start(self) -> None:
        """Waits until the service listens; the trainer runs from then on."""
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

    def _train(self) -> None:
        with grpc.insecure_channel(self.service.address) as channel:
            stub = pb_grpc.RolloutServiceStub(channel)
            while not self._closed.is_set():
                if not self._active.is_set():
                    self._idle.set()
                    self._active.wait(0.1)
                    continue
                r = stub.FetchGroups(pb.FetchGroupsRequest(max_groups=16, wait_ms=500), timeout=30)
                if r.lease_id:
                    stub.AckGroups(
                        pb.AckGroupsRequest(lease_id=r.lease_id, trainer_step=1), timeout=30
                    )

    def freeze(self) -> None:
        """Stops the trainer between two calls, then the service's process group."""
        self._idle.clear()
        self._active.clear()
        if self._trainer.is_alive() and not self._idle.wait(60):
            common.fail(f"{self.label}: the trainer did not pause within 60 s")
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

    def measure(self, label: str, window_s: float) -> dict[str, float]:
        """Committed tokens/s over ``window_s`` after a warm-up, and the CPU seconds per 1,000
        committed tokens of the service process and of vLLM's engine processes over the same
        window (less sensitive to other work on the machine than the rate)."""
        main_proc = self._main
        assert main_proc is not None
        with grpc.insecure_channel(self.service.address) as channel:
            stub = pb_grpc.RolloutServiceStub(channel)

            def committed() -> tuple[float, int, int, float, float]:
                status = stub.GetStatus(pb.GetStatusRequest(), timeout=10)
                return (
                    time.monotonic(),
                    status.counters.committed_tokens,
                    status.counters.committed_groups,
                    _cpu_s(main_proc),
                    sum(map(_cpu_s, self._engine)),
                )

            def commit_after(
                groups: int, not_before: float
            ) -> tuple[float, int, int, float, float]:
                """The first reading just after a commit (within 0.1 s) that has at least
                ``groups`` committed, from ``not_before``."""
                deadline = time.monotonic() + 600
                before = committed()
                while True:
                    time.sleep(0.1)
                    now = committed()
                    if now[2] > before[2] and now[2] >= groups and now[0] >= not_before:
                        return now
                    if now[0] > deadline:
                        common.fail(f"{label}: {groups} groups not committed within 600 s")
                    before = now

            time.sleep(window_s / 4)  # warm-up (after a start, or after a thaw)
            # Groups commit in waves (a group when its last sibling ends), so the window runs
            # from one commit to another: WAVES waves of the groups in flight, and window_s.
            t0, c0, g0, s0, e0 = commit_after(committed()[2] + 1, 0.0)
            t1, c1, _, s1, e1 = commit_after(g0 + WAVES * IN_FLIGHT, t0 + window_s)
        tokens = c1 - c0
        run = {
            "tokens_per_s": tokens / (t1 - t0),
            "service_cpu_s_per_ktok": 1000 * (s1 - s0) / tokens,
            "engine_cpu_s_per_ktok": 1000 * (e1 - e0) / tokens,
        }
        common.progress(
            f"{label}: {run['tokens_per_s']:.0f} committed tokens/s over {t1 - t0:.0f} s; CPU s "
            f"per 1k tokens: service {run['service_cpu_s_per_ktok']:.3f}, "
            f"engine {run['engine_cpu_s_per_ktok']:.3f}"
        )
        return run


def throughput(
    work: Path,
    settings: list[tuple[str, str, float]],
    rounds: int,
    max_tokens: int,
    window_s: float,
    *,
    shared: bool,
) -> dict[str, list[dict[str, float]]]:
    """``rounds`` rounds, each measuring every setting once in order; ``shared``: one generator
    per setting, started side by side and frozen between its windows (see :class:`Generator`)."""
    runs: dict[str, list[dict[str, float]]] = {label: [] for label, _, _ in settings}
    if not shared:
        for r in range(rounds):
            for label, granularity, interval in settings:
                g = Generator(work, f"{label}-{r}", granularity, interval, max_tokens)
                try:
                    g.start()
                    runs[label].append(g.measure(g.label, window_s))
                finally:
                    g.close()
        return runs
    generators = [
        Generator(work, label, gran, interval, max_tokens) for label, gran, interval in settings
    ]
    try:
        for g in generators:
            g.start()
            g.freeze()
        common.progress(f"throughput: {len(generators)} services up, frozen until measured")
        for r in range(rounds):
            for g in generators:
                g.thaw()
                runs[g.label].append(g.measure(f"{g.label}-{r}", window_s))
                g.freeze()
    finally:
        for g in generators:
            g.close()
    return runs


def _cpu_s(proc: psutil.Process) -> float:
    times = proc.cpu_times()
    return float(times.user + times.system)


def main() -> None:
    args = common.parse_args(__doc__.splitlines()[0])
    started = time.time()
    quick = args.quick
    # The tiny model has 2048 positions; with 32 siblings at once each takes several seconds, and
    # the kill lands when they are well into them, as it would for minutes-long rollouts.
    max_tokens = MAX_TOKENS_QUICK if quick else MAX_TOKENS
    min_prefix = int(max_tokens * 0.6)
    window_s = 8.0 if quick else 45.0
    # Siblings of the throughput runs: several commit waves fit in a quick run's window.
    throughput_tokens = max_tokens // 4 if quick else max_tokens // 2
    with tempfile.TemporaryDirectory(prefix="rolloutd-recovery-") as tmp:
        work = Path(tmp)
        write_prompts(work / "prompts.jsonl", 256)
        ensure_tiny_model(work / "cache")
        crashed = crash(work, max_tokens, min_prefix)
        # Both restores start at once: their vLLM starts overlap.
        token_service = start_restore(work, crashed, "token", max_tokens)
        sibling = restore_sibling(start_restore(work, crashed, "sibling", max_tokens))
        token = restore_token(token_service, crashed)
        settings = [("off", "sibling", 0.0), ("on", "token", 2.0)]
        if not quick:
            settings.insert(1, ("streaming", "token", 0.0))
        rounds = ROUNDS_QUICK if quick else ROUNDS_FULL
        runs = throughput(work, settings, rounds, throughput_tokens, window_s, shared=quick)
    held = sum(map(len, crashed["held"]))
    lost = crashed["lost_after_snapshot"]
    reused = token["tokens"]["reused"]
    reuse_fraction = reused / held if held else float("nan")
    regenerated_token = lost + token["tokens"]["regenerated"]
    regenerated_sibling = lost + sibling["regenerated"]
    vs_sibling = regenerated_token / regenerated_sibling
    n_held = len(crashed["held"])
    identical = token["identical"] == n_held and token["prefix_exact"] == n_held
    rates = {label: [r["tokens_per_s"] for r in v] for label, v in runs.items()}
    rate = {label: common.median(v) for label, v in rates.items()}
    # Each round runs every setting back to back, so a round's ratio compares windows measured
    # under the same outside load; the median over rounds drops a round that load disturbed.
    paired = {
        label: [a / b for a, b in zip(v, rates["off"], strict=True)]
        for label, v in rates.items()
        if label != "off"
    }
    on_vs_off = common.median(paired["on"])
    target_on = TARGETS["checkpoint_on_vs_off_quick" if quick else "checkpoint_on_vs_off"]
    headline = [
        common.headline(
            "token_reuse_fraction", reuse_fraction, "", f">= {TARGETS['token_reuse_fraction']}",
            reuse_fraction >= TARGETS["token_reuse_fraction"],
            f"{reused} of {held} partial tokens held by the snapshot",
        ),
        common.headline(
            "regenerated_vs_sibling_mode", vs_sibling, "",
            f"<= {TARGETS['regenerated_vs_sibling_mode']}",
            vs_sibling <= TARGETS["regenerated_vs_sibling_mode"],
            f"{regenerated_token:.0f} vs {regenerated_sibling:.0f} tokens "
            f"({lost:.0f} generated after the cut, lost in both)",
        ),
        common.headline(
            "greedy_resume_identical", float(identical), "", "true", identical,
            f"{token['identical']} of {n_held} resumed siblings equal their twin; "
            f"{token['prefix_exact']} start with exactly the snapshot's tokens and logprobs",
        ),
        common.headline(
            "checkpoint_on_vs_off", on_vs_off, "", f">= {target_on}", on_vs_off >= target_on,
            f"{common.noise_note(paired['on'])}; medians {rate['on']:.0f} vs "
            f"{rate['off']:.0f} committed tokens/s",
        ),
    ]  # fmt: skip
    result = {
        "benchmark": NAME,
        "quick": quick,
        "headline": headline,
        "token_reuse_fraction": reuse_fraction,
        "regenerated_vs_sibling_mode": vs_sibling,
        "greedy_resume_identical": identical,
        "checkpoint_on_vs_off": on_vs_off,
        "crash": {
            "max_tokens": max_tokens,
            "snapshot": crashed["sequence"],
            "partial_siblings": n_held,
            "partial_tokens_held": held,
            "lost_after_snapshot": lost,
            "kill_after_snapshot_s": crashed["kill_after_snapshot_s"],
            "token_restore": token["tokens"],
            "sibling_restore": sibling,
        },
        "throughput_tokens_per_s": rates,
        "paired_ratios_vs_off": paired,
        "streaming_vs_off": common.median(paired["streaming"]) if "streaming" in paired else None,
        "checkpoint_on_vs_off_noise": common.noise(paired["on"]),
        "streaming_vs_off_noise": (
            common.noise(paired["streaming"]) if "streaming" in paired else None
        ),
        "window_s": window_s,
        "runs": runs,
        "cpu_s_per_ktok": {
            label: {
                part: common.median([r[f"{part}_cpu_s_per_ktok"] for r in v])
                for part in ("service", "engine")
            }
            for label, v in runs.items()
        },
        "conditions": common.conditions(started),
    }
    common.publish(result, args.json, NAME, markdown(result), plot)


def markdown(result: dict[str, Any]) -> str:
    crash = result["crash"]
    rates = result["throughput_tokens_per_s"]
    paired = result["paired_ratios_vs_off"]
    rounds = len(rates["off"])
    rows = [
        (label, *(f"{r:.0f}" for r in v), f"{common.median(v):.0f}") for label, v in rates.items()
    ]
    rows = [(*row, "") for row in rows]
    rows += [
        (
            f"{label} / off",
            *(f"{x:.3f}" for x in v),
            f"{common.median(v):.3f}",
            f"{100 * common.noise(v)['spread']:.0f}%",
        )
        for label, v in paired.items()
    ]
    cpu = result["cpu_s_per_ktok"]
    return (
        f"# Token-level recovery{' (quick)' if result['quick'] else ''}\n\n"
        + common.headline_table(result["headline"])
        + "\n\n## Crash\n\n"
        + common.markdown_table(
            [
                "max_tokens",
                "partial siblings",
                "tokens held",
                "lost after the cut",
                "killed after snapshot (s)",
                "token restore",
                "sibling restore",
            ],
            [
                (
                    crash["max_tokens"],
                    crash["partial_siblings"],
                    crash["partial_tokens_held"],
                    f"{crash['lost_after_snapshot']:.0f}",
                    f"{crash['kill_after_snapshot_s']:.2f}",
                    crash["token_restore"],
                    crash["sibling_restore"],
                )
            ],
        )
        + "\n\n## Committed tokens/s\n\n"
        + common.markdown_table(
            ["setting", *(f"round {i + 1}" for i in range(rounds)), "median", "spread"], rows
        )
        + "\n\nEach round runs the settings back to back in this order; a ratio row divides a "
        "setting's rate by the same round's `off`, and its spread is (highest - lowest) / "
        "median over the rounds: a ratio within its spread of 1 is noise.\n\n"
        "## CPU seconds per 1,000 committed tokens (median of rounds)\n\n"
        + common.markdown_table(
            ["setting", "service process", "vLLM engine processes"],
            [(label, f"{c['service']:.3f}", f"{c['engine']:.3f}") for label, c in cpu.items()],
        )
        + "\n\noff: granularity sibling, no checkpoints; streaming: granularity token, no "
        "checkpoints; on: granularity token, checkpoints every 2 s. vLLM's engine processes "
        "spin while they wait for work, so their figure counts that too.\n"
    )


def plot(result: dict[str, Any], path: Path) -> None:
    """Committed tokens/s of every run by round, and each round's ratio to ``off``."""
    plt = common.pyplot()
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for label, rates in result["throughput_tokens_per_s"].items():
        ax1.plot(range(1, len(rates) + 1), rates, "o-", label=label)
    for label, ratios in result["paired_ratios_vs_off"].items():
        ax2.plot(range(1, len(ratios) + 1), ratios, "o-", label=f"{label} / off")
    target = TARGETS["checkpoint_on_vs_off_quick" if result["quick"] else "checkpoint_on_vs_off"]
    ax2.axhline(target, color="grey", ls=":", label="target (on / off)")
    for ax, title in ((ax1, "committed tokens/s"), (ax2, "ratio to off, same round")):
        ax.set_xlabel("round")
        ax.set_xticks(range(1, len(result["throughput_tokens_per_s"]["off"]) + 1))
        ax.set_title(title)
        ax.legend()
    common.save_figure(fig, path)


if __name__ == "__main__":
    main()
