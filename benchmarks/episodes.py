"""Episodes: multi-turn samples resumed turn by turn after SIGKILLs, and what durable turns cost.

The real ``rolloutd serve`` runs vLLM on the tiny model on CPU, greedy (temperature 0, float32),
with the environment ``_environments:Deterministic``: 3 model turns an episode, each tool answer
a function of the completion alone, every ``step`` call appended to a log file before it answers
(the line survives a SIGKILL of the service).

1. **Control and crash runs** (started side by side, so that their vLLM starts overlap): 8 groups
   of 4 siblings (32 episodes), one epoch. The control run is never interrupted. The crash run is
   SIGKILLed ``KILLS`` times (``--quick``: once), each time after a random number of live ``step``
   calls since its start (seeded), and restarted with ``--restore latest``; a trainer thread
   fetches and acks throughout. From the environment's log, the delivered groups and the
   restored services' ``/metrics``:
   - ``episodes``, ``turns_total``: delivered episodes of the crash run and their model turns;
   - ``turns_reused_after_restore``: turns each restore took from the store (the service's turn
     recovery counter, disposition ``reused``), summed over restores;
   - ``turns_generated_again``: turns that were durable at a kill, yet not reused by the restore
     that followed: the turns whose ``step`` the environment saw called live before the kill
     (a turn's tokens are durable before its step is called) minus the turns reused, when
     positive. Target 0;
   - ``step_calls_repeated_with_other_completion``: ``(episode, turn)`` keys whose live calls
     carried different completions. Target 0. ``step_calls_repeated`` (same completion: the call
     running when the process died) is reported beside it, with its bound: the episodes in
     flight at each kill;
   - ``greedy_resume_identical``: every crash-run episode equals its control twin token for
     token, mask for mask;
   - ``retokenization_mismatches``: summed over every delivered episode of both runs (target 0);
   - ``groups_delivered_twice``: group ids acked twice, or prompts delivered in two groups (0).
2. **Throughput** (``durable_turns_on_vs_off``): completed episodes/s while a trainer fetches
   and acks, ``episodes.durable_turns`` true versus false, one service per setting started side
   by side, the one not being measured frozen (SIGSTOP of its process group). Each round
   measures both back to back over a window after a warm-up; the figure is the median over
   rounds of each round's ``on / off``, reported with the rounds and their spread (a ratio within
   its spread of 1 is noise). Target >= 0.95.

``--quick`` (about three minutes): one kill, three rounds of 10 s windows. The full run: three
kills, five rounds of 30 s windows.
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import tempfile
import threading
import time
import urllib.request
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

import common
import yaml

from rolloutd.client import RolloutClient
from rolloutd.engines.tiny_model import ensure_tiny_model
from rolloutd.v1 import rollout_pb2 as pb

NAME = "episodes"
GROUPS = 8
GROUP_SIZE = 4
TURNS = 3
TURN_TOKENS = 24
"""``max_tokens`` of one model turn."""
KILLS, KILLS_QUICK = 3, 1
STEPS_BEFORE_KILL = (6, 30)
"""A kill comes after this many (uniformly drawn) live step calls since the service started."""
ROUNDS, ROUNDS_QUICK = 5, 3
WINDOW_S, WINDOW_S_QUICK = 30.0, 10.0
SEED = 27
TARGET_ON_VS_OFF = 0.95
RECOVERY_TURNS = re.compile(
    r'^(rolloutd_\w*turns?\w*)\{[^}]*disposition="(?P<disposition>\w+)"[^}]*\}\s+(?P<value>\S+)',
    re.M,
)
"""The service's counter of turns recovered after a restore, by disposition (``reused``,
``rerun``), as ``/metrics`` serves it."""


def service_config(work: Path, label: str, *, prompts: Path, durable: bool, epochs: int | None):
    """The service's YAML for one run."""
    config: dict[str, Any] = {
        "engine": {
            "kind": "vllm",
            "cache_dir": str(work / "cache"),
            "max_tokens": TURN_TOKENS,
            "temperature": 0.0,
            "vllm": {
                "dtype": "float32",
                "max_model_len": 1024,
                "kv_cache_memory_gib": 1,
                "log_path": str(work / f"vllm-{label}.log"),
            },
        },
        "dataset": {"path": str(prompts), "epochs": epochs},
        "group_size": GROUP_SIZE,
        "limits": {"max_in_flight": GROUPS, "buffer_capacity": 2 * GROUPS},
        "episodes": {
            "environment": "_environments:Deterministic",
            "environment_config": {"log": str(work / f"steps-{label}.jsonl"), "turns": TURNS},
            "max_turns": TURNS + 1,
            "max_total_tokens": 1024,
            "step_timeout_s": 30.0,
            "durable_turns": durable,
        },
        "checkpoint": {"dir": str(work / f"store-{label}"), "interval_s": 2.0},
        "grpc": {"host": "127.0.0.1", "port": 0},
        "http": {"host": "127.0.0.1", "port": 0},
    }
    path = work / f"{label}.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


