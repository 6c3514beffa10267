"""``rolloutd.group.score``: the finishing stage's decision about a group, as a child of the
group's generation span with the stage's true times; and the same spans and the reward metrics
from a controller that scores with a real verifier in a worker process."""

from __future__ import annotations

import time
from typing import Any

import pytest
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.trace import StatusCode

from rolloutd.domain.controller import Controller, ControllerConfig
from rolloutd.domain.finishing import COMMIT, SampleScore, ScoreStatus, Verdict
from rolloutd.domain.group import Prompt
from rolloutd.domain.observer import GenerationStarted, GroupCommitted, GroupFinished
from rolloutd.domain.sampler import Sampler
from rolloutd.scoring import FilterConfig, PoolScorer, ScoringStage, WorkerPool, group_scores
from rolloutd.telemetry.generation import GENERATE_SPAN, GroupAttr
from rolloutd.telemetry.observer import TelemetryObserver
from rolloutd.telemetry.score import SCORE_SPAN, ScoreAttr
from tests.fakes import GatedEngine, settle
from tests.telemetry.reports import MS
from tests.telemetry.test_metrics import collect, value

pytestmark = pytest.mark.usefixtures("clean_env")


def started(group_id: int) -> GenerationStarted:
    return GenerationStarted(group_id, f"p{group_id}", 2, time.time() - 1.0, 32, 1.0, 1.0)


def by_name(spans: tuple[ReadableSpan, ...], name: str) -> list[ReadableSpan]:
    return [s for s in spans if s.name == name]


def child_of(span: ReadableSpan, parent: ReadableSpan) -> bool:
    assert span.parent is not None and span.context is not None and parent.context is not None
    return (span.parent.span_id, span.context.trace_id) == (
        parent.context.span_id,
        parent.context.trace_id,
    )


@pytest.fixture
def observer(span_exporter, metric_reader) -> TelemetryObserver:
    return TelemetryObserver(span_exporter[0], metric_reader[0])


def test_a_scored_group_has_a_score_span_inside_its_generation_span(observer, span_exporter):
    _, exporter = span_exporter
    observer.generation_started(started(7))
    begin = time.time_ns() - 50 * MS
    scores = group_scores([SampleScore(1.0), SampleScore(0.0)])
    observer.group_finished(GroupFinished(7, begin, begin + 40 * MS, Verdict(scores=scores), 64))
    observer.group_committed(GroupCommitted(7, 64, True, 1.0, prompt_tokens=3, group_size=2))
    [generate] = by_name(exporter.get_finished_spans(), GENERATE_SPAN)
    [score] = by_name(exporter.get_finished_spans(), SCORE_SPAN)
    assert child_of(score, generate)
    assert (score.start_time, score.end_time) == (begin, begin + 40 * MS)
    assert generate.start_time <= score.start_time and score.end_time <= generate.end_time
    assert dict(score.attributes or {}) == {
        GroupAttr.ID: 7,
        ScoreAttr.OUTCOME: "committed",
        ScoreAttr.TOKENS: 64,
        ScoreAttr.REWARD_MEAN: 0.5,
        ScoreAttr.REWARD_STD: 0.5,
        ScoreAttr.SCORES_FAILED: 0,
    }
    assert score.status.status_code is StatusCode.UNSET


def test_a_dropped_group_says_why_and_a_failed_stage_is_an_error(observer, span_exporter):
    _, exporter = span_exporter
    now = time.time_ns()
    failed = SampleScore(None, ScoreStatus.FAILED, "timeout: ran past 30 s")
    scores = group_scores([failed, SampleScore(1.0)])
    for group_id, verdict in [
        (1, Verdict("scoring_failed", "1 of 2 scores failed", scores)),
        (2, Verdict("stage_failed", "ValueError: no reward for you")),
    ]:
        observer.generation_started(started(group_id))
        observer.group_finished(GroupFinished(group_id, now, now + MS, verdict, 10))
        observer.generation_abandoned(group_id, verdict.drop_reason or "")
    one, two = sorted(
        by_name(exporter.get_finished_spans(), SCORE_SPAN), key=lambda s: s.attributes[GroupAttr.ID]
    )
    assert dict(one.attributes or {}) == {
        GroupAttr.ID: 1,
        ScoreAttr.OUTCOME: "dropped",
        ScoreAttr.DROP_REASON: "scoring_failed",
        ScoreAttr.DROP_DETAIL: "1 of 2 scores failed",
        ScoreAttr.TOKENS: 10,
        ScoreAttr.REWARD_MEAN: 1.0,
        ScoreAttr.REWARD_STD: 0.0,
        ScoreAttr.SCORES_FAILED: 1,
    }
    assert one.status.status_code is StatusCode.UNSET  # a drop is routine
    assert two.attributes[ScoreAttr.DROP_REASON] == "stage_failed"
    assert ScoreAttr.REWARD_MEAN not in two.attributes
    assert two.status.status_code is StatusCode.ERROR


