import json

from rolloutd.checkpoint import sidecar
from rolloutd.domain.controller import Controller, ControllerConfig
from rolloutd.domain.group import GroupMeta, Prompt
from rolloutd.domain.sampler import Admission, Sampler
from tests.controllers import fetch
from tests.fakes import GatedEngine, settle


async def test_the_sidecar_holds_no_groups_and_format_1_groups_still_decode():
    prompts = [
        Prompt(f"p{i}", f"q {i}", metadata={"answer": i, "note": 'quotes " and \\\\'})
        for i in range(6)
    ]
    c = Controller(
        ControllerConfig(group_size=2, max_in_flight=3, buffer_capacity=3),
        GatedEngine(auto=True),
        Sampler(prompts, seed=0),
    )
    c.start()
    await settle(lambda: c.status().buffer.committed == 3)
    async with c.barrier.exclusive():
        capture = c.capture()
    await c.stop()
    metas = [m for m in capture.buffer.groups.values() if isinstance(m, GroupMeta)]
    parsed = json.loads(sidecar.encode(capture))
    assert "groups" not in parsed
    assert parsed == json.loads(json.dumps(sidecar.head(capture)))
    encoded = [sidecar.encode_group(m) for m in metas]
    assert [json.loads(g) for g in encoded] == [sidecar.to_json(m) for m in metas]
    # a sidecar of manifest format 1 held every group itself
    old = {**parsed, "groups": [json.loads(g) for g in encoded]}
    assert sidecar.decode(old).buffer.groups == sidecar.decode(parsed, metas).buffer.groups
    # and format-2 group segments a JSON document per group
    assert sidecar.decode_groups(encoded) == metas
    assert sidecar.decode(parsed).buffer.groups == {}


async def test_the_decoder_gives_back_the_state_the_encoder_was_given():
    prompts = [Prompt(f"p{i}", f"q {i}", metadata={"answer": i}) for i in range(8)]
    c = Controller(
        ControllerConfig(group_size=2, max_in_flight=2, buffer_capacity=4, rewind_window=0),
        GatedEngine(auto=True),
        Sampler(prompts, seed=0),
    )
    c.start()
    await settle(lambda: c.status().buffer.committed == 4)
    lease, _ = await fetch(c, 2, 0, "t")
    await c.ack(lease.lease_id, 3)  # finalized at once (window 0): the ledger has an entry
    lease, _ = await fetch(c, 1, 0, "t")
    await c.submit([Admission(Prompt("s", "submitted"), None)])
    async with c.barrier.exclusive():
        capture = c.capture()
    await c.stop()
    metas = [m for m in capture.buffer.groups.values() if m is not None]
    decoded = sidecar.decode(json.loads(sidecar.encode(capture)), metas)
    assert decoded.buffer.groups == {m.group_id: m for m in metas}
    assert (
        decoded.ledger.leases == capture.ledger.leases and lease.lease_id in decoded.ledger.leases
    )
    assert decoded.ledger.acks == capture.ledger.acks
    # the finalized leases are in the snapshot's ledger pieces, not the sidecar
    assert capture.ledger.finalized_leases != {} and decoded.ledger.finalized_leases == {}
    assert "finalized_leases" not in sidecar.head(capture)
    assert decoded.sampler.cursor == capture.sampler.cursor
    # the prompts themselves are in the snapshot's submissions pieces; the sidecar counts them
    assert decoded.sampler.submitted_len == capture.sampler.submitted_len == 1
    assert decoded.sampler.submitted_prompts == [] and "submitted" not in json.dumps(
        sidecar.head(capture)["sampler"]
    ).replace("submitted_", "")
    assert decoded.counters == capture.counters
    assert (
        decoded.next_group_id,
        decoded.ledger.max_acked_step,
        decoded.ledger.finalized_through,
    ) == (
        capture.next_group_id,
        capture.ledger.max_acked_step,
        capture.ledger.finalized_through,
    )
