"""Scoring on the real vLLM engine and the tiny model: a verifier's rewards reach the trainer,
and ``filter.zero_variance`` drops the groups whose rewards are all equal and counts them."""

from __future__ import annotations

import json
import os
import statistics
import time
from pathlib import Path

import grpc
import pytest

from rolloutd.scoring import ScoringInput
from rolloutd.v1 import rollout_pb2 as pb
from rolloutd.v1 import rollout_pb2_grpc as pb_grpc
from tests.integration.proc import ServeProcess
from tests.scoring.verifiers import even_length

pytestmark = [pytest.mark.vllm, pytest.mark.process]

ROOT = Path(__file__).resolve().parents[2]
PROMPTS = 24
GROUP_SIZE = 2
"""Two siblings: equal rewards about half the time, so some groups are dropped and some are
delivered (all of one kind has a chance of about 2 x 2^-24)."""


def settled(status: pb.GetStatusResponse) -> bool:
    b = status.buffer
    return status.dataset_exhausted and not (b.generating or b.finishing or b.committed or b.leased)


def test_zero_variance_groups_are_dropped_and_counted_and_delivered_rewards_are_the_verifiers(
    tmp_path, tiny_model_cache
):
    cache = tiny_model_cache
    data = tmp_path / "prompts.jsonl"
    data.write_text(
        "".join(json.dumps({"id": f"q{i}", "prompt": f"What is {i} times {i + 3}?",
                            "metadata": {"n": i}}) + "\n"
                for i in range(PROMPTS))
    )  # fmt: skip
    args = [
        "--engine", "vllm", "--grpc-port", "0", "--http-port", "0",
        "--checkpoint-dir", str(tmp_path / "ckpt"), "--checkpoint-interval", "0",
        "--dataset", str(data), "--epochs", "1", "--group-size", str(GROUP_SIZE),
        "--max-tokens", "8",
    ]  # fmt: skip
    p = ServeProcess(
        args,
        env={
            "ROLLOUTD_ENGINE__CACHE_DIR": str(cache),
            "ROLLOUTD_SCORING__VERIFIER": "tests.scoring.verifiers:even_length",
            "ROLLOUTD_SCORING__WORKERS": "1",
            "ROLLOUTD_FILTER__ZERO_VARIANCE": "true",
            "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
        },
        cwd=tmp_path,
        log_path=tmp_path / "serve.log",
    )
    groups: list[pb.Group] = []
    try:
        p.wait_listening(timeout=300)
        with grpc.insecure_channel(p.grpc) as channel:
            stub = pb_grpc.RolloutServiceStub(channel)
            deadline = time.monotonic() + 180
            while not settled(status := stub.GetStatus(pb.GetStatusRequest(), timeout=30)):
                assert time.monotonic() < deadline, f"not settled: {status}\n{p.output[-3000:]}"
                r = stub.FetchGroups(pb.FetchGroupsRequest(max_groups=8, wait_ms=500), timeout=60)
                if r.groups:
                    groups += r.groups
                    stub.AckGroups(
                        pb.AckGroupsRequest(lease_id=r.lease_id, trainer_step=1), timeout=60
                    )
    finally:
        p.terminate()

    dropped = status.counters.dropped_groups
    assert dropped > 0 and groups, f"{dropped} dropped, {len(groups)} delivered"
    assert dict(status.counters.dropped_by_reason) == {"zero_variance": dropped}
    assert status.counters.dropped_tokens > 0
    # every prompt was admitted once: delivered once, or dropped
    assert len({g.prompt_id for g in groups}) == len(groups) == PROMPTS - dropped
    for g in groups:
        rewards = []
        for s in g.samples:
            reward, info = even_length(
                ScoringInput(
                    prompt_id=g.prompt_id,
                    prompt=g.prompt_text,
                    messages=(),
                    metadata=json.loads(g.metadata_json),
                    completion=s.text,
                    token_ids=tuple(s.token_ids),
                    finish_reason=s.finish_reason,
                    index=s.index,
                )
            )
            assert s.score_status == pb.SCORE_STATUS_OK
            assert s.HasField("reward") and s.reward == reward
            assert json.loads(s.reward_info_json) == info
            rewards.append(reward)
        assert len(set(rewards)) > 1, f"{g.prompt_id} has zero variance: {rewards}"
        assert g.reward_mean == statistics.fmean(rewards)
        assert g.reward_std == pytest.approx(statistics.pstdev(rewards)) and g.reward_std > 0