class Service(common.Serve):
    """``rolloutd serve --config FILE`` with ``benchmarks/`` on its path (the environment)."""

    def __init__(self, work: Path, config: Path, log_name: str, restore: str = "none") -> None:
        here = str(Path(__file__).resolve().parent)
        path = os.pathsep.join(p for p in (here, os.environ.get("PYTHONPATH")) if p)
        env = {"OTEL_SDK_DISABLED": "true", "VLLM_CPU_KVCACHE_SPACE": "1", "PYTHONPATH": path}
        args = ["--config", str(config), "--restore", restore]
        super().__init__(args, env, work, work / f"serve-{log_name}.log")

    def recovered_turns(self) -> dict[str, float]:
        """The turn recovery counter by disposition, from ``/metrics``."""
        with urllib.request.urlopen(f"http://{self.http}/metrics", timeout=30) as response:
            text = response.read().decode()
        found: dict[str, float] = defaultdict(float)
        for m in RECOVERY_TURNS.finditer(text):
            found[m["disposition"]] += float(m["value"])
        return dict(found)


class Trainer:
    """Fetches and acks in a thread; remembers every group acked."""

    def __init__(self, address: str) -> None:
        self.acked: list[pb.Group] = []
        self._client = RolloutClient(address, retries=1, timeout_s=30)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                lease = self._client.fetch(max_groups=GROUPS, wait_ms=500)
                if lease is not None:
                    self._client.ack(lease, trainer_step=1)
                    self.acked += lease.groups
            except Exception:  # the service was killed under the call
                if not self._stop.wait(0.2):
                    continue

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(60)
        self._client.close()


def write_prompts(path: Path, n: int) -> None:
    path.write_text(
        "".join(
            json.dumps({"id": f"q{i}", "prompt": f"Question {i}: what is {i} plus {3 * i}?"}) + "\n"
            for i in range(n)
        )
    )


def step_calls(log: Path) -> list[dict[str, Any]]:
    if not log.exists():
        return []
    return [json.loads(line) for line in log.read_text().splitlines() if line.strip()]


