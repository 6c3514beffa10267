"""From what a verifier returned to a :class:`SampleScore`, and a group's statistics.

A verifier returns a reward (any real number) or ``(reward, info)`` with ``info`` a small
JSON-able dict. Anything else, a non-finite reward, or a failure to produce one gives a FAILED
score whose ``info`` is ``"<kind>: <what happened>"``, the kind one of :class:`ScoreFailure`
(:func:`failure_kind` reads it back, so failures can be counted by kind).
"""

from __future__ import annotations

import enum
import json
import math
import numbers
import statistics
from collections.abc import Sequence

from rolloutd.domain.finishing import GroupScores, SampleScore, ScoreStatus

INFO_LIMIT = 16_384
"""The most characters of JSON a verifier's ``info`` may take (it is kept with the group in
every snapshot)."""


class ScoreFailure(enum.Enum):
    """Why a sample has no reward."""

    RAISED = "raised"
    """The verifier raised an exception."""
    TIMEOUT = "timeout"
    """It ran past ``scoring.timeout_s`` (a Python verifier's worker is then killed and
    replaced; an HTTP verifier's request is retried)."""
    WORKER_DIED = "worker_died"
    """Its worker process exited (``os._exit``, a crash, the kernel's OOM killer)."""
    NON_FINITE = "non_finite"
    """It returned NaN or an infinity."""
    BAD_RESULT = "bad_result"
    """It returned something other than a number or ``(number, dict)``, an ``info`` that is not
    JSON or is too large, or (HTTP) a response body that is not ``{"reward": number, ...}``."""
    HTTP_STATUS = "http_status"
    """The HTTP verifier answered with an error status (4xx at once, 5xx after the retries)."""
    UNREACHABLE = "unreachable"
    """The HTTP verifier could not be reached, or dropped the connection (after the
    retries)."""


def failed(kind: ScoreFailure, detail: str) -> SampleScore:
    """A FAILED score whose reason names its kind."""
    return SampleScore(None, ScoreStatus.FAILED, f"{kind.value}: {detail}")


def failure_kind(score: SampleScore) -> ScoreFailure | None:
    """The kind of a failed score (None for an OK one)."""
    if score.status is ScoreStatus.OK:
        return None
    return ScoreFailure(score.info.partition(":")[0])


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
