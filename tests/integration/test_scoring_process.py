"""Rewards in a real ``rolloutd serve``: dynamic sampling keeps exactly-once by prompt across
SIGKILLs and restores, over-sampling stays bounded, failed verifiers give failed scores while
the service stays SERVING, and ``rolloutd rescore`` checks a store's rewards."""

from __future__ import annotations

import json
import math
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from rolloutd.client import RolloutClient
from rolloutd.v1 import rollout_pb2 as pb
from tests.integration.proc import ServeProcess

pytestmark = pytest.mark.process

ROOT = Path(__file__).resolve().parents[2]
VERIFIERS = "tests.integration.scoring_verifiers"
ENV = {"PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
DROPPED = re.compile(r"group (\d+) \(prompt (\S+)\) dropped: (\w+)")


def _config(tmp_path: Path, rows: list[dict[str, Any]], **sections: Any) -> Path:
    dataset = tmp_path / "prompts.jsonl"
    dataset.write_text("".join(json.dumps(r) + "\n" for r in rows))
    config = tmp_path / "rolloutd.yaml"
    config.write_text(json.dumps({"dataset": {"epochs": 1, "path": str(dataset)}, **sections}))
    return config


def _serve(store: Path, config: Path, *args: str) -> ServeProcess:
    return ServeProcess.synthetic(
        store, "--config", str(config), "--log-level", "debug", *args, env=ENV, cwd=store.parent
    )


def _run(command: list[str]) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, **ENV}
    return subprocess.run(command, capture_output=True, text=True, env=env, timeout=120)


def test_dynamic_sampling_delivers_or_drops_each_prompt_once_across_sigkills(tmp_path):
    n, size, in_flight, ratio = 240, 4, 6, 0.5
    cap = int(in_flight * (1 + ratio))
    config = _config(
        tmp_path,
        [{"id": f"q{i}", "prompt": f"what is {i} times {i}?"} for i in range(n)],
        group_size=size,
        engine={"synthetic": {"latency_s": 0.01}},
        limits={"max_in_flight": in_flight, "buffer_capacity": 32, "lease_timeout_s": 5},
        scoring={"verifier": f"{VERIFIERS}:first_token_even", "workers": 2},
        filter={"zero_variance": True, "max_oversample_ratio": ratio},
    )
    store = tmp_path / "ckpt"
    delivered: dict[str, int] = {}  # prompt id -> group id, acked
    rewards: dict[int, list[float]] = {}
    peak, outputs, kills, step, last_snapshot = 0, [], [40, 100, 160], 0, 0
    p = _serve(store, config, "--checkpoint-interval", "0.3")
    try:
        while True:
            with RolloutClient(p.wait_listening(), interceptors=[]) as client:
                while True:
                    [status] = client.status().values()
                    b = status.buffer
                    assert status.state == pb.SERVING_STATE_SERVING, p.output[-3000:]
                    peak = max(peak, b.generating + b.finishing)
                    assert b.generating + b.finishing <= cap == b.max_in_flight
                    snapshot = status.last_checkpoint.sequence
                    if kills and len(delivered) >= kills[0] and snapshot > last_snapshot:
                        last_snapshot = snapshot  # a restart has a snapshot of this run to restore
                        break
                    if status.dataset_exhausted and b.generating + b.finishing + b.committed + \
                            b.leased == 0:  # fmt: skip
                        break
                    lease = client.fetch(max_groups=8, wait_ms=300)
                    if lease is None:
                        continue
                    step += 1
                    client.ack(lease, step)
                    for g in lease.groups:
                        assert g.prompt_id not in delivered, f"{g.prompt_id} delivered twice"
                        assert g.reward_std > 0, "a zero-variance group was delivered"
                        delivered[g.prompt_id] = g.group_id
                        rewards[g.group_id] = [s.reward for s in g.samples]
            if not kills:
                break
            kills.pop(0)
            p.kill()
            outputs.append(p.output)
            p = _serve(store, config, "--checkpoint-interval", "0.3", "--restore", "latest")
        final = status
        assert p.terminate() == 0
    finally:
        p.kill()
    outputs.append(p.output)
    assert sum("restored snapshot" in o for o in outputs) == 3

    dropped: dict[str, int] = {}  # prompt id -> group id, from every process's log
    for gid, prompt_id, reason in (m.groups() for o in outputs for m in DROPPED.finditer(o)):
        assert reason == "zero_variance"
        assert dropped.setdefault(prompt_id, int(gid)) == int(gid), f"{prompt_id} dropped twice"
    assert not dropped.keys() & delivered.keys(), "a prompt both delivered and dropped"
    assert dropped.keys() | delivered.keys() == {f"q{i}" for i in range(n)}, "a prompt missing"
    assert final.counters.dropped_groups == len(dropped)
    assert dict(final.counters.dropped_by_reason) == {"zero_variance": len(dropped)}
    # the verifier's pass rate is about a half: 2 x 0.5^4 of the groups have equal rewards
    p_drop, fraction = 2 * 0.5**size, len(dropped) / n
    half_width = 2.576 * math.sqrt(p_drop * (1 - p_drop) / n)
    assert abs(fraction - p_drop) <= half_width, (fraction, p_drop, half_width)
    assert 0.4 < statistics.mean(r for rs in rewards.values() for r in rs) < 0.6
    assert peak > in_flight, "over-sampling never used its room"

    # the store's recorded rewards are what the verifier computes, and a changed verifier shows
    rescore = [sys.executable, "-m", "rolloutd.cli", "rescore", "--dir", str(store)]
    same = _run([*rescore, "--verifier", f"{VERIFIERS}:first_token_even"])
    assert same.returncode == 0, same.stdout + same.stderr
    assert re.search(r"rescored (\d+) samples of ([1-9]\d*) groups: 0 mismatches", same.stdout)
    other = _run([*rescore, "--verifier", f"{VERIFIERS}:first_token_odd"])
    assert other.returncode == 1, other.stdout + other.stderr
    [(samples, mismatches)] = re.findall(r"rescored (\d+) samples .*: (\d+) mismatch", other.stdout)
    assert int(mismatches) == int(samples) > 0


