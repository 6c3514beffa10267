"""PushWeights and UpdateWeights from a URL against a real gRPC server (synthetic engine).

The synthetic engine serves no weights, so ``engine.model`` names a small hand-written model whose
tensors new weights must match. A spy at the engine seam proves that refused weights never reach
the engine; the real vLLM engine is in tests/integration/test_vllm_weights.py.
"""

from __future__ import annotations

import asyncio
import hashlib
import re
import uuid
from collections.abc import Iterable
from pathlib import Path

import fsspec
import grpc
import pytest

from rolloutd.client import RolloutClient, client_stream
from rolloutd.domain.engine import EngineDeadError
from rolloutd.server import RolloutService
from rolloutd.v1 import rollout_pb2 as pb
from rolloutd.v1 import rollout_pb2_grpc as pb_grpc
from rolloutd.weights import receive
from rolloutd.weights.receive import PushChunk
from tests.conftest import BUCKET
from tests.weights.helpers import SHAPES, sha256, write_model, write_sums

CHUNK = 256


class EngineSpy:
    """Counts calls through the engine's ``update_weights`` seam."""

    def __init__(self, service: RolloutService) -> None:
        self.calls: list[tuple[str, int]] = []
        real = service.engine.update_weights

        async def spied(path: str, version: int, **kw: object) -> None:
            self.calls.append((path, version))
            await real(path, version, **kw)  # type: ignore[arg-type]

        service.engine.update_weights = spied  # type: ignore[method-assign]


@pytest.fixture
def model(tmp_path: Path) -> Path:
    return write_model(tmp_path / "served", seed=0)


@pytest.fixture
async def weights_service(serve, model: Path, tmp_path: Path):
    service, stub = await serve(
        **{
            "engine.model": str(model),
            "weights.staging_dir": str(tmp_path / "staging"),
            "weights.allowed_urls": [tmp_path.as_uri()],
        }
    )
    return service, stub, EngineSpy(service)


def header(version: int, directory: Path, **override: pb.WeightsFile) -> pb.PushWeightsRequest:
    files = [
        override.get(p.name) or pb.WeightsFile(name=p.name, size=p.stat().st_size, sha256=sha256(p))
        for p in sorted(directory.glob("*.safetensors"))
    ]
    return pb.PushWeightsRequest(header=pb.PushWeightsHeader(version=version, files=files))


def chunks(directory: Path, names: Iterable[str] | None = None) -> list[pb.PushWeightsRequest]:
    out = []
    for p in sorted(directory.glob("*.safetensors")):
        if names is not None and p.name not in names:
            continue
        data = p.read_bytes()
        for offset in range(0, len(data), CHUNK):
            chunk = pb.WeightsChunk(file=p.name, offset=offset, data=data[offset : offset + CHUNK])
            out.append(pb.PushWeightsRequest(chunk=chunk))
    return out


async def push(stub: pb_grpc.RolloutServiceStub, messages: list[pb.PushWeightsRequest]):
    """The server may refuse before the last message (a stale version, on the header): the
    client reports its status, not the failed write's (see tests/test_client.py)."""
    return await client_stream(stub.PushWeights, messages)


async def sample_versions_after(stub: pb_grpc.RolloutServiceStub, version: int) -> set[int]:
    """Versions of the samples of groups admitted at ``version``, fetched until there are some."""
    versions: set[int] = set()
    for _ in range(10):
        f = await stub.FetchGroups(pb.FetchGroupsRequest(max_groups=4, wait_ms=3000))
        versions |= {
            s.policy_version for g in f.groups if g.policy_version == version for s in g.samples
        }
        await stub.AckGroups(pb.AckGroupsRequest(lease_id=f.lease_id, trainer_step=1))
        if versions:
            break
    return versions


def staged(tmp_path: Path) -> list[str]:
    root = tmp_path / "staging"
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())


async def test_a_push_loads_and_new_samples_carry_its_version(weights_service, tmp_path):
    _, stub, spy = weights_service
    new = write_model(tmp_path / "v3", seed=3)
    r = await push(stub, [header(3, new), *chunks(new)])
    size = sum(p.stat().st_size for p in new.glob("*.safetensors"))
    assert (r.policy_version, r.bytes) == (3, size)
    assert set(r.phase_seconds) == {"transfer", "verify", "pause", "load", "resume"}
    assert [v for _, v in spy.calls] == [3]
    # What the engine loaded is kept for a restart, byte for byte; nothing else stays staged.
    assert staged(tmp_path) == sorted(f"v3/{p.name}" for p in new.glob("*.safetensors"))
    for p in new.glob("*.safetensors"):
        assert (tmp_path / "staging" / "v3" / p.name).read_bytes() == p.read_bytes()
    assert await sample_versions_after(stub, 3) == {3}

    newer = write_model(tmp_path / "v4", seed=4)
    # Chunks of different files may interleave.
    a, b = (chunks(newer, [n]) for n in sorted(p.name for p in newer.glob("*.safetensors")))
    mixed = [m for pair in zip(a, b, strict=False) for m in pair] + a[len(b) :] + b[len(a) :]
    assert (await push(stub, [header(4, newer), *mixed])).policy_version == 4
    assert {p.split("/")[0] for p in staged(tmp_path)} == {"v4"}, "the older version is retired"


