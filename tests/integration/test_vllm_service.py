"""The real service on vLLM and the tiny model (CPU in CI)."""

from __future__ import annotations

import ast
import json
import re
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass

import grpc
import psutil
import pytest
import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer

from rolloutd.checkpoint.segments import Snapshot
from rolloutd.checkpoint.store import SnapshotStore
from rolloutd.engines.tiny_model import ensure_tiny_model
from rolloutd.v1 import rollout_pb2 as pb
from rolloutd.v1 import rollout_pb2_grpc as pb_grpc
from tests.integration.proc import ServeProcess

pytestmark = [pytest.mark.vllm, pytest.mark.process]

RESTORED = re.compile(r"restored snapshot (\d+) in [\d.]+s: groups (\{.*?\}), siblings (\{.*?\})")


@pytest.fixture(scope="module")
def cache_dir(tiny_model_cache):
    """The session's tiny model, shared by every service started here."""
    return tiny_model_cache


def dataset(path, n):
    path.write_text(
        "".join(
            json.dumps({"id": f"q{i}", "prompt": f"Question: what is {i} plus {2 * i}?"}) + "\n"
            for i in range(n)
        )
    )
    return path


def serve(tmp_path, cache_dir, *args, **env) -> ServeProcess:
    p = ServeProcess(
        [
            "--engine",
            "vllm",
            "--grpc-port",
            "0",
            "--http-port",
            "0",
            "--checkpoint-dir",
            str(tmp_path / "ckpt"),
            *args,
        ],
        env={"ROLLOUTD_ENGINE__CACHE_DIR": str(cache_dir), **env},
        cwd=tmp_path,
        log_path=tmp_path / "serve.log",
    )
    p.wait_listening(timeout=300)
    return p


SHAPED = {"s4": {"max_tokens": 4, "group_size": 2}, "s16": {"max_tokens": 16, "group_size": 8}}
"""Rows with settings of their own: at most 4 and 16 tokens, groups of 2 and 8."""


@dataclass
class Epoch:
    """A service that generated and delivered one epoch of seven prompts (two with settings of
    their own) and is idle since."""

    p: ServeProcess
    groups: list[pb.Group]
    status: pb.GetStatusResponse
    """``GetStatus`` right after the last ack."""


@pytest.fixture(scope="module")
def epoch(tmp_path_factory, cache_dir) -> Iterator[Epoch]:
    """One vLLM start for the tests that need an idle service after an epoch (a start costs half a
    minute or more on two cores). They only read it, except the last one, which kills its engine:
    they stay in this order, and each also runs alone."""
    tmp_path = tmp_path_factory.mktemp("epoch")
    data = dataset(tmp_path / "prompts.jsonl", 5)
    with data.open("a") as f:
        for pid, spec in SHAPED.items():
            f.write(json.dumps({"id": pid, "prompt": f"Count to {pid[1:]}:", "generation": spec}))
            f.write("\n")
    p = serve(
        tmp_path,
        cache_dir,
        "--dataset",
        str(data),
        "--epochs",
        "1",
        "--group-size",
        "3",
        "--max-tokens",
        "24",
        "--checkpoint-interval",
        "0",
    )
    groups: list[pb.Group] = []
    try:
        with grpc.insecure_channel(p.grpc) as channel:
            stub = pb_grpc.RolloutServiceStub(channel)
            while len(groups) < 7:
                r = stub.FetchGroups(
                    pb.FetchGroupsRequest(max_groups=7, wait_ms=60_000), timeout=120
                )
                groups += r.groups
                stub.AckGroups(pb.AckGroupsRequest(lease_id=r.lease_id, trainer_step=1), timeout=30)
            status = stub.GetStatus(pb.GetStatusRequest(), timeout=30)
        yield Epoch(p, groups, status)
    finally:
        if p.proc.poll() is None:
            p.kill()


