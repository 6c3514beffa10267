"""Episodes: multi-turn samples resumed turn by turn after SIGKILLs, and what durable turns cost.

The real ``rolloutd serve`` runs vLLM on the tiny model on CPU, greedy (temperature 0, float32),
with the environment ``_environments:Deterministic``: 3 model turns an episode, each tool answer
a function of the completion alone, every ``step`` call appended to a log file before it answers
(the line survives a SIGKILL of the service).

1. **Control and crash runs** (started side by side, so that their vLLM starts overlap): 8 groups
   of 4 siblings (32 episodes), one epoch. The control run is never interrupted. The crash run is
   SIGKILLed ``KILLS`` times (``--quick``: once), each once the environment has seen a number of
   live ``step`` calls drawn at random (seeded, ``KILL_AFTER_STEPS``), and restarted with
   ``--restore latest``; a trainer thread fetches and acks throughout. From the environment's
   log, the killed service's store, the delivered groups and the restored services'
   ``/metrics``:
   - ``episodes``, ``turns_total``: delivered episodes of the crash run and their model turns;
   - ``turns_reused_after_restore``: turns each restore took from the store (the service's
     counter ``rolloutd_episode_recovered_turns_total{disposition="reused"}``), summed over
     restores; null when the service does not serve that counter;
   - ``turns_generated_again``: turns that were durable at a kill, yet not reused by the restore
     that followed. What was durable is read from the killed service's store (the newest
     snapshot's partials file and the journal after it: every model turn and step record of a
     group not acked) before the restart. Two counts, the larger is the figure: the durable
     turns minus the turns the restore reused (the counter above), and the durable *steps*
     whose ``(prompt, sibling, turn)`` the environment then saw called live again (a turn
     generated again, or a group admitted afresh, calls its step again; a durable step is
     replayed, ``replay: true``, never called live). Without the counter only the second
     count is there, and the durable turns whose step was not durable yet (at most one per
     episode in flight) are reported as ``turns_unchecked``. Target 0;
   - ``step_calls_repeated_with_other_completion``: ``(episode, turn)`` keys whose live calls
     carried different completions. Target 0. ``step_calls_repeated`` (same completion: the call
     running when the process died) is reported beside it, with its bound: the episodes in
     flight at each kill;
   - ``greedy_resume_identical``: every crash-run episode equals its control twin token for
     token, mask for mask;
   - ``retokenization_mismatches``: summed over every delivered episode of both runs (target 0);
   - ``groups_delivered_twice``: group ids acked twice, or prompts delivered in two groups (0).
2. **Throughput** (``durable_turns_on_vs_off``): episodes/s while a trainer fetches and acks,
   ``episodes.durable_turns`` true versus false, one service per setting, started beside the
   control and crash runs and frozen (SIGSTOP of its process group) as soon as it listens and
   whenever the other one is measured. Each round measures both back to back over a window
   after a warm-up: the engine's generated tokens over the window divided by an episode's model
   tokens (the control run's mean), since episodes finish in step with each other, in bursts a
   short window may miss. The figure is the median over rounds of each round's ``on / off``,
   reported with the rounds and their spread (a ratio within its spread of 1 is noise). Target
   >= 0.95.

``--quick`` (about four minutes on an idle 2-core machine, mostly vLLM starts, eager as in
``throughput.py``): one kill, five rounds of 8 s windows. The full run: three kills, five
rounds of 60 s windows.
"""

from __future__ import annotations

import contextlib
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
from dataclasses import replace
from pathlib import Path
from typing import Any

import common
import yaml

from rolloutd.checkpoint.store import SnapshotStore
from rolloutd.client import Lease, RolloutClient
from rolloutd.domain.episode_log import RecordKind
from rolloutd.domain.journal import JournaledAck, JournaledEpisode
from rolloutd.engines.tiny_model import ensure_tiny_model
from rolloutd.v1 import rollout_pb2 as pb