async def test_the_service_receives_chunks_as_views(weights_service, tmp_path, monkeypatch):
    """The fast deserializer is the one the server runs (it replaces the generated one)."""
    _, stub, _ = weights_service
    kinds: list[type] = []
    real = receive.PushReceiver.write

    async def write(self: receive.PushReceiver, chunk: PushChunk) -> None:
        kinds.append(type(chunk.data))
        await real(self, chunk)

    monkeypatch.setattr(receive.PushReceiver, "write", write)
    new = write_model(tmp_path / "v2", seed=2)
    assert (await push(stub, [header(2, new), *chunks(new)])).policy_version == 2
    assert kinds and set(kinds) == {memoryview}


def _truncated(new: Path) -> list[pb.PushWeightsRequest]:
    return [header(1, new), *chunks(new)[:-1]]


def _bad_checksum(new: Path) -> list[pb.PushWeightsRequest]:
    name = sorted(p.name for p in new.glob("*.safetensors"))[0]
    size = (new / name).stat().st_size
    wrong = pb.WeightsFile(name=name, size=size, sha256=hashlib.sha256(b"other").hexdigest())
    return [header(1, new, **{name: wrong}), *chunks(new)]


def _undeclared_chunk(new: Path) -> list[pb.PushWeightsRequest]:
    extra = pb.WeightsChunk(file="extra.safetensors", offset=0, data=b"x")
    return [header(1, new), pb.PushWeightsRequest(chunk=extra)]


def _gap(new: Path) -> list[pb.PushWeightsRequest]:
    body = chunks(new)
    return [header(1, new), body[0], *body[2:]]


def _no_header(new: Path) -> list[pb.PushWeightsRequest]:
    return chunks(new)


def _escaping_name(new: Path) -> list[pb.PushWeightsRequest]:
    bad = pb.WeightsFile(name="../evil.safetensors", size=4, sha256="0" * 64)
    return [pb.PushWeightsRequest(header=pb.PushWeightsHeader(version=1, files=[bad]))]


def _no_checksum(new: Path) -> list[pb.PushWeightsRequest]:
    name = sorted(p.name for p in new.glob("*.safetensors"))[0]
    unsummed = pb.WeightsFile(name=name, size=(new / name).stat().st_size)
    return [header(1, new, **{name: unsummed}), *chunks(new)]


def _stale_version(new: Path) -> list[pb.PushWeightsRequest]:
    return [header(0, new), *chunks(new)]


BAD_PUSHES = {
    "truncated": (_truncated, r"model-00002-of-00002.safetensors: the stream ended after \d+ of "
                  r"its \d+ bytes \(truncated\)"),
    "bad checksum": (_bad_checksum, "model-00001-of-00002.safetensors: SHA-256 is [0-9a-f]{64}, "
                     "[0-9a-f]{64} was declared"),
    "undeclared file": (_undeclared_chunk, "'extra.safetensors': that file was not declared"),
    "gap": (_gap, r"chunk at offset 512, expected 256"),
    "no header": (_no_header, "the first message of a push must be its header"),
    "escaping name": (_escaping_name, "'../evil.safetensors'.*plain file name"),
    "no checksum": (_no_checksum, "sha256 must be given"),
    "stale version": (_stale_version, "version: must be greater than the current policy version 0"),
}  # fmt: skip


@pytest.mark.parametrize("case", BAD_PUSHES)
async def test_a_bad_push_is_refused_naming_what_is_wrong(weights_service, tmp_path, case):
    _, stub, spy = weights_service
    make, message = BAD_PUSHES[case]
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await push(stub, make(write_model(tmp_path / "new", seed=1)))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.details() is not None
    assert re.search(message, info.value.details()), info.value.details()
    assert spy.calls == [], "refused weights reached the engine"
    assert (await stub.GetStatus(pb.GetStatusRequest())).policy_version == 0
    assert staged(tmp_path) == [], "a refused push left files behind"


