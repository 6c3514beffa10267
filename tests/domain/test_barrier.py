import asyncio

import pytest

from rolloutd.domain.barrier import MutationBarrier
from rolloutd.domain.mutation import MutationKind


async def test_mutations_run_concurrently():
    barrier = MutationBarrier()
    inside = asyncio.Event()
    both = asyncio.Event()
    count = 0

    async def mutate():
        nonlocal count
        async with barrier.mutation(MutationKind.STAGE_SAMPLE):
            count += 1
            if count == 2:
                both.set()
            inside.set()
            await asyncio.wait_for(both.wait(), 1)

    await asyncio.wait_for(asyncio.gather(mutate(), mutate()), 2)
    assert count == 2


async def test_checkpoint_waits_for_active_mutation():
    barrier = MutationBarrier()
    release = asyncio.Event()
    order: list[str] = []

    async def mutate():
        async with barrier.mutation(MutationKind.ACK):
            order.append("mutation-in")
            await release.wait()
            order.append("mutation-out")

    async def checkpoint():
        async with barrier.exclusive() as timing:
            order.append("exclusive")
        return timing

    m = asyncio.create_task(mutate())
    await asyncio.sleep(0)
    c = asyncio.create_task(checkpoint())
    await asyncio.sleep(0.05)
    assert order == ["mutation-in"]
    release.set()
    timing = await c
    await m
    assert order == ["mutation-in", "mutation-out", "exclusive"]
    assert timing.wait_s >= 0.04


async def test_writer_priority_blocks_new_mutations_and_counts_them_by_kind():
    blocked: list[tuple[MutationKind, float]] = []
    barrier = MutationBarrier(on_blocked=lambda k, s: blocked.append((k, s)))
    release_first = asyncio.Event()
    order: list[str] = []

    async def long_mutation():
        async with barrier.mutation(MutationKind.STAGE_SAMPLE):
            await release_first.wait()
            order.append("first")

    async def late_mutation(kind):
        async with barrier.mutation(kind):
            order.append(kind.value)

    async def checkpoint():
        async with barrier.exclusive():
            order.append("exclusive")
            await asyncio.sleep(0.02)

    first = asyncio.create_task(long_mutation())
    await asyncio.sleep(0)
    ckpt = asyncio.create_task(checkpoint())
    await asyncio.sleep(0)
    late = [asyncio.create_task(late_mutation(k)) for k in (MutationKind.LEASE, MutationKind.ACK)]
    await asyncio.sleep(0.01)
    assert order == []  # the late mutations wait behind the checkpoint that asked first
    release_first.set()
    await asyncio.gather(first, ckpt, *late)
    assert order[:2] == ["first", "exclusive"]
    assert sorted(order[2:]) == ["ack", "lease"]
    assert sorted(k.value for k, _ in blocked) == ["ack", "lease"]
    assert all(s >= 0.015 for _, s in blocked)


async def test_a_wrong_kind_fails():
    barrier = MutationBarrier()
    with pytest.raises(TypeError):
        async with barrier.mutation("stage_sample"):  # type: ignore[arg-type]
            pass