NAME = "episodes"
GROUPS = 8
GROUP_SIZE = 4
TURNS = 3
TURN_TOKENS = 24
"""``max_tokens`` of one model turn."""
KILLS, KILLS_QUICK = 3, 1
KILL_AFTER_STEPS = (6, 80)
"""The kills come as soon as the environment has seen so many live step calls in all, drawn
without replacement from this range and sorted: the episodes' 96 steps (3 turns of 32 episodes,
in step with each other) have their first turn's in flight at 6-31, and two turns durable from
64. A kill in the last turn's burst of steps, later than 80, may come when every episode has
ended (on an idle machine an epoch takes two seconds)."""
ROUNDS, ROUNDS_QUICK = 5, 5
WINDOW_S, WINDOW_S_QUICK = 60.0, 8.0
SEED = 27
TARGET_ON_VS_OFF = 0.95
RECOVERY_TURNS = re.compile(
    r'^rolloutd_episode_recovered_turns_total\{[^}]*disposition="(?P<disposition>\w+)"[^}]*\}'
    r"\s+(?P<value>\S+)",
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
                "enforce_eager": True,  # as in throughput.py: a faster start, the same decode
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

    def recovered_turns(self) -> dict[str, float] | None:
        """The turn recovery counter by disposition, from ``/metrics`` (None: not served)."""
        with urllib.request.urlopen(f"http://{self.http}/metrics", timeout=30) as response:
            text = response.read().decode()
        found: dict[str, float] = defaultdict(float)
        for m in RECOVERY_TURNS.finditer(text):
            found[m["disposition"]] += float(m["value"])
        return dict(found) if found else None


class Trainer:
    """Fetches and acks in a thread; remembers every group acked. A lease received whose ack a
    kill cut off stays ``pending`` and is acked first by the next life's trainer, as a real
    trainer does: the restored service takes the ack of a lease it granted before the kill."""

    def __init__(self, address: str, pending: list[Lease] | None = None) -> None:
        self.acked: list[pb.Group] = []
        # the restarted service listens on another port: the same lease, acked there
        self.pending: list[Lease] = [replace(p, endpoint=address) for p in pending or []]
        self._client = RolloutClient(address, retries=1, timeout_s=30)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                while self.pending:
                    self._client.ack(self.pending[0], trainer_step=1)
                    self.acked += self.pending.pop(0).groups
                lease = self._client.fetch(max_groups=GROUPS, wait_ms=500)
                if lease is not None:
                    self.pending.append(lease)
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


def env_calls(log: Path) -> list[dict[str, Any]]:
    """The environment's log: one line per ``reset`` and ``step`` call, in order."""
    if not log.exists():
        return []
    return [json.loads(line) for line in log.read_text().splitlines() if line.strip()]


def live_steps(log: Path) -> int:
    return sum(c["call"] == "step" and not c["replay"] for c in env_calls(log))


def durable_on_disk(store: Path, acked: set[int]) -> dict[str, Any]:
    """The episode records a killed service's store holds, as a restore reads them: the newest
    snapshot's partials file and the journal after it. Keys ``[episode_id, turn]`` of the model
    turns and steps of groups not acked (neither by the trainer nor in the journal)."""
    found = SnapshotStore(str(store))
    newest = next(iter(found.list()), None)
    held: dict[tuple[int, int], list[Any]] = defaultdict(list)
    if newest is not None:
        for p in found.read_partials(newest):
            held[p.group_id, p.index].extend(p.episode_records)
    acked = set(acked)
    for event in found.journal.events_after(newest.acks_through if newest else 0):
        if isinstance(event, JournaledEpisode):
            held[event.group_id, event.index].append(event.record)
        elif isinstance(event, JournaledAck):
            acked.update(event.record.group_ids)
    keys: dict[RecordKind, set[tuple[str, int]]] = {RecordKind.TURN: set(), RecordKind.STEP: set()}
    for (group, index), records in held.items():
        if group not in acked:
            for r in records:
                keys.get(r.kind, set()).add((f"g{group}-s{index}", r.turn))
    return {
        "snapshot": newest.sequence if newest is not None else None,
        "turns": sorted(keys[RecordKind.TURN]),
        "steps": sorted(keys[RecordKind.STEP]),
    }


def wait_for(what: str, check: Any, timeout_s: float = 900.0, every_s: float = 30.0) -> None:
    """Until ``check()``; a progress line every ``every_s`` that says what it waits for."""
    started = time.monotonic()
    shown = started
    while not check():
        now = time.monotonic()
        if now > started + timeout_s:
            common.fail(f"not within {timeout_s:.0f} s: {what}")
        if now > shown + every_s:
            shown = now
            common.progress(f"waiting {now - started:.0f} s for {what}")
        time.sleep(0.05)


def listening(service: Service, label: str) -> None:
    """Until ``service`` listens (its vLLM start: minutes on a loaded CPU), with progress."""
    started = time.monotonic()
    common.progress(f"{label}: starting rolloutd serve (vLLM on the tiny model)")
    wait_for(
        f"{label} to listen",
        lambda: (
            common.LISTENING.search(service.log_path.read_text())
            or (service.proc.poll() is not None)
        ),
    )
    service.wait_listening(60.0, poll_s=0.2)  # reads the addresses, or fails with the log
    common.progress(f"{label}: listening after {time.monotonic() - started:.0f} s")


def control_and_crash(work: Path, kills: int) -> dict[str, Any]:
    """Both runs (see the module docstring); returns what their figures are made of."""
    rng = random.Random(SEED)
    kill_after = sorted(rng.sample(range(*KILL_AFTER_STEPS), kills))
    prompts = work / "prompts.jsonl"
    write_prompts(prompts, GROUPS)
    control_cfg = service_config(work, "control", prompts=prompts, durable=True, epochs=1)
    crash_cfg = service_config(work, "crash", prompts=prompts, durable=True, epochs=1)
    control = Service(work, control_cfg, "control")
    crash = Service(work, crash_cfg, "crash-0")
    listening(control, "control run")
    control_trainer = Trainer(control.address)
    steps_log = work / "steps-crash.jsonl"
    store = work / "store-crash"
    acked: list[pb.Group] = []
    kills_at: list[dict[str, Any]] = []
    recovered: list[dict[str, float] | None] = []
    carried: list[Lease] = []
    """Leases the killed life's trainer received but could not ack."""
    for life in range(kills + 1):
        if life:
            crash = Service(work, crash_cfg, f"crash-{life}", restore="latest")
        listening(crash, f"crash run, life {life + 1}")
        trainer = Trainer(crash.address, carried)

        def delivered(t: Trainer = trainer, before: list[pb.Group] = acked) -> bool:
            return len({g.prompt_id for g in [*before, *t.acked]}) >= GROUPS

        kill = life < kills
        if kill:
            after = kill_after[life]
            wait_for(
                f"{after} step calls",
                lambda n=after: live_steps(steps_log) >= n or delivered(),
            )
            kill = not delivered()  # a run that ended first is not killed again
        if not kill:
            wait_for(f"crash run: {GROUPS} groups delivered", delivered)
        if life:  # what the restore that started this life recovered
            recovered.append(crash.recovered_turns())
        if kill:
            crash.kill()
            trainer.stop()
            acked.extend(trainer.acked)
            carried = trainer.pending
            calls = env_calls(steps_log)
            durable = durable_on_disk(store, {g.group_id for g in acked})
            kills_at.append({"life": life, "calls": len(calls), **durable})
            common.progress(
                f"kill {life + 1}: SIGKILL after {live_steps(steps_log)} live step calls; "
                f"{len(durable['turns'])} turns and {len(durable['steps'])} steps durable"
            )
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
        "calls": env_calls(steps_log),
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
    controls = [s for g in run["control"] for s in g.samples]
    mismatches = sum(
        s.retokenization_mismatches for g in [*acked, *run["control"]] for s in g.samples
    )
    calls = run["calls"]
    live: dict[tuple[str, int], list[str]] = defaultdict(list)
    for call in calls:
        if call["call"] == "step" and not call["replay"]:
            live[call["episode_id"], call["turn"]].append(call["completion"])
    other_completion = sum(len(set(c)) > 1 for c in live.values())
    repeated = sum(len(c) - 1 for c in live.values())
    # an episode id's (prompt, sibling), from its resets: a group admitted afresh after a
    # restore has new episode ids for the same prompt's siblings
    resets = {
        c["episode_id"]: (c["prompt_id"], c["sibling"]) for c in calls if c["call"] == "reset"
    }

    def who(episode_id: str) -> tuple[str, int]:
        return resets.get(episode_id, (episode_id, -1))

    per_kill = []
    ends = [k["calls"] for k in run["kills"][1:]] + [len(calls)]
    for kill, end, reused in zip(run["kills"], ends, run["recovered"], strict=True):
        after = [c for c in calls[kill["calls"] : end] if c["call"] == "step"]
        live_after = {(*who(c["episode_id"]), c["turn"]) for c in after if not c["replay"]}
        replayed = {(*who(c["episode_id"]), c["turn"]) for c in after if c["replay"]}
        turns = {(*who(e), t) for e, t in kill["turns"]}
        steps = {(*who(e), t) for e, t in kill["steps"]}
        stepped_again = len(steps & live_after)
        n_reused = None if reused is None else reused.get("reused", 0.0)
        per_kill.append({
            "turns_durable": len(turns),
            "steps_durable": len(steps),
            "steps_replayed": len(steps & replayed),
            "durable_steps_called_live_again": stepped_again,
            "turns_reused": n_reused,
            "turns_rerun": None if reused is None else reused.get("rerun", 0.0),
            "turns_generated_again": max(
                stepped_again, 0 if n_reused is None else len(turns) - n_reused
            ),
            "turns_unchecked": len(turns - steps) if n_reused is None else 0,
        })  # fmt: skip
    counter = all(k["turns_reused"] is not None for k in per_kill)
    return {
        "episodes": len(samples),
        "turns_total": sum(_kinds(s).count("model") for s in samples),
        "model_tokens_per_episode": sum(sum(s.loss_mask) for s in controls) / len(controls),
        "turns_reused_after_restore": sum(k["turns_reused"] for k in per_kill) if counter else None,
        "turns_rerun_after_restore": sum(k["turns_rerun"] for k in per_kill) if counter else None,
        "turns_generated_again": sum(k["turns_generated_again"] for k in per_kill),
        "turns_unchecked": sum(k["turns_unchecked"] for k in per_kill),
        "turns_durable_at_kill": [k["turns_durable"] for k in per_kill],
        "steps_durable_at_kill": [k["steps_durable"] for k in per_kill],
        "durable_steps_called_live_again": sum(
            k["durable_steps_called_live_again"] for k in per_kill
        ),
        "per_kill": per_kill,
        "step_calls_repeated_with_other_completion": other_completion,
        "step_calls_repeated": repeated,
        "greedy_resume_identical": identical == len(samples) and len(by_prompt) == GROUPS,
        "episodes_identical": identical,
        "retokenization_mismatches": mismatches,
        "groups_delivered_twice": twice,
        "kills": [{"life": k["life"], "snapshot": k["snapshot"]} for k in run["kills"]],
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
    """A throughput service and its trainer; frozen (SIGSTOP) as soon as it listens, and while
    the other one is measured. Its vLLM start overlaps the control and crash runs."""

    def __init__(self, work: Path, label: str, durable: bool) -> None:
        prompts = work / "prompts-throughput.jsonl"
        if not prompts.exists():
            write_prompts(prompts, 4096)
        config = service_config(work, label, prompts=prompts, durable=durable, epochs=None)
        self.label = label
        self.service = Service(work, config, label)
        self.trainer: Trainer | None = None
        self._listening = threading.Thread(target=self._freeze_once_listening, daemon=True)
        self._listening.start()

    def _freeze_once_listening(self) -> None:
        with contextlib.suppress(SystemExit):  # start() says so
            listening(self.service, f"durable turns {self.label}")
            self.freeze()

    def start(self) -> None:
        self._listening.join()
        if not self.service.address:
            common.fail(f"durable turns {self.label}: rolloutd did not start")
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

    def measure(self, window_s: float, tokens_per_episode: float) -> float:
        """Episodes/s over ``window_s`` after a warm-up of a quarter of it: the engine's
        generated tokens over the window (a counter that moves with every engine step) divided
        by an episode's model tokens. Episodes finish in step with each other, in bursts a
        window of seconds may hold none of; what durable turns cost (the engine idle while a
        turn is journaled and its step runs) shows in the token rate all the same."""
        time.sleep(window_s / 4)
        with RolloutClient(self.service.address) as client:

            def counters() -> tuple[float, int, int]:
                c = client.status_of(self.service.address).counters
                return time.monotonic(), c.generation_tokens, c.committed_groups

            t0, n0, g0 = counters()
            time.sleep(window_s)
            t1, n1, g1 = counters()
        rate = (n1 - n0) / tokens_per_episode / (t1 - t0)
        common.progress(
            f"{self.label}: {rate:.2f} episodes/s ({(n1 - n0) / (t1 - t0):.0f} tokens/s; "
            f"{g1 - g0} groups committed) over {t1 - t0:.0f} s"
        )
        return rate


def throughput(
    generators: list[Generator], rounds: int, window_s: float, tokens_per_episode: float
) -> dict[str, list[float]]:
    runs: dict[str, list[float]] = {g.label: [] for g in generators}
    try:
        for g in generators:
            g.start()
        for g in generators:  # each was frozen since it listened: its first minutes are not kept
            g.thaw()
            common.progress(f"{g.label}: warming up for {window_s:.0f} s")
            time.sleep(window_s)
            g.freeze()
        for r in range(rounds):
            order = generators if r % 2 == 0 else generators[::-1]  # neither always goes first
            for g in order:
                g.thaw()
                runs[g.label].append(g.measure(window_s, tokens_per_episode))
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
        generators = [Generator(work, "off", False), Generator(work, "on", True)]
        try:
            figures = crash_figures(control_and_crash(work, kills))
        except BaseException:
            for g in generators:
                g.close()
            raise
        runs = throughput(generators, rounds, window_s, figures["model_tokens_per_episode"])
    paired = [on / off for on, off in zip(runs["on"], runs["off"], strict=True) if off]
    on_vs_off = common.median(paired) if paired else float("nan")
    f = figures
    reused = f["turns_reused_after_restore"]
    headline = [
        common.headline("episodes", f["episodes"], "", f"{GROUPS * GROUP_SIZE}",
                        f["episodes"] == GROUPS * GROUP_SIZE,
                        f"{f['turns_total']} model turns; {kills} SIGKILLs"),
        common.headline("turns_reused_after_restore",
                        f["turns_reused_after_restore"] if reused is not None else float("nan"),
                        "", "-", None,
                        f"durable at each kill: {f['turns_durable_at_kill']} turns, "
                        f"{f['steps_durable_at_kill']} steps"
                        + ("" if reused is not None else "; the service serves no "
                           "rolloutd_episode_recovered_turns_total")),
        common.headline("turns_generated_again", f["turns_generated_again"], "", "0",
                        f["turns_generated_again"] == 0,
                        f"{f['durable_steps_called_live_again']} durable steps called live again"
                        + (f"; {f['turns_unchecked']} durable turns whose step was not durable "
                           "unchecked (no counter)" if f["turns_unchecked"] else "")),
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
