"""What an UpdateWeights or PushWeights caller may not do, against a real gRPC server (synthetic
engine): name a URL or file the operator did not allow, stall the service with a URL that never
answers, hold pushes open, or fill the disk. Each refusal names the setting and loses nothing."""

from __future__ import annotations

import asyncio
import errno
import socket
import threading
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import grpc
import pytest

from rolloutd.v1 import rollout_pb2 as pb
from rolloutd.weights import receive
from tests.api.test_weights_rpc import EngineSpy, chunks, header, push, staged
from tests.waiting import eventually
from tests.weights.helpers import write_model


class Port:
    """A TCP port on 127.0.0.1 that takes connections (the kernel's backlog) and never answers;
    :meth:`close` resets them, so a client blocked on one returns."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.sock.setblocking(False)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}/w"

    def connected(self) -> bool:
        try:
            self.sock.accept()[0].close()
        except BlockingIOError:
            return False
        return True

    def close(self) -> None:
        self.sock.close()


@pytest.fixture
def port() -> Iterator[Port]:
    p = Port()
    yield p
    p.close()


@pytest.fixture
def model(tmp_path: Path) -> Path:
    return write_model(tmp_path / "served", seed=0)


async def start(serve, model: Path, tmp_path: Path, **overrides: object):
    service, stub = await serve(
        **{"engine.model": str(model), "weights.staging_dir": str(tmp_path / "staging")},
        **overrides,
    )
    return service, stub, EngineSpy(service)


async def update(stub, version: int, path: str):
    return await stub.UpdateWeights(pb.UpdateWeightsRequest(version=version, weights_path=path))


async def refusal(call) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await call
    return info.value


async def test_a_url_is_refused_by_default_without_connecting(serve, model, tmp_path, port):
    _, stub, spy = await start(serve, model, tmp_path)
    error = await refusal(update(stub, 1, port.url + "/"))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert error.details() == (
        "weights_path: URLs are refused: weights.allowed_urls is empty (local directories under "
        "weights.local_root only)"
    )
    assert not port.connected(), "the service connected to a URL it should have refused"
    assert spy.calls == []


async def test_a_stalled_url_leaves_the_data_plane_and_checkpoints_alone(
    serve, model, tmp_path, port
):
    """Eight updates from a URL that never answers: one runs, seven are refused at once; leases,
    acks, submissions and a checkpoint go on meanwhile. Before, the eight used up the threads
    that the journal shares, and FetchGroups waited for the fetches."""
    _, stub, spy = await start(serve, model, tmp_path, **{"weights.allowed_urls": [port.url]})
    updates = [asyncio.create_task(update(stub, v, f"{port.url}/step-{v}")) for v in range(1, 9)]
    await eventually("seven updates ended", lambda: sum(t.done() for t in updates) == 7)
    refused = [t.exception() for t in updates if t.done()]
    assert {e.code() for e in refused} == {grpc.StatusCode.FAILED_PRECONDITION}  # type: ignore[union-attr]
    assert "updates run one at a time" in (refused[0].details() or "")  # type: ignore[union-attr]
    await eventually("the running update connected", port.connected)

    s = await stub.SubmitPrompts(
        pb.SubmitPromptsRequest(prompts=[pb.Prompt(prompt_id="p-stall", text="1+1=")]),
        timeout=30,
    )
    assert s.accepted == 1
    f = await stub.FetchGroups(pb.FetchGroupsRequest(max_groups=2, wait_ms=10_000), timeout=30)
    assert f.groups
    await stub.AckGroups(pb.AckGroupsRequest(lease_id=f.lease_id, trainer_step=1), timeout=30)
    c = await stub.Checkpoint(pb.CheckpointRequest(tag="during-stall"), timeout=30)
    assert c.outcome == pb.CHECKPOINT_OUTCOME_COMPLETED
    [stalled] = [t for t in updates if not t.done()]

    port.close()  # the remote end goes away: what failed, not what it answered
    error = await refusal(stalled)
    assert error.code() == grpc.StatusCode.UNAVAILABLE
    assert error.details() == (
        "weights_path: listing the URL failed (the service log has the details)"
    )
    assert spy.calls == []
    good = write_model(tmp_path / "good", seed=1)
    assert (await update(stub, 1, str(good))).policy_version == 1


async def test_a_transfer_past_its_timeout_is_abandoned(serve, model, tmp_path, port):
    _, stub, spy = await start(
        serve,
        model,
        tmp_path,
        **{"weights.allowed_urls": [port.url], "weights.transfer_timeout_s": 0.5},
    )
    error = await refusal(update(stub, 1, f"{port.url}/step-1"))
    assert error.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert error.details() == (
        "weights_path: the transfer took longer than weights.transfer_timeout_s (0.5 s) and was "
        "abandoned"
    )
    # Its thread still waits on the socket: the updater takes no other update meanwhile, so
    # the threads it holds stay bounded however often a caller retries.
    again = await refusal(update(stub, 1, f"{port.url}/step-1"))
    assert again.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "the abandoned transfer of the update to v1 is in progress" in (again.details() or "")
    port.close()
    good = write_model(tmp_path / "good", seed=1)

    async def accepted() -> bool:
        try:
            return (await update(stub, 1, str(good))).policy_version == 1
        except grpc.aio.AioRpcError as exc:
            assert exc.code() == grpc.StatusCode.FAILED_PRECONDITION, exc
            return False

    await eventually("updates are accepted once the stalled thread ended", accepted)
    assert spy.calls == [(str(good), 1)]
    assert not list((tmp_path / "staging" / "incoming").iterdir())


def writer_threads() -> int:
    return sum(t.name == "push-writer" for t in threading.enumerate())


async def test_idle_pushes_are_capped_and_timed_out(serve, model, tmp_path):
    """Twenty pushes that send their header and then nothing: before, each held a writer
    thread for as long as its client liked (200 such: 19 -> 219 threads)."""
    _, stub, spy = await start(serve, model, tmp_path, **{"weights.push_idle_timeout_s": 1})
    new = write_model(tmp_path / "new", seed=1)
    hold = asyncio.Event()

    async def idle(version: int) -> AsyncIterator[pb.PushWeightsRequest]:
        yield header(version, new)
        await hold.wait()

    before = writer_threads()
    calls = [asyncio.ensure_future(stub.PushWeights(idle(v))) for v in range(1, 21)]
    await eventually("nineteen pushes refused", lambda: sum(c.done() for c in calls) >= 19)
    assert writer_threads() - before <= 1
    done = [c for c in calls if c.done()]
    assert all(c.exception().code() == grpc.StatusCode.FAILED_PRECONDITION for c in done)  # type: ignore[union-attr]
    errors = [await refusal(c) for c in calls if c not in done]
    assert [e.code() for e in errors] == [grpc.StatusCode.DEADLINE_EXCEEDED]
    assert errors[0].details() == (
        "push: no message for weights.push_idle_timeout_s (1 s); the push was abandoned"
    )
    hold.set()
    await eventually("the writer thread ended", lambda: writer_threads() == before)
    assert staged(tmp_path) == [] and spy.calls == []
    assert (await push(stub, [header(1, new), *chunks(new)])).policy_version == 1


async def test_a_full_disk_is_resource_exhausted(serve, model, tmp_path, monkeypatch):
    _, stub, spy = await start(serve, model, tmp_path)

    def no_space(fd: int, data: object, offset: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(receive, "_write", no_space)
    new = write_model(tmp_path / "new", seed=1)
    error = await refusal(push(stub, [header(1, new), *chunks(new)]))
    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert error.details() == "weights: the disk of weights.staging_dir is full; retry later"
    assert staged(tmp_path) == [] and spy.calls == []
    assert (await stub.GetStatus(pb.GetStatusRequest())).policy_version == 0


async def test_a_symlink_out_of_the_weights_directory_leaks_nothing(serve, model, tmp_path):
    _, stub, spy = await start(serve, model, tmp_path)
    weights = write_model(tmp_path / "w", seed=1)
    victim = sorted(weights.glob("*.safetensors"))[-1]
    victim.unlink()
    victim.symlink_to("/etc/passwd")
    error = await refusal(update(stub, 1, str(weights)))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert error.details() == f"{victim.name}: not a safetensors file"
    assert spy.calls == []


async def test_local_weights_outside_the_local_root_are_refused(serve, model, tmp_path):
    root = tmp_path / "trainer"
    _, stub, spy = await start(serve, model, tmp_path, **{"weights.local_root": str(root)})
    outside = write_model(tmp_path / "elsewhere", seed=1)
    error = await refusal(update(stub, 1, str(outside)))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert error.details() == "weights_path: local weights must be under weights.local_root"
    inside = write_model(root / "step-1", seed=1)
    assert (await update(stub, 1, str(inside))).policy_version == 1
    assert spy.calls == [(str(inside), 1)]