@pytest.mark.parametrize(
    ("shapes", "message"),
    [
        ({**SHAPES, "layer.0.weight": (8, 4)}, r"tensor layer.0.weight is F32\[8, 4\], the served "
         r"model's is F32\[8, 8\]"),
        ({**SHAPES, "lora.weight": (2, 2)}, "tensor lora.weight is not a tensor of the served model"),
        ({"embed.weight": (16, 8)}, "2 tensors of the served model are missing"),
    ],
    ids=["wrong shape", "unknown tensor", "missing tensors"],
)  # fmt: skip
async def test_weights_unlike_the_served_model_never_reach_the_engine(
    weights_service, tmp_path, shapes, message
):
    _, stub, spy = weights_service
    new = write_model(tmp_path / "new", seed=1, shapes=shapes)
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await push(stub, [header(1, new), *chunks(new)])
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert re.search(message, info.value.details() or ""), info.value.details()
    assert info.value.details().startswith("model.safetensors: ") or "missing" in message
    assert spy.calls == []
    assert (await stub.GetStatus(pb.GetStatusRequest())).policy_version == 0
    # The same push with the right layout still goes through afterwards.
    good = write_model(tmp_path / "good", seed=2)
    assert (await push(stub, [header(1, good), *chunks(good)])).policy_version == 1
    assert len(spy.calls) == 1


async def test_a_local_directory_is_checked_then_loaded_in_place(weights_service, tmp_path):
    _, stub, spy = weights_service
    bad = write_model(tmp_path / "bad", seed=1, shapes={**SHAPES, "norm.weight": (9,)})
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await stub.UpdateWeights(pb.UpdateWeightsRequest(version=1, weights_path=str(bad)))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "norm.weight" in (info.value.details() or "")
    good = write_model(tmp_path / "good", seed=1)
    r = await stub.UpdateWeights(pb.UpdateWeightsRequest(version=1, weights_path=str(good)))
    assert r.policy_version == 1
    assert spy.calls == [(str(good), 1)]
    assert set(r.phase_seconds) == {"verify", "pause", "load", "resume"}


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("nope://bucket/w", "under no prefix of weights.allowed_urls"),
        ("file:///no/such/dir", "under no prefix of weights.allowed_urls"),
        ("{tmp}/no/such/dir", "does not exist"),
    ],
)
async def test_a_url_that_cannot_be_read_is_refused(weights_service, tmp_path, url, message):
    _, stub, spy = weights_service
    url = url.format(tmp=tmp_path.as_uri())
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await stub.UpdateWeights(pb.UpdateWeightsRequest(version=1, weights_path=url))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert (info.value.details() or "").startswith("weights_path: ")
    assert message in (info.value.details() or "")
    assert spy.calls == []


async def test_a_file_url_is_staged_and_verified(weights_service, tmp_path):
    _, stub, spy = weights_service
    new = write_model(tmp_path / "src", seed=5)
    write_sums(new)
    r = await stub.UpdateWeights(pb.UpdateWeightsRequest(version=2, weights_path=new.as_uri()))
    assert r.policy_version == 2
    assert set(r.phase_seconds) == {"transfer", "verify", "pause", "load", "resume"}
    assert spy.calls == [(str(tmp_path / "staging" / "v2"), 2)]


@pytest.mark.s3
async def test_weights_from_s3_are_copied_verified_and_loaded(
    serve,
    model,
    tmp_path,
    s3_options,
):
    service, stub = await serve(
        **{
            "engine.model": str(model),
            "weights.staging_dir": str(tmp_path / "staging"),
            "checkpoint.storage_options": s3_options,  # weights default to the checkpoint's
            "weights.allowed_urls": [f"s3://{BUCKET}/"],
        }
    )
    spy = EngineSpy(service)
    fs = fsspec.filesystem("s3", **s3_options, skip_instance_cache=True)
    new = write_model(tmp_path / "src", seed=6)
    write_sums(new)
    url = f"s3://{BUCKET}/{uuid.uuid4().hex}"
    fs.put(f"{new}/", f"{url}/", recursive=True)

    r = await stub.UpdateWeights(pb.UpdateWeightsRequest(version=1, weights_path=url))
    assert r.policy_version == 1
    assert r.bytes == sum(p.stat().st_size for p in new.glob("*.safetensors"))
    for p in new.glob("*.safetensors"):
        assert (tmp_path / "staging" / "v1" / p.name).read_bytes() == p.read_bytes()

    async def refused(url: str, message: str) -> None:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await stub.UpdateWeights(pb.UpdateWeightsRequest(version=2, weights_path=url))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert re.search(message, info.value.details() or ""), info.value.details()

    # A checksum that does not match what the bucket holds.
    corrupt = f"s3://{BUCKET}/{uuid.uuid4().hex}"
    fs.put(f"{new}/", f"{corrupt}/", recursive=True)
    name = sorted(p.name for p in new.glob("*.safetensors"))[0]
    data = bytearray((new / name).read_bytes())
    data[-1] ^= 0xFF
    fs.pipe_file(f"{corrupt}/{name}", bytes(data))
    await refused(corrupt, f"{name}: SHA-256 is .* was declared")
    # A file SHA256SUMS lists but the bucket lacks.
    partial = f"s3://{BUCKET}/{uuid.uuid4().hex}"
    fs.put(f"{new}/", f"{partial}/", recursive=True)
    fs.rm(f"{partial}/{name}")
    await refused(partial, f"{name}: is listed in .* but missing from it")
    await refused(f"s3://{BUCKET}/nothing-here", "holds no \\*.safetensors files|does not exist")
    # Weights of another shape, with correct checksums.
    wrong = write_model(tmp_path / "wrong", seed=7, shapes={**SHAPES, "embed.weight": (16, 4)})
    write_sums(wrong)
    misshapen = f"s3://{BUCKET}/{uuid.uuid4().hex}"
    fs.put(f"{wrong}/", f"{misshapen}/", recursive=True)
    await refused(misshapen, "tensor embed.weight is F32\\[16, 4\\]")

    assert [v for _, v in spy.calls] == [1]
    assert (await stub.GetStatus(pb.GetStatusRequest())).policy_version == 1
    assert {p.split("/")[0] for p in staged(tmp_path)} == {"v1"}


