"""Deltas over the real gRPC API (synthetic engine serving a safetensors model): loaded only on
the served base, refused whole otherwise; a restored pod catches up through the weights store's
chain before it admits anything, and refuses a chain with a missing link."""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
import pytest

from rolloutd.client import RolloutClient
from rolloutd.domain.errors import RestoreRefused
from rolloutd.server import RolloutService
from rolloutd.v1 import rollout_pb2 as pb
from rolloutd.weights.delta import make_delta, read_header
from rolloutd.weights.store import WeightsStore
from tests.weights.helpers import write_model


class LoadSpy:
    """Records each load through the engine seam: (version, tensors loaded or None for all)."""

    def __init__(self, service: RolloutService) -> None:
        self.loads: list[tuple[int, tuple[str, ...] | None]] = []
        real = service.engine.update_weights

        async def spied(path: str, version: int, **kw: object) -> None:
            self.loads.append((version, kw.get("only")))  # type: ignore[arg-type]
            await real(path, version, **kw)  # type: ignore[arg-type]

        service.engine.update_weights = spied  # type: ignore[method-assign]


def nudge(model: Path, out: Path, seed: int) -> Path:
    """``model`` with one tensor changed a little (as an optimizer step would)."""
    from safetensors.numpy import load_file, save_file

    out.mkdir(parents=True)
    for p in sorted(model.glob("*.safetensors")):
        tensors = load_file(str(p))
        if "layer.0.weight" in tensors:
            tensors["layer.0.weight"][seed % 8, :2] += 0.5
        save_file(tensors, str(out / p.name))
    return out


@pytest.fixture
async def running(serve, tmp_path: Path):
    model = write_model(tmp_path / "served", seed=0)
    service, stub = await serve(
        **{"engine.model": str(model), "weights.staging_dir": str(tmp_path / "staging")}
    )
    return service, stub, LoadSpy(service), model


async def test_a_delta_loads_only_what_changed(running, tmp_path: Path) -> None:
    service, stub, spy, model = running
    v1 = nudge(model, tmp_path / "v1", seed=1)
    stats = make_delta(model, v1, tmp_path / "v1.delta", base_version=0, version=1)
    r = await stub.UpdateWeights(
        pb.UpdateWeightsRequest(version=1, weights_path=str(tmp_path / "v1.delta"), base_version=0)
    )
    assert (r.policy_version, r.bytes) == (1, stats.bytes)
    assert r.density == pytest.approx(stats.density)
    assert set(r.phase_seconds) == {"decode", "pause", "load", "resume"}
    assert spy.loads == [(1, ("layer.0.weight",))]
    # The staged version is the full new weights, the base of the next delta.
    for p in v1.glob("*.safetensors"):
        assert (tmp_path / "staging" / "v1" / p.name).read_bytes() == p.read_bytes()
    v2 = nudge(v1, tmp_path / "v2", seed=2)
    make_delta(v1, v2, tmp_path / "v2.delta", base_version=1, version=2)
    with RolloutClient(service.addresses.grpc, interceptors=[]) as client:
        pushed = await asyncio.to_thread(client.push_delta, 1, 2, tmp_path / "v2.delta")
    [answer] = pushed.values()
    assert answer.policy_version == 2
    assert set(answer.phase_seconds) == {"transfer", "verify", "decode", "pause", "load", "resume"}


async def test_bad_deltas_are_refused_naming_what_is_wrong(running, tmp_path: Path) -> None:
    _, stub, spy, model = running
    v1 = nudge(model, tmp_path / "v1", seed=1)
    good = tmp_path / "v1.delta"
    make_delta(model, v1, good, base_version=0, version=1)
    header = read_header(good)
    entry = header.entries["layer.0.weight"]
    flipped = bytearray(good.read_bytes())
    flipped[header.data_start + entry.begin + 4] ^= 0x01
    (tmp_path / "flipped.delta").write_bytes(bytes(flipped))
    (tmp_path / "truncated.delta").write_bytes(good.read_bytes()[:-3])
    make_delta(v1, v1, tmp_path / "wrong-base.delta", base_version=3, version=4)

    async def refused(path: str, base: int, version: int = 1) -> grpc.aio.AioRpcError:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await stub.UpdateWeights(
                pb.UpdateWeightsRequest(version=version, weights_path=path, base_version=base)
            )
        return info.value

    wrong = await refused(str(tmp_path / "wrong-base.delta"), base=3, version=4)
    assert wrong.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert wrong.details() == "base_version: the delta applies to v3 but v0 is served"
    cut = await refused(str(tmp_path / "truncated.delta"), base=0)
    assert cut.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "tensor layer.0.weight: payload ends" in (cut.details() or "")
    bit = await refused(str(tmp_path / "flipped.delta"), base=0)
    assert bit.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "tensor layer.0.weight: " in (bit.details() or "")
    assert spy.loads == [], "a refused delta reached the engine"
    status = await stub.GetStatus(pb.GetStatusRequest())
    assert status.policy_version == 0
    assert not list((tmp_path / "staging").glob("v*")), "a refused delta left weights staged"


async def test_a_restored_pod_catches_up_through_the_chain_before_admitting(
    serve, tmp_path: Path
) -> None:
    model = write_model(tmp_path / "served", seed=0)
    store = WeightsStore(str(tmp_path / "store"))
    config = {
        "engine.model": str(model),
        "weights.staging_dir": str(tmp_path / "staging"),
        "weights.store": store.url,
        "restore": "latest",
    }
    # A pod serves v1 and takes a snapshot there; the trainer goes on to v3 without it.
    v1 = nudge(model, tmp_path / "v1", seed=1)
    store.publish_anchor(1, v1)
    first, stub = await serve(**config)
    assert (await stub.GetStatus(pb.GetStatusRequest())).policy_version == 1  # from the anchor
    checkpoint = await stub.Checkpoint(pb.CheckpointRequest(tag="at-v1"))
    assert checkpoint.outcome == pb.CHECKPOINT_OUTCOME_COMPLETED
    await first.shutdown(final_checkpoint=False)  # gone, as after a crash
    new_ids_from = first.controller.rooms.ids.next_local  # group ids are never reused by a store
    weights = v1
    for version in (2, 3):
        new = nudge(weights, tmp_path / f"v{version}", seed=version)
        path = tmp_path / f"v{version}.delta"
        make_delta(weights, new, path, base_version=version - 1, version=version)
        store.publish_delta(path)
        weights = new

    second, stub = await serve(**config)
    status = await stub.GetStatus(pb.GetStatusRequest())
    assert status.policy_version == 3
    admitted_at: list[int] = []
    while not admitted_at:  # restored groups (admitted at v1 before the crash) come first
        lease = await stub.FetchGroups(pb.FetchGroupsRequest(max_groups=8, wait_ms=5000))
        await stub.AckGroups(pb.AckGroupsRequest(lease_id=lease.lease_id, trainer_step=1))
        admitted_at += [g.policy_version for g in lease.groups if g.group_id >= new_ids_from]
    assert set(admitted_at) == {3}, "a group was admitted before catching up"
    for p in weights.glob("*.safetensors"):
        assert (tmp_path / "staging" / "v3" / p.name).read_bytes() == p.read_bytes()
    await second.shutdown(final_checkpoint=False)

    # The same snapshot with a link of the chain gone: refused, naming it.
    (tmp_path / "store" / "deltas" / "v2-from-v1.delta").unlink()
    with pytest.raises(RestoreRefused, match="is missing v2"):
        await serve(**config)