def test_groups_decode_with_the_tokenizer_and_the_token_counter_adds_up(epoch, cache_dir):
    groups, status = epoch.groups, epoch.status
    tokenizer = Tokenizer.from_file(str(ensure_tiny_model(cache_dir) / "tokenizer.json"))
    assert sorted(g.prompt_id for g in groups) == sorted([f"q{i}" for i in range(5)] + [*SHAPED])
    for g in groups:
        shaped = SHAPED.get(g.prompt_id, {"group_size": 3, "max_tokens": 24})
        size, max_tokens = shaped["group_size"], shaped["max_tokens"]
        assert (g.generation.group_size, g.generation.max_tokens) == (size, max_tokens)
        assert [s.index for s in g.samples] == list(range(size))
        assert len({s.seed for s in g.samples}) == size
        assert tokenizer.decode(list(g.samples[0].prompt_token_ids)).endswith(g.prompt_text)
        for s in g.samples:
            assert 0 < len(s.token_ids) <= max_tokens
            assert len(s.logprobs) == len(s.token_ids)
            assert all(lp <= 0.0 for lp in s.logprobs)
            assert tokenizer.decode(list(s.token_ids), skip_special_tokens=True) == s.text
    assert (
        status.dataset_exhausted and status.inflight_samples == 0 and status.buffer.generating == 0
    )
    returned = sum(len(s.token_ids) for g in groups for s in g.samples)
    assert status.counters.generation_tokens == returned  # nothing in flight: every token returned
    assert status.counters.committed_tokens == returned


def test_bad_weights_are_invalid_argument_and_change_nothing(epoch, tmp_path):
    bad = tmp_path / "bad-weights"
    bad.mkdir()
    save_file({"model.embed_tokens.weight": torch.zeros(3, 5)}, str(bad / "w.safetensors"))
    with grpc.insecure_channel(epoch.p.grpc) as channel:
        stub = pb_grpc.RolloutServiceStub(channel)
        with pytest.raises(grpc.RpcError) as missing:
            stub.UpdateWeights(
                pb.UpdateWeightsRequest(version=1, weights_path=str(tmp_path / "nowhere")),
                timeout=60,
            )
        with pytest.raises(grpc.RpcError) as misshapen:
            stub.UpdateWeights(
                pb.UpdateWeightsRequest(version=1, weights_path=str(bad)), timeout=120
            )
        status = stub.GetStatus(pb.GetStatusRequest(), timeout=30)
    assert missing.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert missing.value.details().startswith("weights_path: ")  # no server path in it
    assert misshapen.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "model.embed_tokens.weight" in misshapen.value.details()
    assert status.state == pb.SERVING_STATE_SERVING and status.policy_version == 0


def test_an_idle_service_whose_engine_dies_turns_not_ready_and_exits_1(epoch, cache_dir):
    """An epoch was generated and delivered; the service is idle (nothing asks the engine for
    anything) when its engine-core process is killed, as an out-of-memory kill would. It must not
    go on reporting SERVING until the next engine call: it turns not-ready and exits 1 within
    seconds, so that its orchestrator restarts it; a weight update meanwhile is UNAVAILABLE."""
    p = epoch.p
    with grpc.insecure_channel(p.grpc) as channel:
        stub = pb_grpc.RolloutServiceStub(channel)
        idle = stub.GetStatus(pb.GetStatusRequest(), timeout=30)
        assert idle.dataset_exhausted and idle.inflight_samples == 0
        assert idle.state == pb.SERVING_STATE_SERVING
        (core,) = [
            c
            for c in psutil.Process(p.proc.pid).children()
            if "EngineCore" in " ".join(c.cmdline())
        ]
        core.kill()
        killed = time.monotonic()

        def serving() -> bool:
            try:
                state = stub.GetStatus(pb.GetStatusRequest(), timeout=2).state
            except grpc.RpcError:
                return False  # gone already: not serving either
            return state == pb.SERVING_STATE_SERVING

        while serving():
            assert time.monotonic() - killed < 10, "still SERVING 10 s after the engine died"
            time.sleep(0.1)
        not_ready_s = time.monotonic() - killed
        with pytest.raises(grpc.RpcError) as dead:
            stub.UpdateWeights(
                pb.UpdateWeightsRequest(version=2, weights_path=str(ensure_tiny_model(cache_dir))),
                timeout=120,
            )
    code = p.proc.wait(timeout=max(0.1, 10 - (time.monotonic() - killed)))
    exited_s = time.monotonic() - killed
    print(f"engine killed: not ready after {not_ready_s:.1f} s, exit {code} after {exited_s:.1f} s")
    assert dead.value.code() == grpc.StatusCode.UNAVAILABLE
    assert code == 1, p.output
    assert "EngineDeadError" in p.output, p.output