async def test_the_client_pushes_to_every_endpoint_at_once(serve, model, tmp_path):
    services = []
    for i in range(2):
        service, _ = await serve(
            **{
                "engine.model": str(model),
                "weights.staging_dir": str(tmp_path / f"staging{i}"),
                "checkpoint.dir": str(tmp_path / f"checkpoints{i}"),  # one writer per store
            }
        )
        services.append(service)
    new = write_model(tmp_path / "new", seed=8)
    endpoints = [s.addresses.grpc for s in services]
    with RolloutClient(endpoints, interceptors=[]) as client:
        answers = await asyncio.to_thread(client.push_weights, 5, new, chunk_mb=0.001)
    assert {ep: a.policy_version for ep, a in answers.items()} == dict.fromkeys(endpoints, 5)
    assert [s.controller.policy_version for s in services] == [5, 5]
    with RolloutClient(endpoints, interceptors=[]) as client, pytest.raises(grpc.RpcError) as info:
        await asyncio.to_thread(client.push_weights, 5, new)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT  # type: ignore[attr-defined]


async def test_an_engine_that_fails_while_loading_stops_the_service(weights_service, tmp_path):
    service, stub, _ = weights_service

    async def fails_half_way(path: str, version: int, **kw: object) -> None:
        raise EngineDeadError(f"loading {path} failed half-way; weights may be partly replaced")

    service.engine.update_weights = fails_half_way  # type: ignore[method-assign]
    new = write_model(tmp_path / "new", seed=1)
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await push(stub, [header(1, new), *chunks(new)])
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "not ready" in (info.value.details() or "")
    assert service.controller.policy_version == 0
    assert service.controller.fatal is not None, "the service must stop, not serve mixed weights"
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await stub.FetchGroups(pb.FetchGroupsRequest(max_groups=1))
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    assert staged(tmp_path) == []


def kept_versions(tmp_path: Path) -> set[str]:
    return {p.name for p in (tmp_path / "staging").glob("v*")}


async def test_staged_weights_stay_while_a_snapshot_may_need_them(serve, model, tmp_path):
    overrides = {"engine.model": str(model), "weights.staging_dir": str(tmp_path / "staging")}
    service, stub = await serve(**overrides)

    async def push_version(v: int) -> None:
        new = write_model(tmp_path / f"w{v}", seed=v)
        assert (await push(stub, [header(v, new), *chunks(new)])).policy_version == v

    await push_version(1)
    assert kept_versions(tmp_path) == {"v1"}
    await stub.Checkpoint(pb.CheckpointRequest(tag="at-v1"))
    await push_version(2)
    assert kept_versions(tmp_path) == {"v1", "v2"}, "the latest snapshot records v1"
    await stub.Checkpoint(pb.CheckpointRequest(tag="at-v2"))
    assert kept_versions(tmp_path) == {"v2"}
    await push_version(3)
    await service.shutdown()  # its final snapshot records v3

    restarted, stub = await serve(**overrides)
    assert restarted.controller.policy_version == restarted.engine.policy_version == 3
    assert restarted.controller.weights_path == str(tmp_path / "staging" / "v3")
    assert kept_versions(tmp_path) == {"v3"}, "the final snapshot records v3; v2 is not needed"
    await push_version(4)
    assert kept_versions(tmp_path) == {"v3", "v4"}, "the restored snapshot records v3"
