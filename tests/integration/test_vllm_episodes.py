"""Episodes on vLLM with the tiny model, greedy, SIGKILLed at three moments chosen by what the
environments saw, ``--restore latest`` after each: every trajectory equals an uninterrupted
control run's token for token, no durable step is called live again, a repeated call carries
the same completion, no group is delivered twice, the loss mask marks exactly the model's
tokens, and re-rendering finds no mismatch. Two sources in one service: an environment restored
by replaying its steps, and one with ``state()``/``restore()``.

An environment served over HTTP as a third source of the same runs is left for when the HTTP
adapter (``rolloutd.episodes.http``) is on this branch."""

from __future__ import annotations

import itertools
import json
import random
import time
from collections import Counter, defaultdict
from pathlib import Path

import grpc
import pytest

from rolloutd.v1 import rollout_pb2 as pb
from rolloutd.v1 import rollout_pb2_grpc as pb_grpc
from tests.integration.proc import ServeProcess

pytestmark = [pytest.mark.vllm, pytest.mark.process, pytest.mark.timeout(1800)]
"""Five vLLM starts (a control run, the first run and three restarts): each took up to four
minutes on 2 cores under load."""

ROOT = Path(__file__).resolve().parents[2]
SOURCES = {"replayed": "ReplayedEnv", "stateful": "StatefulEnv"}
PROMPTS_PER_SOURCE = 4
GROUP_SIZE = 4
TURNS = 3


def _config(tmp: Path, calls: Path) -> Path:
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
        sources.append(
            {
                "name": name,
                "path": str(data),
                "environment": f"tests.integration.episode_envs:{cls}",
                "environment_config": {"log": str(calls), "turns": TURNS},
            }
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
                    "max_tokens": 24,
                    "vllm": {"dtype": "float32", "max_num_seqs": 16},
                },
                "limits": {"max_in_flight": 3},
                "episodes": {"max_turns": 4},
            }
        )
    )
    return path


def _serve(tmp: Path, cache_dir: Path, config: Path, *args: str) -> ServeProcess:
    p = ServeProcess(
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
    p.wait_listening(timeout=300)
    return p


def _calls(path: Path) -> list[dict]:  # type: ignore[type-arg]
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _live_steps(path: Path) -> int:
    return sum(1 for c in _calls(path) if c["call"] == "step" and not c["replay"])


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


def _wait(condition, what: str, within_s: float = 600) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + within_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def _trajectories(groups: list[pb.Group]) -> dict[tuple[str, int], pb.Sample]:
    return {(g.prompt_id, s.index): s for g in groups for s in g.samples}


def test_episodes_sigkilled_three_times_end_as_an_uninterrupted_run(tmp_path, tiny_model_cache):
    control_dir, crash_dir = tmp_path / "control", tmp_path / "crash"
    control_dir.mkdir()
    crash_dir.mkdir()
    control_calls, calls = control_dir / "calls.jsonl", crash_dir / "calls.jsonl"

    control = _serve(control_dir, tiny_model_cache, _config(control_dir, control_calls))
    try:
        reference = _trajectories(_collect(control))
    finally:
        control.terminate()

    config = _config(crash_dir, calls)
    rng = random.Random()
    total = len(SOURCES) * PROMPTS_PER_SOURCE * GROUP_SIZE * TURNS
    p = _serve(crash_dir, tiny_model_cache, config)
    kills = []
    for _ in range(3):
        at = _live_steps(calls) + rng.randint(6, total // 5)
        kills.append(at)
        _wait(lambda at=at: _live_steps(calls) >= at, f"{at} live steps")
        p.kill()
        p = _serve(crash_dir, tiny_model_cache, config, "--restore", "latest")
    try:
        delivered = _collect(p)
    finally:
        p.terminate()

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
    assert all(c["env"] == "ReplayedEnv" for c in replayed)
