"""What a verifier returns becomes a score; a group's statistics; what a verifier is given."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from rolloutd.scoring import (
    SampleScore,
    ScoreFailure,
    ScoreStatus,
    ScoringInput,
    failure_kind,
    group_scores,
    score_of,
    scoring_inputs,
)
from rolloutd.scoring.results import INFO_LIMIT
from tests.scoring.groups import finishing_group

OK_CASES = [
    (1.0, 1.0, ""),
    (0, 0.0, ""),
    (True, 1.0, ""),
    (np.float32(0.25), 0.25, ""),
    ((0.5, {"steps": 3, "why": "close"}), 0.5, '{"steps": 3, "why": "close"}'),
    ((-2, {}), -2.0, "{}"),
]


@pytest.mark.parametrize(("value", "reward", "info"), OK_CASES)
def test_a_number_or_a_number_and_a_dict_is_a_reward(value, reward, info):
    assert score_of(value) == SampleScore(reward, ScoreStatus.OK, info)


FAILED_CASES = [
    (float("nan"), ScoreFailure.NON_FINITE, "non-finite reward: nan"),
    ((float("-inf"), {}), ScoreFailure.NON_FINITE, "non-finite reward: -inf"),
    ("1.0", ScoreFailure.BAD_RESULT, "returned a str"),
    (None, ScoreFailure.BAD_RESULT, "returned a NoneType"),
    ([1.0, 2.0], ScoreFailure.BAD_RESULT, "returned a list"),
    ((1.0, "fine"), ScoreFailure.BAD_RESULT, "info is a str"),
    ((1.0, {"x": object()}), ScoreFailure.BAD_RESULT, "info is not JSON"),
    ((1.0, {"x": math.nan}), ScoreFailure.BAD_RESULT, "info is not JSON"),
    ((1.0, {"x": "a" * INFO_LIMIT}), ScoreFailure.BAD_RESULT, f"at most {INFO_LIMIT}"),
]


@pytest.mark.parametrize(("value", "kind", "says"), FAILED_CASES)
def test_anything_else_is_a_failed_score_that_says_why(value, kind, says):
    score = score_of(value)
    assert score.status is ScoreStatus.FAILED and score.reward is None
    assert failure_kind(score) is kind
    assert score.info.startswith(f"{kind.value}: ") and says in score.info


def test_an_ok_score_has_no_failure_kind():
    assert failure_kind(SampleScore(1.0)) is None


def test_group_statistics_cover_the_computed_rewards_only():
    failed = score_of(float("nan"))
    scores = group_scores([SampleScore(1.0), failed, SampleScore(0.0), SampleScore(1.0)])
    assert scores.samples[1] is failed
    assert scores.mean == pytest.approx(2 / 3)
    assert scores.std == pytest.approx(math.sqrt(2 / 9))  # population, not sample, deviation
    assert group_scores([SampleScore(0.3)] * 4).std == 0.0  # exactly: equal rewards
    assert (group_scores([SampleScore(0.3), failed]).mean, group_scores([failed]).mean) == (0.3, 0)
    assert group_scores([SampleScore(0.3), failed]).std == 0.0


def test_a_verifier_gets_each_sibling_with_its_prompt_and_metadata_as_submitted():
    metadata = {"answer": 42, "tests": [{"in": "1", "out": "2"}], "nested": None}
    group = finishing_group(["forty-two", "42"], metadata)
    first, second = scoring_inputs(group)
    assert first == ScoringInput(
        prompt_id="p1",
        prompt="What is 6 x 7?",
        messages=({"role": "user", "content": "hi"},),
        metadata=metadata,
        completion="forty-two",
        token_ids=tuple(b"forty-two"),
        finish_reason="stop",
        index=0,
    )
    assert (second.index, second.completion, second.finish_reason) == (1, "42", "length")
    assert first.metadata is metadata
    json.dumps(first.metadata)
