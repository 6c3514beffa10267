"""A group's finishing stage as one span, ``rolloutd.group.score``, a child of the group's
``rolloutd.group.generate`` span (:mod:`rolloutd.telemetry.generation`).

The domain reports :class:`GroupFinished` with the stage's true start and end while the
generation span is still open, so the score span is recorded after the fact with those times
and sits inside its parent in a trace view. A group has no score span when its generation span
is not open (not sampled, or finished after a restore that did not start one), or when the
stage committed it without scores (no verifier): there is nothing to tell.

Attributes say what the stage decided (committed or dropped, and why) and what the verifier
found (reward mean and standard deviation, failed scores). A drop is routine, not an error; a
stage that raised (``stage_failed``) ends the span with an error status.
"""

from __future__ import annotations

from opentelemetry import trace
from opentelemetry.trace import Span, SpanKind, Status, StatusCode, Tracer
from opentelemetry.util.types import AttributeValue

from rolloutd.domain.fate import DropReason
from rolloutd.domain.group import ScoreStatus
from rolloutd.domain.observer import GroupFinished
from rolloutd.telemetry.catalogue import GroupOutcome
from rolloutd.telemetry.generation import GroupAttr

SCORE_SPAN = "rolloutd.group.score"


class ScoreAttr:
    """Keys on ``rolloutd.group.score``."""

    OUTCOME = "rolloutd.group.outcome"
    """``committed`` or ``dropped``."""
    DROP_REASON = "rolloutd.group.drop.reason"
    """The verdict's reason as the stage gave it (only on a dropped group)."""
    DROP_DETAIL = "rolloutd.group.drop.detail"
    """Why, in words (only on a dropped group, when the stage said)."""
    REWARD_MEAN = "rolloutd.group.reward.mean"
    REWARD_STD = "rolloutd.group.reward.std"
    """Over the rewards computed (only on a scored group)."""
    SCORES_FAILED = "rolloutd.group.scores.failed"
    """Siblings whose score failed (only on a scored group)."""
    TOKENS = "rolloutd.group.tokens"
    """Generated tokens of all siblings (what a drop wastes)."""


def scored(event: GroupFinished) -> bool:
    """Whether the stage did anything worth a span: it scored the group, or dropped it."""
    return event.verdict.scores is not None or not event.verdict.commits


def record_score(tracer: Tracer, parent: Span, event: GroupFinished) -> None:
    """Records the span of ``event`` under ``parent``, the group's open generation span."""
    verdict = event.verdict
    outcome = GroupOutcome.COMMITTED if verdict.commits else GroupOutcome.DROPPED
    attributes: dict[str, AttributeValue] = {
        GroupAttr.ID: event.group_id,
        ScoreAttr.OUTCOME: outcome.value,
        ScoreAttr.TOKENS: event.tokens,
    }
    if verdict.drop_reason is not None:
        attributes[ScoreAttr.DROP_REASON] = verdict.drop_reason
        if verdict.detail:
            attributes[ScoreAttr.DROP_DETAIL] = verdict.detail
    if verdict.scores is not None:
        attributes[ScoreAttr.REWARD_MEAN] = verdict.scores.mean
        attributes[ScoreAttr.REWARD_STD] = verdict.scores.std
        attributes[ScoreAttr.SCORES_FAILED] = sum(
            s.status is ScoreStatus.FAILED for s in verdict.scores.samples
        )
    span = tracer.start_span(
        SCORE_SPAN,
        context=trace.set_span_in_context(parent),
        kind=SpanKind.INTERNAL,
        attributes=attributes,
        start_time=event.started_ns,
    )
    if verdict.drop_reason is DropReason.STAGE_FAILED:
        span.set_status(Status(StatusCode.ERROR, verdict.detail or DropReason.STAGE_FAILED))
    span.end(end_time=event.ended_ns)