def test_an_unscored_commit_or_a_group_without_generation_span_has_no_score_span(
    observer, span_exporter
):
    _, exporter = span_exporter
    now = time.time_ns()
    observer.generation_started(started(1))
    observer.group_finished(GroupFinished(1, now, now + MS, COMMIT, 10))  # no verifier
    scores = group_scores([SampleScore(1.0), SampleScore(0.0)])
    observer.group_finished(GroupFinished(2, now, now + MS, Verdict(scores=scores), 10))
    assert by_name(exporter.get_finished_spans(), SCORE_SPAN) == []


# --- a controller with a real verifier --------------------------------------------------------

REWARDS: dict[str, list[float | None]] = {
    "p0": [1, 0],  # committed, mean 0.5
    "p1": [1, 1],  # zero variance: dropped
    "p2": [0, 0],  # zero variance: dropped
    "p3": [None, 1],  # the verifier raises on sibling 0: dropped as scoring_failed
    "p4": [0, 1],  # committed
}
PROMPTS = [Prompt(pid, f"question {pid}", {"rewards": r}) for pid, r in REWARDS.items()]


def attrs(span: ReadableSpan) -> dict[str, Any]:
    return dict(span.attributes or {})


async def test_a_scoring_controller_reports_score_spans_and_reward_metrics(
    span_exporter, metric_reader
):
    (tracer_provider, exporter), (meter_provider, reader) = span_exporter, metric_reader
    stage = ScoringStage(
        PoolScorer(WorkerPool(1, 10.0), "tests.scoring.verifiers:from_metadata"),
        filter=FilterConfig(zero_variance=True),
    )
    await stage.start()
    c = Controller(
        ControllerConfig(group_size=2, max_in_flight=8, buffer_capacity=8),
        GatedEngine(auto=True),
        Sampler(PROMPTS, seed=0, epochs=1),
        observer=TelemetryObserver(tracer_provider, meter_provider),
        stage=stage,
    )
    c.start()
    try:
        await settle(
            lambda: (
                c.rooms.accounting.counters.committed_groups
                + c.rooms.accounting.counters.dropped_groups
                == 5
            ),
            30,
        )
    finally:
        await c.stop()
        await stage.aclose()
    assert c.rooms.accounting.counters.dropped_by_reason == {
        "zero_variance": 2,
        "scoring_failed": 1,
    }

    spans = exporter.get_finished_spans()
    generate = {attrs(s)[GroupAttr.ID]: s for s in by_name(spans, GENERATE_SPAN)}
    score = {attrs(s)[GroupAttr.ID]: s for s in by_name(spans, SCORE_SPAN)}
    assert set(score) == set(generate) and len(score) == 5
    by_prompt = {attrs(generate[g])[GroupAttr.PROMPT_ID]: score[g] for g in score}
    for group_id, span in score.items():
        parent = generate[group_id]
        assert child_of(span, parent)
        assert parent.start_time <= span.start_time <= span.end_time <= parent.end_time
    assert attrs(by_prompt["p0"])[ScoreAttr.OUTCOME] == "committed"
    assert attrs(by_prompt["p0"])[ScoreAttr.REWARD_MEAN] == 0.5
    assert attrs(by_prompt["p1"])[ScoreAttr.DROP_REASON] == "zero_variance"
    assert attrs(by_prompt["p3"])[ScoreAttr.DROP_REASON] == "scoring_failed"
    assert attrs(by_prompt["p3"])[ScoreAttr.SCORES_FAILED] == 1

    m = collect(reader)
    assert value(m["rolloutd.sample.reward"], outcome="committed").count == 4
    assert value(m["rolloutd.sample.reward"], outcome="committed").sum == 2.0
    assert value(m["rolloutd.sample.reward"], outcome="dropped").count == 5
    assert value(m["rolloutd.group.score.duration"]).count == 5
    assert value(m["rolloutd.scoring.failures"], **{"failure.kind": "raised"}) == 1
    assert value(m["rolloutd.dropped.groups"], reason="zero_variance") == 2
    assert value(m["rolloutd.dropped.groups"], reason="scoring_failed") == 1
    wasted = sum(
        value(m["rolloutd.dropped.tokens"], reason=r)
        for r in c.rooms.accounting.counters.dropped_by_reason
    )
    assert wasted == c.rooms.accounting.counters.dropped_tokens == 3 * 2 * GatedEngine().tokens