def test_verifiers_that_fail_give_failed_scores_and_the_service_stays_serving(tmp_path):
    modes = ["ok", "raise", "hang", "exit"]
    config = _config(
        tmp_path,
        [{"id": mode, "prompt": "2 + 2", "metadata": {"mode": mode}} for mode in modes],
        group_size=2,
        scoring={
            "verifier": f"{VERIFIERS}:by_mode",
            "workers": 1,
            "timeout_s": 1.0,
            "on_failure": "deliver",
        },
    )
    p = _serve(tmp_path / "ckpt", config, "--checkpoint-interval", "0")
    try:
        with RolloutClient(p.wait_listening(), interceptors=[]) as client:
            groups: dict[str, pb.Group] = {}
            deadline = time.monotonic() + 120
            while len(groups) < len(modes):
                assert time.monotonic() < deadline, sorted(groups)
                [status] = client.status().values()
                assert status.state == pb.SERVING_STATE_SERVING
                lease = client.fetch(max_groups=4, wait_ms=500)
                if lease is not None:
                    client.ack(lease, 1)
                    groups.update((g.prompt_id, g) for g in lease.groups)
        assert p.terminate() == 0
    finally:
        p.kill()
    ok = groups["ok"]
    assert [s.reward for s in ok.samples] == [0.0, 1.0]
    assert {s.score_status for s in ok.samples} == {pb.SCORE_STATUS_OK}
    assert (ok.reward_mean, ok.reward_std) == (0.5, 0.5)
    for mode, kind in (("raise", "raised"), ("hang", "timeout"), ("exit", "worker_died")):
        for s in groups[mode].samples:
            assert s.score_status == pb.SCORE_STATUS_FAILED and not s.HasField("reward")
            assert s.reward_info_json.startswith(f"{kind}:"), (mode, s.reward_info_json)
