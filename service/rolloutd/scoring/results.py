"""From what a verifier returned to a :class:`SampleScore`, and a group's statistics.

A verifier returns a reward (any real number) or ``(reward, info)`` with ``info`` a small
JSON-able dict. Anything else, a non-finite reward, or a failure to produce one gives a FAILED
score of a :class:`ScoreFailure` kind (``SampleScore.failure``, so failures are counted by
kind), whose ``info`` says ``"<kind>: <what happened>"`` in words.
"""

from __future__ import annotations

import json
import math
import numbers
import statistics
from collections.abc import Sequence

from rolloutd.domain.group import GroupScores, SampleScore, ScoreFailure, ScoreStatus

INFO_LIMIT = 16_384
"""The most characters of JSON a verifier's ``info`` may take (it is kept with the group in
every snapshot)."""


def failed(kind: ScoreFailure, detail: str) -> SampleScore:
    """A FAILED score of ``kind``, whose reason names it."""
    return SampleScore(None, ScoreStatus.FAILED, f"{kind.value}: {detail}", kind)


def failure_kind(score: SampleScore) -> ScoreFailure | None:
    """The kind of a failed score (None for an OK one, or a failure of no known kind)."""
    return score.failure


def score_of(value: object) -> SampleScore:
    """The score a verifier's return value stands for (see the module docstring)."""
    reward: object
    info: object
    if isinstance(value, tuple) and len(value) == 2:
        reward, info = value
        if not isinstance(info, dict):
            return failed(
                ScoreFailure.BAD_RESULT, f"info is a {type(info).__name__}; expected a dict"
            )
    else:
        reward, info = value, None
    if not isinstance(reward, numbers.Real):
        return failed(
            ScoreFailure.BAD_RESULT,
            f"returned a {type(reward).__name__}; expected a float or (float, dict)",
        )
    number = float(reward)
    if not math.isfinite(number):
        return failed(ScoreFailure.NON_FINITE, f"returned a non-finite reward: {number}")
    if info is None:
        return SampleScore(number)
    try:
        text = json.dumps(info, allow_nan=False)
    except (TypeError, ValueError) as exc:
        return failed(ScoreFailure.BAD_RESULT, f"info is not JSON: {exc}")
    if len(text) > INFO_LIMIT:
        return failed(
            ScoreFailure.BAD_RESULT, f"info is {len(text)} characters of JSON; at most {INFO_LIMIT}"
        )
    return SampleScore(number, info=text)


def group_scores(samples: Sequence[SampleScore]) -> GroupScores:
    """The group's scores and its statistics over the rewards that were computed: their mean
    (0 when there are none) and population standard deviation (0 for fewer than two)."""
    rewards = [s.reward for s in samples if s.reward is not None]
    mean = statistics.fmean(rewards) if rewards else 0.0
    std = statistics.pstdev(rewards) if len(rewards) >= 2 else 0.0
    return GroupScores(tuple(samples), mean, std)
