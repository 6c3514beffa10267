"""Scoring: verifiers that turn a finished sample into a reward, and the finishing stage that
records the rewards on the group and drops the groups a filter rules out.

A verifier is plain Python, data in and a reward out::

    # my_rewards.py, on the service's PYTHONPATH; scoring.verifier: "my_rewards:has_answer"
    from rolloutd.scoring import ScoringInput

    def has_answer(sample: ScoringInput) -> float | tuple[float, dict]:
        ok = str(sample.metadata["answer"]) in sample.completion
        return (1.0 if ok else 0.0), {"length": len(sample.token_ids)}

See :mod:`rolloutd.scoring.stage` for the forms a verifier may take (group verifiers,
built-ins, HTTP) and where each runs.
"""

from rolloutd.domain.fate import DropReason
from rolloutd.domain.group import GroupScores, SampleScore, ScoreFailure, ScoreStatus
from rolloutd.scoring.inputs import ScoringInput, scoring_inputs
from rolloutd.scoring.pool import WorkerPool
from rolloutd.scoring.results import failure_kind, group_scores, score_of
from rolloutd.scoring.stage import (
    FilterConfig,
    OnFailure,
    PoolScorer,
    Scorer,
    ScoringConfig,
    ScoringStage,
    build_scorer,
    build_stage,
)

__all__ = [
    "DropReason",
    "FilterConfig",
    "GroupScores",
    "OnFailure",
    "PoolScorer",
    "SampleScore",
    "ScoreFailure",
    "ScoreStatus",
    "Scorer",
    "ScoringConfig",
    "ScoringInput",
    "ScoringStage",
    "WorkerPool",
    "build_scorer",
    "build_stage",
    "failure_kind",
    "group_scores",
    "score_of",
    "scoring_inputs",
]
