"""The worker pool runs real verifiers in real processes: whatever a verifier does (raise, hang,
return garbage, kill its worker) is a failed score with the reason, and the pool goes on.

One pool of one worker serves the module, so a call after a failure shows that the pool
replaced the worker (or kept it) by the process id the next call reports.
"""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import AsyncIterator

import pytest
import pytest_asyncio

from rolloutd.scoring import ScoreFailure, ScoreStatus, ScoringInput, WorkerPool, failure_kind

pytestmark = pytest.mark.asyncio(loop_scope="module")

TIMEOUT_S = 1.0


def v(name: str) -> str:
    return f"tests.scoring.verifiers:{name}"


def sample(index: int = 0, completion: str = "abc") -> ScoringInput:
    return ScoringInput("p", "q", (), {"answer": 1}, completion, (5, 6, 7), "stop", index)


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def pool() -> AsyncIterator[WorkerPool]:
    pool = WorkerPool(1, TIMEOUT_S)
    await pool.start()
    yield pool
    await pool.aclose()


async def worker_pid(pool: WorkerPool) -> int:
    [score] = await pool.call(v("with_pid"), [sample()])
    assert score.status is ScoreStatus.OK, score
    pid: int = json.loads(score.info)["pid"]
    return pid


async def test_sync_and_async_verifiers_return_a_reward_or_a_reward_and_info(pool):
    [plain] = await pool.call(v("length"), [sample()])
    [with_info] = await pool.call(v("async_echo"), [sample(index=2)])
    assert (plain.reward, plain.info) == (3.0, "")
    assert (with_info.reward, json.loads(with_info.info)) == (2.0, {"completion": "abc"})


async def test_a_group_verifier_is_called_once_with_every_sibling(pool):
    siblings = [sample(0, "short"), sample(1, "the longest"), sample(2, "mid")]
    scores = await pool.call(v("ranked"), siblings, group=True)
    assert [(s.reward, s.info) for s in scores] == [(0.0, ""), (1.0, '{"rank": 0}'), (0.0, "")]
    short = await pool.call(v("too_few"), siblings, group=True)
    assert [failure_kind(s) for s in short] == [ScoreFailure.BAD_RESULT] * 3
    assert "returned 2 values; expected 3" in short[0].info


async def test_what_a_verifier_prints_does_not_reach_the_answers(pool):
    [score] = await pool.call(v("prints"), [sample()])
    assert score.reward == 0.5


@pytest.mark.parametrize(
    ("verifier", "kind", "says"),
    [
        ("raises", ScoreFailure.RAISED, "ValueError: the reference answer is unreadable"),
        ("nan", ScoreFailure.NON_FINITE, "nan"),
        ("not_a_number", ScoreFailure.BAD_RESULT, "returned a str"),
        ("no_such_function", ScoreFailure.RAISED, "has no attribute 'no_such_function'"),
    ],
)
async def test_a_verifier_that_fails_fails_its_score_and_its_worker_goes_on(
    pool, verifier, kind, says
):
    before = await worker_pid(pool)
    [score] = await pool.call(v(verifier), [sample()])
    assert (score.status, failure_kind(score)) == (ScoreStatus.FAILED, kind)
    assert says in score.info
    assert await worker_pid(pool) == before


@pytest.mark.parametrize(
    ("verifier", "kind", "says"),
    [
        ("hangs", ScoreFailure.TIMEOUT, f"ran past {TIMEOUT_S:g} s; its worker was killed"),
        ("exits", ScoreFailure.WORKER_DIED, "its worker died (exit code 3)"),
    ],
)
async def test_a_verifier_that_takes_its_worker_down_fails_and_the_worker_is_replaced(
    pool, verifier, kind, says
):
    before = await worker_pid(pool)
    scores = await pool.call(v(verifier), [sample()])
    assert [(s.status, failure_kind(s)) for s in scores] == [(ScoreStatus.FAILED, kind)]
    assert says in scores[0].info
    after = await worker_pid(pool)
    assert after != before and pool.pids() == [after]


async def test_a_cancelled_call_kills_its_worker_so_no_stale_answer_is_read(pool):
    before = await worker_pid(pool)
    call = asyncio.ensure_future(pool.call(v("hangs"), [sample()]))
    await asyncio.sleep(0)  # the call runs until it waits for its answer
    assert pool.idle() == 0
    call.cancel()
    with pytest.raises(asyncio.CancelledError):
        await call
    assert await worker_pid(pool) != before


async def test_a_closed_pool_has_stopped_its_workers():
    pool = WorkerPool(1, TIMEOUT_S)
    await pool.start()
    [pid] = pool.pids()
    await pool.aclose()
    with pytest.raises(ProcessLookupError):  # exited and reaped
        os.kill(pid, 0)
    with pytest.raises(RuntimeError, match="closed"):
        await pool.call(v("length"), [sample()])
