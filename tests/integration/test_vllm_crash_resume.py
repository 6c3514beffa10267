"""SIGKILL a real ``rolloutd serve`` on vLLM mid-generation; the restarted service continues each
unfinished sibling from the tokens the last snapshot held (recovery.granularity: token, the
default), with its dataset row's own settings, and with greedy decoding delivers what an
uninterrupted run delivers."""

from __future__ import annotations

import ast
import json
import re
import time

import grpc
import pytest

from rolloutd.checkpoint.store import SnapshotStore
from rolloutd.v1 import rollout_pb2 as pb
from rolloutd.v1 import rollout_pb2_grpc as pb_grpc
from tests.integration.test_vllm_service import serve

pytestmark = [pytest.mark.vllm, pytest.mark.process]

RESTORED = re.compile(r"restored snapshot (\d+) .* tokens (\{.*?\})")
MAX_TOKENS = 256
PREFIX_AT_LEAST = 16


def row_max_tokens(i: int) -> int:
    return MAX_TOKENS if i % 2 == 0 else MAX_TOKENS - 56


def dataset(path, n):
    """Rows whose own settings differ from the service's: greedy (the service samples at
    temperature 1) and a max_tokens of their own."""
    path.write_text(
        "".join(
            json.dumps(
                {
                    "id": f"q{i}",
                    "prompt": f"Question: what is {i} plus {2 * i}?",
                    "generation": {"temperature": 0, "max_tokens": row_max_tokens(i)},
                }
            )
            + "\n"
            for i in range(n)
        )
    )
    return path


@pytest.fixture(scope="module")
def cache_dir(tiny_model_cache):
    return tiny_model_cache


def test_sigkill_mid_generation_resumes_each_sibling_from_its_snapshot_tokens(tmp_path, cache_dir):
    data = dataset(tmp_path / "prompts.jsonl", 16)
    env = {
        "ROLLOUTD_ENGINE__VLLM__MAX_NUM_SEQS": "8",
        "ROLLOUTD_ENGINE__VLLM__DTYPE": "float32",
        "ROLLOUTD_LIMITS__MAX_IN_FLIGHT": "2",
    }
    shape = ["--dataset", str(data), "--group-size", "2", "--max-tokens", str(MAX_TOKENS)]
    p = serve(tmp_path, cache_dir, *shape, "--checkpoint-interval", "0.5", **env)
    store = SnapshotStore(str(tmp_path / "ckpt"))
    deadline = time.monotonic() + 240
    try:
        while True:  # until a published snapshot holds a sibling well into its generation
            assert time.monotonic() < deadline, "no snapshot with partial siblings"
            snapshot = store.resolve("latest").snapshot
            if snapshot is not None:
                partials = store.read_partials(snapshot.manifest)
                if any(PREFIX_AT_LEAST <= len(x) < MAX_TOKENS - 56 for x in partials):
                    break
            time.sleep(0.1)
    finally:
        p.kill()  # SIGKILL the service and its engine processes

    snapshot = store.resolve("latest").snapshot  # the newest one: it may have moved on
    assert snapshot is not None
    groups = {g["group_id"]: g for g in map(json.loads, snapshot.group_json())}
    staged = {(gid, s.index) for _, gid, s in snapshot.rows()}
    held = {
        (x.group_id, x.index): x
        for x in store.read_partials(snapshot.manifest)
        if groups[x.group_id]["state"] == "generating" and (x.group_id, x.index) not in staged
    }
    assert held and not staged & set(held)

    q = serve(
        tmp_path, cache_dir, *shape, "--checkpoint-interval", "0", "--restore", "latest", **env
    )
    try:
        [m] = [m for line in q.lines if (m := RESTORED.search(line))]
        assert int(m[1]) == snapshot.manifest.sequence
        reused = sum(len(x) for x in held.values())
        assert ast.literal_eval(m[2]) == {"reused": reused, "regenerated": 0}
        with grpc.insecure_channel(q.grpc) as channel:
            stub = pb_grpc.RolloutServiceStub(channel)
            # The same prompts with the same settings again, generated without a crash: the
            # greedy reference.
            prompts = {
                groups[gid]["prompt"]["id"]: groups[gid]["prompt"]["text"] for gid, _ in held
            }
            stub.SubmitPrompts(
                pb.SubmitPromptsRequest(
                    prompts=[
                        pb.Prompt(
                            prompt_id=f"ref-{i}",
                            text=t,
                            generation=pb.GenerationSpec(
                                temperature=0, max_tokens=row_max_tokens(int(i[1:]))
                            ),
                        )
                        for i, t in prompts.items()
                    ]
                ),
                timeout=30,
            )
            seen: dict[int, pb.Group] = {}
            reference: dict[str, pb.Group] = {}
            wanted = {gid for gid, _ in held}
            while not (wanted <= set(seen) and len(reference) == len(prompts)):
                r = stub.FetchGroups(
                    pb.FetchGroupsRequest(max_groups=16, wait_ms=60_000), timeout=120
                )
                seen.update({g.group_id: g for g in r.groups})
                reference.update(
                    {g.prompt_id: g for g in r.groups if g.prompt_id.startswith("ref-")}
                )
                stub.AckGroups(pb.AckGroupsRequest(lease_id=r.lease_id, trainer_step=1), timeout=30)
    finally:
        q.terminate()

    for (gid, index), x in held.items():
        n = len(x)
        row = int(groups[gid]["prompt"]["id"][1:])
        spec = seen[gid].generation  # the row's settings, kept through the crash
        assert (spec.temperature, spec.max_tokens) == (0, row_max_tokens(row))
        [s] = [s for s in seen[gid].samples if s.index == index]
        assert len(s.token_ids) <= row_max_tokens(row)
        assert s.HasField("resumed_at") and s.resumed_at == n
        assert list(s.token_ids[:n]) == x.token_ids().tolist()
        assert list(s.logprobs[:n]) == x.logprobs().tolist(), "exactly the snapshot's logprobs"
        assert [(part.start, part.policy_version) for part in s.parts] == [(0, 0)]
        ref = reference[f"ref-{groups[gid]['prompt']['id']}"].samples[index]
        assert not ref.HasField("resumed_at")
        assert list(s.token_ids) == list(ref.token_ids), "token for token"
        assert s.text == ref.text and s.finish_reason == ref.finish_reason
