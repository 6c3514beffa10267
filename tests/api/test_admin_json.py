"""One JSON shape for the admin app and the CLI: lower-case enum names, numbers as numbers, zero
fields present, the same field names (a real service over HTTP, and `rolloutd checkpoints`)."""

from __future__ import annotations

import io
import json

import httpx

from rolloutd.checkpoint.inspect import main as checkpoints_main
from rolloutd.v1 import rollout_pb2 as pb


async def test_status_json_is_plain(serve):
    service, stub = await serve()
    async with httpx.AsyncClient(base_url=f"http://{service.addresses.http}") as http:
        before = (await http.get("/v1/status")).json()
        await stub.Checkpoint(pb.CheckpointRequest(tag="step-1", trainer_step=1))
        after = (await http.get("/v1/status")).json()
    assert before["state"] == "serving"
    assert before["policy_version"] == 0 and before["cursor_epoch"] == 0  # present, numbers
    assert before["dataset_exhausted"] is False
    assert isinstance(before["counters"]["generation_tokens"], int)
    assert before["counters"]["acked_groups"] == 0
    nothing_yet = before["last_checkpoint"]
    assert nothing_yet["outcome"] == "unspecified" and nothing_yet["sequence"] == 0
    assert nothing_yet["completed_at"] == 0  # not the process start time
    last = after["last_checkpoint"]
    assert (last["outcome"], last["reason"], last["tag"]) == ("completed", "completed", "step-1")
    assert last["sequence"] == 1 and last["completed_at"] > 0


async def test_the_cli_and_http_list_snapshots_with_the_same_fields(serve, tmp_path):
    service, stub = await serve()
    await stub.Checkpoint(pb.CheckpointRequest(tag="step-1", trainer_step=1))
    async with httpx.AsyncClient(base_url=f"http://{service.addresses.http}") as http:
        [over_http] = (await http.get("/v1/checkpoints")).json()
    out = io.StringIO()
    assert (
        checkpoints_main(["list", "--json", "--dir", service.config.checkpoint.dir], out=out) == 0
    )
    [from_cli] = json.loads(out.getvalue())
    assert {k: from_cli[k] for k in over_http} == over_http
