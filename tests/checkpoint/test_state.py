import json

from rolloutd.checkpoint import state
from rolloutd.domain.buffer import GroupMeta
from rolloutd.domain.controller import Controller, ControllerConfig
from rolloutd.domain.group import Prompt
from rolloutd.domain.sampler import Sampler
from tests.fakes import GatedEngine, settle


async def test_the_spliced_sidecar_is_the_json_of_the_whole_state():
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
    data = state.sidecar_json(capture, [state.encode_group(m) for m in metas])
    parsed = json.loads(data)
    assert parsed["groups"] == [state.meta_to_json(m) for m in metas]
    assert {k: v for k, v in parsed.items() if k != "groups"} == json.loads(
        json.dumps(state.sidecar(capture))
    )
    empty = json.loads(state.sidecar_json(capture, []))
    assert empty["groups"] == []