def wait_for(what: str, check: Any, timeout_s: float = 900.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            common.fail(f"not within {timeout_s:.0f} s: {what}")
        time.sleep(0.05)


def control_and_crash(work: Path, kills: int) -> dict[str, Any]:
    """Both runs (see the module docstring); returns what their figures are made of."""
    rng = random.Random(SEED)
    prompts = work / "prompts.jsonl"
    write_prompts(prompts, GROUPS)
    control_cfg = service_config(work, "control", prompts=prompts, durable=True, epochs=1)
    crash_cfg = service_config(work, "crash", prompts=prompts, durable=True, epochs=1)
    control = Service(work, control_cfg, "control")
    crash = Service(work, crash_cfg, "crash-0")
    control.wait_listening(900.0, poll_s=0.2)
    control_trainer = Trainer(control.address)
    steps_log = work / "steps-crash.jsonl"
    acked: list[pb.Group] = []
    kills_at: list[dict[str, Any]] = []
    recovered: list[dict[str, float]] = []
    for life in range(kills + 1):
        if life:
            crash = Service(work, crash_cfg, f"crash-{life}", restore="latest")
        crash.wait_listening(900.0, poll_s=0.2)
        trainer = Trainer(crash.address)

        def delivered(t: Trainer = trainer, before: list[pb.Group] = acked) -> bool:
            return len({g.prompt_id for g in [*before, *t.acked]}) >= GROUPS

        kill = life < kills
        if kill:
            after = len(step_calls(steps_log)) + rng.randint(*STEPS_BEFORE_KILL)
            wait_for(
                f"{after} step calls",
                lambda n=after: len(step_calls(steps_log)) >= n or delivered(),
            )
            kill = not delivered()  # a run that ended first is not killed again
            time.sleep(rng.uniform(0.0, 0.3))
        if not kill:
            wait_for(f"{GROUPS} groups delivered", delivered)
        if life:  # what the restore that started this life recovered
            recovered.append(crash.recovered_turns())
        if kill:
            crash.kill()
            kills_at.append({"life": life, "step_calls": len(step_calls(steps_log))})
            common.progress(f"kill {life + 1}: SIGKILL after {kills_at[-1]['step_calls']} calls")
        else:
            crash.stop(120.0)
        trainer.stop()
        acked.extend(trainer.acked)
        if not kill:
            break
    wait_for(f"{GROUPS} control groups", lambda: len(control_trainer.acked) >= GROUPS)
    control_trainer.stop()
    control.stop(120.0)
    return {
        "acked": acked,
        "control": control_trainer.acked,
        "calls": step_calls(steps_log),
        "kills": kills_at,
        "recovered": recovered,
    }


def crash_figures(run: dict[str, Any]) -> dict[str, Any]:
    acked: list[pb.Group] = run["acked"]
    group_ids = Counter(g.group_id for g in acked)
    by_prompt: dict[str, pb.Group] = {}
    for g in acked:
        by_prompt.setdefault(g.prompt_id, g)
    twice = sum(n - 1 for n in group_ids.values()) + (len(group_ids) - len(by_prompt))
    control = {g.prompt_id: g for g in run["control"]}
    identical = sum(
        list(s.token_ids) == list(c.token_ids) and list(s.loss_mask) == list(c.loss_mask)
        for p, g in by_prompt.items()
        for s, c in zip(g.samples, control[p].samples, strict=True)
    )
    samples = [s for g in by_prompt.values() for s in g.samples]
    mismatches = sum(
        s.retokenization_mismatches for g in [*acked, *run["control"]] for s in g.samples
    )
    # the environment's log: live calls by key; at each kill, the turns of unfinished episodes
    # whose step had been called (their tokens were durable: at least these must be reused)
    live: dict[tuple[str, int], list[str]] = defaultdict(list)
    for call in run["calls"]:
        if not call["replay"]:
            live[call["episode_id"], call["turn"]].append(call["completion"])
    other_completion = sum(len(set(c)) > 1 for c in live.values())
    repeated = sum(len(c) - 1 for c in live.values())
    durable_at_kill = []
    for kill in run["kills"]:
        before = {(c["episode_id"], c["turn"]) for c in run["calls"][: kill["step_calls"]]}
        finished = {e for e, turn in before if turn == TURNS - 1}
        durable_at_kill.append(sum(e not in finished for e, _ in before))
    reused = [r.get("reused", 0.0) for r in run["recovered"]]
    again = sum(max(0.0, d - r) for d, r in zip(durable_at_kill, reused, strict=False))
    return {
        "episodes": len(samples),
        "turns_total": sum(_kinds(s).count("model") for s in samples),
        "turns_reused_after_restore": sum(reused),
        "turns_rerun_after_restore": sum(r.get("rerun", 0.0) for r in run["recovered"]),
        "turns_generated_again": again,
        "turns_durable_at_kill": durable_at_kill,
        "step_calls_repeated_with_other_completion": other_completion,
        "step_calls_repeated": repeated,
        "greedy_resume_identical": identical == len(samples) and len(by_prompt) == GROUPS,
        "episodes_identical": identical,
        "retokenization_mismatches": mismatches,
        "groups_delivered_twice": twice,
        "kills": run["kills"],
        "recovered_turns": run["recovered"],
    }


def _kinds(sample: pb.Sample) -> list[str]:
    """The kinds of ``turn_starts`` as lower-case names (``model``, ``environment``)."""
    out = []
    for turn in sample.turn_starts:
        kind: Any = turn.kind
        if isinstance(kind, int):
            enum = turn.DESCRIPTOR.fields_by_name["kind"].enum_type
            kind = enum.values_by_number[kind].name
        out.append(str(kind).lower().rsplit("kind_", 1)[-1])
    return out


class Generator:
    """A throughput service and its trainer; frozen (SIGSTOP) while the other one is measured."""

    def __init__(self, work: Path, label: str, durable: bool) -> None:
        prompts = work / "prompts-throughput.jsonl"
        if not prompts.exists():
            write_prompts(prompts, 4096)
        config = service_config(work, label, prompts=prompts, durable=durable, epochs=None)
        self.label = label
        self.service = Service(work, config, label)
        self.trainer: Trainer | None = None

    def start(self) -> None:
        self.service.wait_listening(900.0, poll_s=0.2)
        self.trainer = Trainer(self.service.address)

    def freeze(self) -> None:
        os.killpg(self.service.proc.pid, signal.SIGSTOP)

    def thaw(self) -> None:
        os.killpg(self.service.proc.pid, signal.SIGCONT)

    def close(self) -> None:
        self.thaw()
        if self.trainer is not None:
            self.trainer.stop()
        self.service.stop(120.0)

    def measure(self, window_s: float) -> float:
        """Completed episodes/s over ``window_s`` after a warm-up of a quarter of it."""
        time.sleep(window_s / 4)
        with RolloutClient(self.service.address) as client:

            def committed() -> tuple[float, int]:
                status = client.status_of(self.service.address)
                return time.monotonic(), status.counters.committed_groups

            t0, g0 = committed()
            time.sleep(window_s)
            t1, g1 = committed()
        rate = (g1 - g0) * GROUP_SIZE / (t1 - t0)
        common.progress(f"{self.label}: {rate:.2f} episodes/s over {t1 - t0:.0f} s")
        return rate


def throughput(work: Path, rounds: int, window_s: float) -> dict[str, list[float]]:
    generators = [Generator(work, "off", False), Generator(work, "on", True)]
    runs: dict[str, list[float]] = {g.label: [] for g in generators}
    try:
        for g in generators:
            g.start()
            g.freeze()
        for r in range(rounds):
            order = generators if r % 2 == 0 else generators[::-1]  # neither always goes first
            for g in order:
                g.thaw()
                runs[g.label].append(g.measure(window_s))
                g.freeze()
    finally:
        for g in generators:
            g.close()
    return runs


def main() -> None:
    args = common.parse_args(__doc__.splitlines()[0])
    started = time.time()
    kills = KILLS_QUICK if args.quick else KILLS
    rounds = ROUNDS_QUICK if args.quick else ROUNDS
    window_s = WINDOW_S_QUICK if args.quick else WINDOW_S
    with tempfile.TemporaryDirectory(prefix="rolloutd-episodes-") as tmp:
        work = Path(tmp)
        ensure_tiny_model(work / "cache")
        figures = crash_figures(control_and_crash(work, kills))
        runs = throughput(work, rounds, window_s)
    paired = [on / off for on, off in zip(runs["on"], runs["off"], strict=True) if off]
    on_vs_off = common.median(paired) if paired else float("nan")
    f = figures
    headline = [
        common.headline("episodes", f["episodes"], "", f"{GROUPS * GROUP_SIZE}",
                        f["episodes"] == GROUPS * GROUP_SIZE,
                        f"{f['turns_total']} model turns; {kills} SIGKILLs"),
        common.headline("turns_reused_after_restore", f["turns_reused_after_restore"], "", "-",
                        None, f"durable at each kill (at least): {f['turns_durable_at_kill']}"),
        common.headline("turns_generated_again", f["turns_generated_again"], "", "0",
                        f["turns_generated_again"] == 0, "durable turns not reused"),
        common.headline("step_calls_repeated_with_other_completion",
                        f["step_calls_repeated_with_other_completion"], "", "0",
                        f["step_calls_repeated_with_other_completion"] == 0,
                        f"{f['step_calls_repeated']} repeated with the same completion"),
        common.headline("greedy_resume_identical", float(f["greedy_resume_identical"]), "",
                        "true", f["greedy_resume_identical"],
                        f"{f['episodes_identical']} of {f['episodes']} equal their control twin"),
        common.headline("retokenization_mismatches", f["retokenization_mismatches"], "", "0",
                        f["retokenization_mismatches"] == 0, "both runs"),
        common.headline("groups_delivered_twice", f["groups_delivered_twice"], "", "0",
                        f["groups_delivered_twice"] == 0, ""),
        common.headline("durable_turns_on_vs_off", on_vs_off, "", f">= {TARGET_ON_VS_OFF}",
                        on_vs_off >= TARGET_ON_VS_OFF,
                        f"{common.noise_note(paired) if paired else 'no rounds'}; medians "
                        f"{common.median(runs['on']):.2f} vs {common.median(runs['off']):.2f} "
                        "episodes/s"),
    ]  # fmt: skip
    result = {
        "benchmark": NAME,
        "quick": args.quick,
        "headline": headline,
        **figures,
        "durable_turns_on_vs_off": on_vs_off,
        "durable_turns_on_vs_off_noise": common.noise(paired) if paired else None,
        "episodes_per_s": runs,
        "window_s": window_s,
        "conditions": common.conditions(started),
    }
    common.publish(result, args.json, NAME, markdown(result), plot)


def markdown(result: dict[str, Any]) -> str:
    runs = result["episodes_per_s"]
    rows = [
        (label, *(f"{r:.2f}" for r in v), f"{common.median(v):.2f}") for label, v in runs.items()
    ]
    paired = [on / off for on, off in zip(runs["on"], runs["off"], strict=True) if off]
    if paired:
        rows.append(("on / off", *(f"{x:.3f}" for x in paired), f"{common.median(paired):.3f}"))
    return (
        f"# Episodes{' (quick)' if result['quick'] else ''}\n\n"
        + common.headline_table(result["headline"])
        + "\n\n## Completed episodes/s, durable turns on and off\n\n"
        + common.markdown_table(
            ["setting", *(f"round {i + 1}" for i in range(len(runs["on"]))), "median"], rows
        )
        + "\n\nEach round measures both settings back to back (alternating which goes first); "
        "the ratio row divides the same round's rates.\n"
    )


def plot(result: dict[str, Any], path: Path) -> None:
    plt = common.pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    for label, rates in result["episodes_per_s"].items():
        ax.plot(range(1, len(rates) + 1), rates, "o-", label=f"durable turns {label}")
    ax.set_xlabel("round")
    ax.set_ylabel("completed episodes/s")
    ax.legend()
    common.save_figure(fig, path)


if __name__ == "__main__":
    main()
