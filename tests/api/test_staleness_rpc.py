"""Staleness over the real RPCs: a trainer that stops consuming while its weights move on, then
resumes, receives nothing older than ``limits.max_staleness``, and every token generated is
accounted for in the token fates (delivered or evicted)."""

import json

from rolloutd.v1 import rollout_pb2 as pb
from tests.waiting import eventually

STALENESS = 1
BATCH = 4
"""Groups the trainer takes per policy version (= limits.max_in_flight: no surplus at the start)."""


async def test_a_trainer_that_stops_then_resumes_gets_nothing_too_stale(serve, tmp_path):
    dataset = tmp_path / "prompts.jsonl"
    dataset.write_text("".join(json.dumps({"prompt": f"question {i}"}) + "\n" for i in range(40)))
    weights = str(tmp_path)  # the synthetic engine only checks that the path exists
    _, stub = await serve(
        **{
            "dataset.path": str(dataset),
            "dataset.epochs": 1,
            "group_size": 2,
            "engine.max_tokens": 24,
            # slow enough that groups are mid-generation when they go stale: their streamed
            # tokens count as evicted too
            "engine.synthetic.tokens_per_s": 200,
            "limits.max_in_flight": BATCH,
            "limits.buffer_capacity": 64,
            "limits.max_staleness": STALENESS,
        }
    )
    version = 0
    received_tokens = 0
    lags: list[int] = []

    async def delivered() -> bool:
        """The dataset's only epoch was admitted and nothing is left to deliver."""
        s = await stub.GetStatus(pb.GetStatusRequest())
        b = s.buffer
        return s.dataset_exhausted and not (
            s.pending_prompts or b.generating or b.finishing or b.committed
        )

    async def step(fetch: bool) -> int:
        """One trainer step: take a batch (unless it stands still), then publish new weights."""
        nonlocal version, received_tokens
        taken = 0
        while fetch and taken < BATCH and not await delivered():
            r = await stub.FetchGroups(
                pb.FetchGroupsRequest(max_groups=BATCH - taken, wait_ms=1000, consumer="t")
            )
            if not r.lease_id:
                continue
            for g in r.groups:
                lags.append(version - min(s.policy_version for s in g.samples))
                received_tokens += sum(len(s.token_ids) for s in g.samples)
            taken += len(r.groups)
            await stub.AckGroups(pb.AckGroupsRequest(lease_id=r.lease_id, trainer_step=version))
        version += 1
        await stub.UpdateWeights(pb.UpdateWeightsRequest(version=version, weights_path=weights))
        return taken

    for _ in range(3):  # a steady pace: the gate learns 4 groups a version
        assert await step(fetch=True) == BATCH
    status = await stub.GetStatus(pb.GetStatusRequest())
    assert status.admission.consumed_per_version == BATCH
    assert status.admission.staleness_gating

    async def streamed() -> int:
        return (await stub.GetStatus(pb.GetStatusRequest())).tokens.buffered

    # the groups admitted for the next version have streamed tokens, which go stale with them
    await eventually("tokens generated beyond what was delivered", streamed)
    for _ in range(STALENESS + 2):  # the trainer stands still while its weights move on
        await step(fetch=False)
    stalled = await stub.GetStatus(pb.GetStatusRequest())
    # the safety net: what gating could not foresee is evicted
    assert stalled.counters.evicted_groups > status.counters.evicted_groups
    assert stalled.tokens.evicted > status.tokens.evicted

    while await step(fetch=True):  # it resumes, until everything was delivered
        pass
    final = await stub.GetStatus(pb.GetStatusRequest())
    assert max(lags) <= STALENESS, lags
    c, t = final.counters, final.tokens
    # every generated token was delivered or evicted, as the engine counted them too
    assert t.delivered == received_tokens
    assert (t.generated, c.generation_tokens) == (received_tokens + t.evicted,) * 2, (
        t,
        received_tokens,
    )
    assert t.buffered == t.dropped == t.failed == t.regenerated == 0
    assert c.acked_groups + c.evicted_groups == c.admitted_groups