@pytest.mark.timeout(900)  # two vLLM starts: each took over 3 minutes on 2 cores under load
def test_sigkill_mid_generation_reuses_staged_siblings_and_reruns_only_the_missing(
    tmp_path, cache_dir
):
    # vLLM runs one sequence at a time, so a group's siblings finish one after another and the
    # group is partly staged for most of its generation: nearly every snapshot catches one,
    # however slowly the machine generates. The buffer holds every group of the data set, so it
    # does not fill, and stop generation, meanwhile (nor does staleness gating, which would stop
    # at what a trainer could consume: none fetches here).
    data = dataset(tmp_path / "prompts.jsonl", 1024)
    env = {
        "ROLLOUTD_ENGINE__VLLM__MAX_NUM_SEQS": "1",
        "ROLLOUTD_LIMITS__MAX_IN_FLIGHT": "4",
        "ROLLOUTD_LIMITS__BUFFER_CAPACITY": "1024",
        "ROLLOUTD_LIMITS__STALENESS_GATING": "false",
        "ROLLOUTD_ENGINE__TEMPERATURE": "1.0",
    }
    shape = ["--dataset", str(data), "--group-size", "4", "--max-tokens", "96"]
    # Every snapshot is kept, and each one published since the last look is examined, so none
    # is missed however many the service publishes between two looks.
    keep = {"ROLLOUTD_CHECKPOINT__KEEP_LATEST": "100000"}
    p = serve(tmp_path, cache_dir, *shape, "--checkpoint-interval", "0.25", **env, **keep)
    store = SnapshotStore(str(tmp_path / "ckpt"))
    deadline = time.monotonic() + 240
    examined = -1
    try:
        while True:  # until a published snapshot holds a group with some, not all, siblings staged
            assert time.monotonic() < deadline, "no snapshot with a partly generated group:\n" + (
                "".join(p.lines[-30:])
            )
            published = [s for s in store.sequences() if s > examined]
            found = partly_staged(store, published)
            if found is not None:
                snapshot, staged, unfinished = found
                break
            examined = max(published, default=examined)
            time.sleep(0.1)
    finally:
        p.kill()  # SIGKILL the service and its engine processes

    rows = {(gid, s.index): s for _, gid, s in snapshot.rows()}
    expected = {
        "reused": sum(staged[g] for g in unfinished),
        "rerun": sum(4 - staged[g] for g in unfinished),
    }
    sequence = str(snapshot.manifest.sequence)
    q = serve(
        tmp_path, cache_dir, *shape, "--checkpoint-interval", "0", "--restore", sequence, **env
    )
    try:
        [m] = [m for line in q.lines if (m := RESTORED.search(line))]
        assert int(m[1]) == snapshot.manifest.sequence
        assert ast.literal_eval(m[2])["unfinished"] == len(unfinished)
        assert ast.literal_eval(m[3]) == expected
        with grpc.insecure_channel(q.grpc) as channel:
            stub = pb_grpc.RolloutServiceStub(channel)
            seen = {}
            while not set(unfinished) <= set(seen):
                r = stub.FetchGroups(
                    pb.FetchGroupsRequest(max_groups=64, wait_ms=60_000),
                    timeout=300,
                    wait_for_ready=True,
                )
                if not r.lease_id:
                    continue  # nothing ready within the wait: no lease to ack
                seen.update({g.group_id: g for g in r.groups})
                # An ack is durable before it is answered: its journal fsync waits on the disk.
                stub.AckGroups(
                    pb.AckGroupsRequest(lease_id=r.lease_id, trainer_step=1),
                    timeout=300,
                    wait_for_ready=True,
                )
        for gid in unfinished:
            for s in seen[gid].samples:
                if (gid, s.index) in rows:  # a reused sibling comes back exactly as it was staged
                    assert list(s.token_ids) == list(rows[(gid, s.index)].token_ids)
                    assert s.seed == rows[(gid, s.index)].seed
    finally:
        q.terminate()


def partly_staged(
    store: SnapshotStore, sequences: list[int]
) -> tuple[Snapshot, Counter[int], list[int]] | None:
    """The oldest of ``sequences`` holding a generating group with some, not all, of its 4
    siblings staged: the snapshot, staged siblings per group, and its generating groups. Reads
    only the group ids of the rows, so a look stays cheap as the snapshots grow."""
    for sequence in sorted(sequences):
        snapshot = store.open(store.load(sequence))
        staged = Counter(snapshot.table().column("group_id").to_pylist())
        groups = list(map(json.loads, snapshot.group_json()))
        unfinished = [g["group_id"] for g in groups if g["state"] == "generating"]
        if any(0 < staged[gid] < 4 for gid in unfinished):
            return snapshot, staged, unfinished
    return None
