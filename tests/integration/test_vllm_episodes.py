"""Episodes on vLLM with the tiny model, greedy, SIGKILLed at three moments chosen by what the
environments saw, ``--restore latest`` after each: every trajectory equals an uninterrupted
control run's token for token, no durable step is called live again, a repeated call carries
the same completion, no group is delivered twice, the loss mask marks exactly the model's
tokens, and re-rendering finds no mismatch. Three sources in one service: an environment restored
by replaying its steps, one with ``state()``/``restore()``, and one served over HTTP by
``python -m rolloutd.episodes.server`` (a process the SIGKILLs spare, restored by replaying). Each
kill waits until a replaying source has an episode in flight past a durable step (one that no
kill caught in flight yet, while such a one has work left), so the replay path runs for each."""

from __future__ import annotations

import itertools
import json
import os
import random
import subprocess
import sys
import threading
import time
import urllib.request
from collections import Counter, defaultdict
from pathlib import Path

import grpc
import pytest

from rolloutd.v1 import rollout_pb2 as pb
from rolloutd.v1 import rollout_pb2_grpc as pb_grpc
from tests.integration.proc import ServeProcess

pytestmark = [pytest.mark.vllm, pytest.mark.process, pytest.mark.timeout(2400)]
"""Five vLLM starts (a control run beside the first run, and three restarts): each took up to
four minutes on 2 cores under load."""

ROOT = Path(__file__).resolve().parents[2]
SOURCES = {"replayed": "ReplayedEnv", "stateful": "StatefulEnv", "served": "ServedEnv"}
REPLAYING = ("ReplayedEnv", "ServedEnv")
"""Environments without ``state()``: a restore replays their durable steps."""
PROMPTS_PER_SOURCE = 4
GROUP_SIZE = 4
TURNS = 3
STEPS = len(SOURCES) * PROMPTS_PER_SOURCE * GROUP_SIZE * TURNS
"""Live steps an uninterrupted run makes."""


class ServedEnvironment:
    """``ServedEnv`` over HTTP in a subprocess: its address from its first line, ready once its
    ``/info`` answers."""

    def __init__(self, calls: Path) -> None:
        config = json.dumps({"log": str(calls), "turns": TURNS})
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "rolloutd.episodes.server",
                "tests.integration.episode_envs:ServedEnv",
                "--port",
                "0",
                "--config",
                config,
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env={**os.environ, "PYTHONPATH": f"{ROOT / 'service'}:{ROOT}"},
        )
        assert self.proc.stdout is not None
        first = self.proc.stdout.readline()
        assert first.startswith("serving "), first
        self.url = first.split()[-1]
        _wait(self._ready, f"{self.url}/info", within_s=60)

    def _ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.url}/info", timeout=5) as r:
                return bool(r.status == 200)
        except OSError:
            return False

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=30)


def _config(tmp: Path, calls: Path, served: str) -> Path:
    sources = []
    for name, cls in SOURCES.items():
        data = tmp / f"{name}.jsonl"
        data.write_text(
            "".join(
                json.dumps(
                    {"id": f"{name}-{i}", "prompt": f"Compute {i} times {i + 3} with the tool."}
                )
                + "\n"
                for i in range(PROMPTS_PER_SOURCE)
            )
        )
        local = {
            "environment": f"tests.integration.episode_envs:{cls}",
            "environment_config": {"log": str(calls), "turns": TURNS},
        }
        served_ = {"environment": served}
        sources.append(
            {"name": name, "path": str(data), **(served_ if cls == "ServedEnv" else local)}
        )
    path = tmp / "config.yaml"
    path.write_text(
        json.dumps(
            {
                "dataset": {"sources": sources, "epochs": 1},
                "group_size": GROUP_SIZE,
                "engine": {
                    "kind": "vllm",
                    "temperature": 0,
                    "max_tokens": 12,
                    "vllm": {"dtype": "float32", "max_num_seqs": 16},
                },
                "limits": {"max_in_flight": 3},
                "episodes": {"max_turns": 4},
            }
        )
    )
    return path


def _serve(tmp: Path, cache_dir: Path, config: Path, *args: str) -> ServeProcess:
    return _listening(_start(tmp, cache_dir, config, *args))


