"""Token-level recovery: what a SIGKILL mid-generation costs with ``recovery.granularity: token``.

The real ``rolloutd serve`` runs vLLM on the tiny model on CPU (eager: see ``Service``), greedy
(temperature 0, float32), with a ``max_tokens`` long enough that siblings are mid-way when the
process is killed:

1. **Crash run** (granularity ``token``, checkpoints every 2 s). Once a snapshot holds partial
   siblings at least 60% of ``max_tokens`` long, the process is SIGKILLed 1 s after that
   snapshot's commit (the middle of the checkpoint interval). Meanwhile ``GetStatus`` is polled
   every 50 ms for the engine's cumulative generation tokens, so the tokens generated between the
   snapshot's cut and the kill (``lost_after_snapshot``: lost whatever the granularity) are known
   from the counter.
2. **Restores.** The store is copied once per setting, and each copy is restored by a service of
   its own, all started side by side: ``on`` (granularity ``token``, checkpoints every 2 s),
   ``off`` (granularity ``sibling``, no checkpoints) and, in the full run, ``streaming``
   (``token``, no checkpoints). Each logs what it did with the partial tokens the snapshot held,
   and a trainer fetches and acks what each delivers until every group of the snapshot is back.
   - ``token_reuse_fraction``: partial tokens of unfinished siblings the token restore continued
     from, over those the snapshot held.
   - ``regenerated_vs_sibling_mode``: tokens generated again after the restart, token over
     sibling mode, each ``lost_after_snapshot`` plus the partial tokens that restore discarded.
   - ``greedy_resume_identical``: every sibling ``on`` resumed starts with exactly the
     snapshot's tokens and logprobs, and equals token for token its twin, the same sibling
     (group, seed, settings) that ``off`` generated again from its start, uninterrupted.
3. **Throughput** (``checkpoint_on_vs_off``): the same services, restored from the same
   snapshot and past the same groups, go on with the dataset (shorter siblings) while their
   trainers fetch and ack: committed tokens/s, ``on`` versus ``off``. One service runs at a
   time; the others are frozen (SIGSTOP of the process group: the service and vLLM's engine
   processes take no CPU). A window thaws its service, warms up for one wave of commits (the
   groups the freeze caught mid-way), and runs from one commit to another over at least
   ``WAVES`` waves of the groups in flight and ``window_s``. A round measures every setting
   once, the order reversed every other round (off, on; on, off; ...), so that a round compares
   neighbouring windows and neither side always comes first after a switch; the figure is the
   median over rounds of each round's ``on / off``. ``streaming / off`` (full run) is the cost
   of streaming alone. Each window also gives the CPU seconds per 1,000 committed tokens of the
   service process and of vLLM's engine processes.

``--quick`` (meant to take about three minutes, most of it the vLLM starts of the crash run and
of the restores): siblings of at most 640 tokens, 80 in the throughput windows, four rounds over
windows of at least 4 s. The full run keeps 1920 tokens (960 in the windows), 45 s windows, and
adds ``streaming``. The 2 cores are shared with other work: single windows vary by ±10-25% here,
so every ratio is reported with its rounds and their spread (``*_noise`` in the JSON): a ratio
whose distance from 1 is within its spread is noise, not a result. The crash is one, so
``regenerated_vs_sibling_mode`` (which depends on how much was generated between the cut and
the kill) and ``token_reuse_fraction`` come from one round and have no spread to show.
"""

from __future__ import annotations

import json
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import common
import grpc
from _recovery_services import OFF, ON, STREAMING, Restored, Service, drain, throughput

from rolloutd.checkpoint.store import SnapshotStore
from rolloutd.engines.tiny_model import ensure_tiny_model
from rolloutd.v1 import rollout_pb2 as pb
from rolloutd.v1 import rollout_pb2_grpc as pb_grpc

NAME = "recovery"
CACHE = Path(__file__).resolve().parent.parent / ".rolloutd" / "cache"
"""Where the tiny model is built once and kept, as ``throughput.py`` does."""
MAX_TOKENS = 1920
MAX_TOKENS_QUICK = 640
KILL_AFTER_S = 1.0
"""The SIGKILL lands this long after a snapshot: the middle of the 2 s checkpoint interval."""
WAVES = 3
"""A throughput window spans at least this many waves of ``IN_FLIGHT`` committed groups."""
ROUNDS_QUICK = 4
ROUNDS_FULL = 3
"""Rounds of throughput windows; each round measures every setting once."""
TARGETS = {
    "token_reuse_fraction": 0.99,
    "regenerated_vs_sibling_mode": 0.2,
    "checkpoint_on_vs_off_quick": 0.97,
    "checkpoint_on_vs_off": 0.99,
}


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


def crash(work: Path, cache: Path, max_tokens: int, min_prefix: int) -> dict[str, Any]:
    """The crash run: returns the snapshot's figures and the tokens lost after it."""
    store_dir = work / "crash-store"
    service = Service(work, cache, "crash", store_dir, ON, max_tokens=max_tokens)
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


def compare(crashed: dict[str, Any], on: Restored, off: Restored) -> dict[str, int]:
    """Each sibling ``on`` resumed from the snapshot's partial tokens against its twin, the same
    sibling ``off`` generated again from its start."""
    identical = prefix_exact = 0
    for p in crashed["held"]:
        [s] = [s for s in on.delivered[p.group_id].samples if s.index == p.index]
        [twin] = [s for s in off.delivered[p.group_id].samples if s.index == p.index]
        n = len(p)
        prefix_exact += (
            s.resumed_at == n
            and list(s.token_ids[:n]) == p.token_ids().tolist()
            and list(s.logprobs[:n]) == p.logprobs().tolist()
        )
        identical += twin.resumed_at == 0 and list(s.token_ids) == list(twin.token_ids)
    return {"identical": identical, "prefix_exact": prefix_exact}


