"""The scoring stage decides finished groups with a real verifier in real worker processes
(one pool for the module): it records the rewards and their statistics, drops groups of equal
(or nearly equal) rewards when the filter is on, and drops or delivers groups with a failed
score as configured."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from dataclasses import replace

import pytest
import pytest_asyncio

from rolloutd.scoring import (
    DropReason,
    FilterConfig,
    OnFailure,
    PoolScorer,
    SampleScore,
    ScoreFailure,
    ScoreStatus,
    ScoringConfig,
    ScoringStage,
    WorkerPool,
    build_stage,
    failure_kind,
)
from rolloutd.scoring.http import HttpVerifier
from tests.scoring.groups import finishing_group, rewarded

pytestmark = pytest.mark.asyncio(loop_scope="module")


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def scorer() -> AsyncIterator[PoolScorer]:
    """Sibling i's reward is ``metadata["rewards"][i]``; a None there makes the verifier raise."""
    scorer = PoolScorer(WorkerPool(2, 10.0), "tests.scoring.verifiers:from_metadata")
    await scorer.start()
    yield scorer
    await scorer.aclose()


def stage(scorer: PoolScorer, **filter: float | bool) -> ScoringStage:
    return ScoringStage(scorer, filter=FilterConfig(**filter))  # type: ignore[arg-type]


async def test_a_committed_group_carries_its_rewards_and_their_statistics(scorer):
    verdict = await stage(scorer).finish(rewarded([1, 0, 1, 0]))
    assert verdict.commits and verdict.scores is not None
    assert [s.reward for s in verdict.scores.samples] == [1.0, 0.0, 1.0, 0.0]
    assert (verdict.scores.mean, verdict.scores.std) == (0.5, 0.5)


async def test_the_zero_variance_filter_drops_a_group_of_equal_rewards(scorer):
    filtered = stage(scorer, zero_variance=True)
    dropped = await filtered.finish(rewarded([1, 1, 1, 1]))
    assert dropped.drop_reason == DropReason.ZERO_VARIANCE.value == "zero_variance"
    assert dropped.scores is not None and dropped.scores.mean == 1.0
    assert (await filtered.finish(rewarded([1, 1, 1, 0]))).commits
    assert (await stage(scorer).finish(rewarded([0, 0, 0, 0]))).commits  # filter off


async def test_min_reward_std_drops_groups_of_nearly_equal_continuous_rewards(scorer):
    close = rewarded([0.50, 0.51, 0.49, 0.50])  # std ~0.007: no zero variance, little signal
    assert (await stage(scorer, zero_variance=True).finish(close)).commits
    strict = stage(scorer, zero_variance=True, min_reward_std=0.05)
    assert (await strict.finish(close)).drop_reason == "zero_variance"
    assert (await strict.finish(rewarded([0.2, 0.9, 0.4, 0.7]))).commits


async def test_a_failed_score_drops_its_group_by_default(scorer):
    verdict = await stage(scorer).finish(rewarded([1, None, 0, 1]))
    assert verdict.drop_reason == DropReason.SCORING_FAILED.value == "scoring_failed"
    assert verdict.scores is not None
    assert [s.status for s in verdict.scores.samples] == [
        ScoreStatus.OK,
        ScoreStatus.FAILED,
        ScoreStatus.OK,
        ScoreStatus.OK,
    ]


async def test_on_failure_deliver_commits_the_group_with_its_failed_scores(scorer):
    deliver = ScoringStage(scorer, on_failure=OnFailure.DELIVER)
    verdict = await deliver.finish(rewarded([1, None, 0, 1]))
    assert verdict.commits and verdict.scores is not None
    failed = verdict.scores.samples[1]
    assert failure_kind(failed) is ScoreFailure.RAISED and failed.reward is None
    assert "ValueError: no reward for sibling 1" in failed.info
    assert verdict.scores.mean == pytest.approx(2 / 3)  # over the three computed rewards


async def test_delivered_failures_leave_the_filter_to_judge_the_computed_rewards(scorer):
    both = ScoringStage(scorer, on_failure=OnFailure.DELIVER, filter=FilterConfig(True))
    verdict = await both.finish(rewarded([1, None, 1, 1]))
    assert verdict.drop_reason == "zero_variance"


async def test_build_stage_scores_with_a_built_in_in_its_own_workers():
    built = build_stage(
        ScoringConfig(verifier="builtin:math", workers=1), FilterConfig(zero_variance=True)
    )
    assert built is not None
    try:
        right_and_wrong = finishing_group(["it is 42", "\\boxed{41}"], {"answer": 42})
        verdict = await built.finish(right_and_wrong)
        assert verdict.commits and verdict.scores is not None
        assert [s.reward for s in verdict.scores.samples] == [1.0, 0.0]
        both_right = finishing_group(["42", "so \\boxed{42}"], {"answer": "42"})
        assert (await built.finish(both_right)).drop_reason == "zero_variance"
    finally:
        await built.aclose()


async def test_build_stage_scores_a_group_at_once_with_a_group_verifier():
    built = build_stage(
        ScoringConfig(group_verifier="tests.scoring.verifiers:ranked", workers=1), FilterConfig()
    )
    assert built is not None
    try:
        await built.start()
        verdict = await built.finish(finishing_group(["a", "abc", "ab"]))
        assert verdict.scores is not None
        assert [s.reward for s in verdict.scores.samples] == [0.0, 1.0, 0.0]
        assert json.loads(verdict.scores.samples[1].info) == {"rank": 0}
    finally:
        await built.aclose()


async def test_a_url_is_an_http_verifier():
    built = build_stage(ScoringConfig(verifier="https://rewards.internal/v1/score"), FilterConfig())
    assert built is not None and isinstance(built.scorer, HttpVerifier)
    await built.aclose()


class Constant:
    """A scorer that gives every sample one reward (what a source's own verifier would)."""

    def __init__(self, reward: float) -> None:
        self.reward = reward
        self.started = self.closed = False

    async def start(self) -> None:
        self.started = True

    async def score(self, inputs):  # type: ignore[no-untyped-def]
        return [SampleScore(self.reward) for _ in inputs]

    async def aclose(self) -> None:
        self.closed = True


async def test_a_sources_own_verifier_scores_its_groups_and_the_others_keep_theirs(scorer):
    code = Constant(0.25)
    per_source = ScoringStage(scorer, by_source={"code": code})  # type: ignore[dict-item]
    await per_source.start()
    mine = await per_source.finish(replace(rewarded([1, 0]), source="code"))
    others = await per_source.finish(replace(rewarded([1, 0]), source="math"))
    assert mine.scores is not None and [s.reward for s in mine.scores.samples] == [0.25, 0.25]
    assert others.scores is not None and [s.reward for s in others.scores.samples] == [1.0, 0.0]
    only = ScoringStage(None, by_source={"code": code})  # type: ignore[dict-item]
    unscored = await only.finish(replace(rewarded([1, 0]), source="chat"))
    assert unscored.commits and unscored.scores is None
    await only.aclose()
    assert code.started and code.closed