def _start(tmp: Path, cache_dir: Path, config: Path, *args: str) -> ServeProcess:
    return ServeProcess(
        [
            "--config",
            str(config),
            "--grpc-port",
            "0",
            "--http-port",
            "0",
            "--checkpoint-dir",
            str(tmp / "ckpt"),
            "--checkpoint-interval",
            "0.5",
            *args,
        ],
        env={
            "ROLLOUTD_ENGINE__CACHE_DIR": str(cache_dir),
            "PYTHONPATH": f"{ROOT / 'service'}:{ROOT}",
        },
        cwd=tmp,
        log_path=tmp / "serve.log",
    )


def _listening(p: ServeProcess) -> ServeProcess:
    try:
        p.wait_listening(timeout=540)  # a vLLM start took 4 minutes and more on loaded cores
    except BaseException:
        p.kill()
        raise
    return p


def _calls(path: Path) -> list[dict]:  # type: ignore[type-arg]
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _live_steps(path: Path) -> int:
    return sum(1 for c in _calls(path) if c["call"] == "step" and not c["replay"])


def _steps_left(path: Path) -> int:
    """The episodes' steps not yet called live once (a step called again after a kill counts
    once)."""
    made = {
        (c["env"], c["episode"], c["turn"])
        for c in _calls(path)
        if c["call"] == "step" and not c["replay"]
    }
    return STEPS - len(made)


def _replaying_in_flight(path: Path, since: int) -> set[str]:
    """The replaying environments with an episode in flight that made a live step of turn 1 or
    later after line ``since`` of the log (the last restart): the step before it is durable, so
    a kill now leaves it a step to replay (a step 0 called may not be durable yet: it is then
    called again, not replayed)."""
    calls = _calls(path)
    live = [c for c in calls if c["call"] == "step" and not c["replay"]]
    done = {c["episode"] for c in live if c["turn"] == TURNS - 1}
    return {
        c["env"]
        for c in calls[since:]
        if c["call"] == "step" and not c["replay"] and c["env"] in REPLAYING and c["turn"] >= 1
        if c["episode"] not in done
    }


def _finished(path: Path) -> set[str]:
    """The environments whose every episode made its last step."""
    last = {
        (c["env"], c["episode"])
        for c in _calls(path)
        if c["call"] == "step" and not c["replay"] and c["turn"] == TURNS - 1
    }
    per_env = Counter(env for env, _ in last)
    return {env for env, n in per_env.items() if n == PROMPTS_PER_SOURCE * GROUP_SIZE}


def _kill_now(path: Path, since: int, at: int, covered: set[str]) -> bool:
    """``at`` live steps reached, and a replaying environment is in flight: one no kill caught
    in flight yet while any of those still has work, else any."""
    if _live_steps(path) < at:
        return False
    flying = _replaying_in_flight(path, since)
    wanted = set(REPLAYING) - covered - _finished(path)
    return bool(flying & wanted) if wanted else bool(flying) or _finished(path) >= set(REPLAYING)


def _collect(p: ServeProcess) -> list[pb.Group]:
    groups: list[pb.Group] = []
    with grpc.insecure_channel(p.grpc) as channel:
        stub = pb_grpc.RolloutServiceStub(channel)
        while len(groups) < len(SOURCES) * PROMPTS_PER_SOURCE:
            r = stub.FetchGroups(pb.FetchGroupsRequest(max_groups=16, wait_ms=60_000), timeout=120)
            groups += r.groups
            if r.groups:
                stub.AckGroups(pb.AckGroupsRequest(lease_id=r.lease_id, trainer_step=1), timeout=30)
    return groups


def _wait(condition, what, within_s: float = 600) -> None:  # type: ignore[no-untyped-def]
    """Polls ``condition``; ``what`` says what it waits for (a callable: read at the timeout)."""
    deadline = time.monotonic() + within_s
    while not condition():
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out waiting for {what() if callable(what) else what}")
        time.sleep(0.05)


def _trajectories(groups: list[pb.Group]) -> dict[tuple[str, int], pb.Sample]:
    return {(g.prompt_id, s.index): s for g in groups for s in g.samples}