def restore_and_measure(
    work: Path,
    crashed: dict[str, Any],
    quick: bool,
    tokens: int,
    window_s: float,
) -> tuple[dict[str, dict[str, int]], dict[str, int], dict[str, list[dict[str, float]]]]:
    """Step 2 and 3: what each restore did with the partial tokens, the twins compared, and the
    throughput windows of every setting."""
    settings = [OFF, ON] if quick else [OFF, STREAMING, ON]
    groups = set(crashed["groups"])
    services = [Restored(work, CACHE, crashed["store"], groups, s, tokens) for s in settings]
    try:
        restored = {s.setting.label: s.start() for s in services}
        common.progress(f"restores: {restored}; delivering the snapshot's {len(groups)} groups")
        drain(services)
        twins = compare(crashed, services[-1], services[0])
        common.progress(
            f"{twins['identical']} of {len(crashed['held'])} resumed siblings equal their twin; "
            "throughput windows"
        )
        rounds = ROUNDS_QUICK if quick else ROUNDS_FULL
        runs = throughput(services, rounds, window_s, WAVES)
    finally:
        for s in services:
            s.close()
    return restored, twins, runs


def main() -> None:
    args = common.parse_args(__doc__.splitlines()[0])
    started = time.time()
    quick = args.quick
    # The tiny model has 2048 positions; with 32 siblings at once each takes several seconds, and
    # the kill lands when they are well into them, as it would for minutes-long rollouts.
    max_tokens = MAX_TOKENS_QUICK if quick else MAX_TOKENS
    min_prefix = int(max_tokens * 0.6)
    window_s = 4.0 if quick else 45.0
    # Siblings of the throughput windows: a quick window's waves take about two seconds each.
    throughput_tokens = max_tokens // 8 if quick else max_tokens // 2
    ensure_tiny_model(CACHE)
    with tempfile.TemporaryDirectory(prefix="rolloutd-recovery-") as tmp:
        work = Path(tmp)
        write_prompts(work / "prompts.jsonl", 256)
        crashed = crash(work, CACHE, max_tokens, min_prefix)
        restored, twins, runs = restore_and_measure(
            work, crashed, quick, throughput_tokens, window_s
        )
    token, sibling = restored["on"], restored["off"]
    held = sum(map(len, crashed["held"]))
    lost = crashed["lost_after_snapshot"]
    reused = token["reused"]
    reuse_fraction = reused / held if held else float("nan")
    regenerated_token = lost + token["regenerated"]
    regenerated_sibling = lost + sibling["regenerated"]
    vs_sibling = regenerated_token / regenerated_sibling
    n_held = len(crashed["held"])
    identical = twins["identical"] == n_held and twins["prefix_exact"] == n_held
    rates = {label: [r["tokens_per_s"] for r in v] for label, v in runs.items()}
    rate = {label: common.median(v) for label, v in rates.items()}
    # A round's sides are neighbouring windows, so its ratio compares windows measured under the
    # same outside load; the median over rounds drops a round that load disturbed.
    paired = {
        label: [a / b for a, b in zip(v, rates["off"], strict=True)]
        for label, v in rates.items()
        if label != "off"
    }
    on_vs_off = common.median(paired["on"])
    target_on = TARGETS["checkpoint_on_vs_off_quick" if quick else "checkpoint_on_vs_off"]
    once = "one crash: 1 round, no spread"
    headline = [
        common.headline(
            "token_reuse_fraction", reuse_fraction, "", f">= {TARGETS['token_reuse_fraction']}",
            reuse_fraction >= TARGETS["token_reuse_fraction"],
            f"{reused} of {held} partial tokens held by the snapshot; {once}",
        ),
        common.headline(
            "regenerated_vs_sibling_mode", vs_sibling, "",
            f"<= {TARGETS['regenerated_vs_sibling_mode']}",
            vs_sibling <= TARGETS["regenerated_vs_sibling_mode"],
            f"{regenerated_token:.0f} vs {regenerated_sibling:.0f} tokens "
            f"({lost:.0f} generated after the cut, lost in both); {once}",
        ),
        common.headline(
            "greedy_resume_identical", float(identical), "", "true", identical,
            f"{twins['identical']} of {n_held} resumed siblings equal their twin generated "
            f"again from its start; {twins['prefix_exact']} start with exactly the snapshot's "
            "tokens and logprobs",
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
            "token_restore": token,
            "sibling_restore": sibling,
        },
        "throughput_tokens_per_s": rates,
        "paired_ratios_vs_off": paired,
        "streaming_vs_off": common.median(paired["streaming"]) if "streaming" in paired else None,
        "checkpoint_on_vs_off_noise": common.noise(paired["on"]),
        "streaming_vs_off_noise": (
            common.noise(paired["streaming"]) if "streaming" in paired else None
        ),
        "token_reuse_fraction_noise": once,
        "regenerated_vs_sibling_mode_noise": once,
        "window_s": window_s,
        "waves": WAVES,
        "throughput_max_tokens": throughput_tokens,
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
        + "\n\nA round measures each setting once, one window after another, in this order and "
        "in the reverse order every other round; a ratio row divides a setting's rate by the "
        "same round's `off`, and its spread is (highest - lowest) / median over the rounds: a "
        "ratio within its spread of 1 is noise. Windows of at least "
        f"{result['window_s']:.0f} s and {result['waves']} waves of commits, siblings of "
        f"{result['throughput_max_tokens']} tokens.\n\n"
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