def test_episodes_sigkilled_three_times_end_as_an_uninterrupted_run(tmp_path, tiny_model_cache):
    control_dir, crash_dir = tmp_path / "control", tmp_path / "crash"
    control_dir.mkdir()
    crash_dir.mkdir()
    control_calls, calls = control_dir / "calls.jsonl", crash_dir / "calls.jsonl"

    # the control run and the crash run's first life start side by side (their vLLM starts
    # overlap); the control run is collected in a thread while the crash run is killed
    served_control, served = ServedEnvironment(control_calls), ServedEnvironment(calls)
    config = _config(crash_dir, calls, served.url)
    rng = random.Random()
    control_run = _start(
        control_dir, tiny_model_cache, _config(control_dir, control_calls, served_control.url)
    )
    reference: dict[tuple[str, int], pb.Sample] = {}

    def run_control() -> None:
        try:
            reference.update(_trajectories(_collect(_listening(control_run))))
        finally:
            control_run.terminate()
            served_control.stop()

    control = threading.Thread(target=run_control)
    control.start()
    try:
        p = _serve(crash_dir, tiny_model_cache, config)
        kills = []
        covered: set[str] = set()
        """Replaying environments a kill caught with an episode in flight."""
        for _ in range(3):
            since = len(_calls(calls))
            # within the steps left, so the run reaches it (a kill that waited long for a
            # replaying source's episode may leave fewer than the next draw)
            at = _live_steps(calls) + min(rng.randint(6, STEPS // 6), _steps_left(calls))
            kills.append(at)
            _wait(
                lambda at=at, since=since: _kill_now(calls, since, at, covered),
                lambda at=at, since=since: (
                    f"{at} live steps with a replaying episode in flight (kills {kills}; "
                    f"now {_live_steps(calls)} live, {_steps_left(calls)} left, in flight "
                    f"{sorted(_replaying_in_flight(calls, since))}, covered {sorted(covered)}, "
                    f"finished {sorted(_finished(calls))})"
                ),
            )
            covered.update(_replaying_in_flight(calls, since))
            p.kill()
            p = _serve(crash_dir, tiny_model_cache, config, "--restore", "latest")
        try:
            delivered = _collect(p)
        finally:
            p.terminate()
    finally:
        served.stop()
        control.join(timeout=900)
    assert not control.is_alive() and reference, "the control run delivered nothing"

    # no group delivered twice, every prompt once
    assert Counter(g.prompt_id for g in delivered) == {
        f"{s}-{i}": 1 for s in SOURCES for i in range(PROMPTS_PER_SOURCE)
    }
    got = _trajectories(delivered)
    assert got.keys() == reference.keys()
    for key, sample in got.items():
        ref = reference[key]
        assert list(sample.prompt_token_ids) == list(ref.prompt_token_ids), key
        assert list(sample.token_ids) == list(ref.token_ids), key
        assert list(sample.loss_mask) == list(ref.loss_mask), key
        assert sample.finish_reason == ref.finish_reason == "episode:done", key
        assert sample.retokenization_mismatches == 0, key
        # the mask is 1 exactly on the model turns' spans
        starts = [*sample.turn_starts, pb.TurnStart(start=len(sample.token_ids))]
        for span, nxt in itertools.pairwise(starts):
            bit = 1 if span.kind == pb.TURN_KIND_MODEL else 0
            assert set(sample.loss_mask[span.start : nxt.start]) <= {bit}, key
        assert [t.kind for t in sample.turn_starts].count(pb.TURN_KIND_MODEL) == TURNS

    steps = defaultdict(list)
    for c in _calls(calls):
        if c["call"] == "step" and not c["replay"]:
            steps[(c["episode"], c["turn"])].append(c["completion"])
    # every repeated live call carries the same completion; a step is repeated only when the
    # process died while it ran, at most one per sibling in flight per kill
    assert all(len(set(v)) == 1 for v in steps.values())
    repeated = [k for k, v in steps.items() if len(v) > 1]
    assert all(len(steps[k]) == 2 for k in repeated)
    assert len(repeated) <= 3 * 3 * GROUP_SIZE, (kills, repeated)
    restored = [c for c in _calls(calls) if c["call"] == "restore"]
    replayed = [c for c in _calls(calls) if c["call"] == "step" and c["replay"]]
    assert all(c["env"] == "StatefulEnv" for c in restored)
    assert all(c["env"] in REPLAYING for c in replayed)
    # each replaying environment had episodes in flight at a kill: their durable steps replayed
    assert covered == set(REPLAYING), (kills, covered)
    assert {env: any(c["env"] == env for c in replayed) for env in REPLAYING} == {
        env: True for env in REPLAYING
    }, kills
