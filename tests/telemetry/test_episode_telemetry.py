"""An episode in traces and metrics: an ``invoke_agent`` span under its group's generation span,
a ``text_completion`` per model turn and an ``execute_tool`` per step, all with the episode id as
``gen_ai.conversation.id``; turns, steps, failures and episodes counted; after a restore, reused
turns counted and traced as recovered, never as generated.

Episodes run on the synthetic engine with the domain tests' environment, through the real
controller (or the runner alone, for a restore from records), into in-memory exporters."""

from __future__ import annotations

import json
import re
import time
import urllib.request
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.trace import StatusCode

from rolloutd.domain.controller import Controller, ControllerConfig
from rolloutd.domain.engine import EngineCounters
from rolloutd.domain.episode import EpisodeLimits
from rolloutd.domain.episode_log import EpisodeLog, RecordKind
from rolloutd.domain.episode_runner import EpisodeRunner
from rolloutd.domain.group import Prompt
from rolloutd.domain.journal import NullJournal
from rolloutd.domain.observer import GenerationStarted
from rolloutd.domain.runner import SiblingJob
from rolloutd.domain.sampler import Sampler
from rolloutd.engines.synthetic import SyntheticEngine
from rolloutd.telemetry.episode_spans import (
    EXECUTE_TOOL,
    INVOKE_AGENT,
    TEXT_COMPLETION,
    TURN_REUSED_EVENT,
    AgentAttr,
    EpisodeAttr,
)
from rolloutd.telemetry.generation import GENERATE_SPAN, GenAIAttr
from rolloutd.telemetry.metrics import MetricsObserver
from rolloutd.telemetry.observer import TelemetryObserver
from rolloutd.telemetry.sources import CheckpointState, StatusSnapshot
from rolloutd.v1 import rollout_pb2 as pb
from rolloutd.v1 import rollout_pb2_grpc as pb_grpc
from tests.controllers import fetch
from tests.domain.test_episodes import FAST, Env, RecordingJournal, job
from tests.integration.proc import ServeProcess
from tests.telemetry.otlp_receiver import OtlpReceiver, attributes
from tests.telemetry.reports import scripted_run
from tests.telemetry.test_metrics import collect, points, value

pytestmark = pytest.mark.usefixtures("clean_env")

RESET = "rolloutd.episode.reset"


def observer_for(span_exporter, metric_reader) -> TelemetryObserver:  # type: ignore[no-untyped-def]
    observer = TelemetryObserver(span_exporter[0], metric_reader[0])
    observer.register_sources(
        EngineCounters, "synthetic", StatusSnapshot, CheckpointState, model="tiny"
    )
    return observer


async def run_group(observer: TelemetryObserver, env: Env, group_size: int = 2) -> None:
    c = Controller(
        ControllerConfig(group_size=group_size, max_in_flight=2, buffer_capacity=4),
        SyntheticEngine(FAST),
        Sampler([Prompt("p0", "what is 2+2?")], seed=0, epochs=1),
        runner=EpisodeRunner({}, env, EpisodeLimits(max_turns=5)),
        journal=NullJournal(),
        observer=observer,
    )
    c.start()
    try:
        assert await fetch(c, 1, 10_000, "t") is not None
    finally:
        await c.stop()


def children(spans: list[ReadableSpan], parent: ReadableSpan) -> list[ReadableSpan]:
    """``parent``'s children, in the order they started."""
    found = [
        s for s in spans if s.parent is not None and s.parent.span_id == parent.context.span_id
    ]
    return sorted(found, key=lambda s: s.start_time or 0)


def episodes(spans: list[ReadableSpan]) -> Iterator[tuple[ReadableSpan, list[ReadableSpan]]]:
    for span in spans:
        if span.name.startswith(INVOKE_AGENT):
            yield span, children(spans, span)


async def test_an_episode_is_an_agent_span_of_turns_and_tool_calls_under_its_group(
    span_exporter, metric_reader
):
    observer = observer_for(span_exporter, metric_reader)
    await run_group(observer, Env([]))
    spans = list(span_exporter[1].get_finished_spans())
    [generate] = [s for s in spans if s.name == GENERATE_SPAN]
    agents = list(episodes(spans))
    assert len(agents) == 2
    conversations = set()
    for agent, calls in agents:
        assert agent.name == "invoke_agent dataset"
        assert agent.parent is not None and agent.parent.span_id == generate.context.span_id
        attributes = dict(agent.attributes or {})
        conversation = attributes[AgentAttr.CONVERSATION_ID]
        conversations.add(conversation)
        assert attributes[GenAIAttr.OPERATION_NAME] == INVOKE_AGENT
        assert attributes[GenAIAttr.PROVIDER_NAME] == "synthetic"
        assert attributes[EpisodeAttr.END] == "done" and attributes[EpisodeAttr.TURNS] == 3
        assert attributes[EpisodeAttr.TURNS_REUSED] == 0
        assert agent.status.status_code is StatusCode.UNSET
        # reset, then each model turn followed by its step, in order, each inside the episode
        assert [s.name for s in calls] == [RESET] + [
            "text_completion tiny",
            "execute_tool tests:Env",
        ] * 3
        assert all(agent.start_time <= s.start_time <= s.end_time <= agent.end_time for s in calls)
        turns = [dict(s.attributes or {}) for s in calls[1::2]]
        steps = [dict(s.attributes or {}) for s in calls[2::2]]
        assert (
            [t[EpisodeAttr.TURN] for t in turns]
            == [s[EpisodeAttr.TURN] for s in steps]
            == [
                0,
                1,
                2,
            ]
        )
        for t in turns:
            assert t[GenAIAttr.OPERATION_NAME] == TEXT_COMPLETION
            assert t[AgentAttr.RESPONSE_FINISH_REASONS] in (("stop",), ("length",))
            assert t[GenAIAttr.USAGE_OUTPUT_TOKENS] > 0 and EpisodeAttr.RECOVERED not in t
        inputs = [t[GenAIAttr.USAGE_INPUT_TOKENS] for t in turns]
        assert inputs == sorted(inputs) and len(set(inputs)) == 3  # the context grows
        assert (
            sum(t[GenAIAttr.USAGE_OUTPUT_TOKENS] for t in turns)
            == attributes[GenAIAttr.USAGE_OUTPUT_TOKENS]
        )
        assert [s[EpisodeAttr.DONE] for s in steps] == [False, False, True]
        for s in steps:
            assert s[GenAIAttr.OPERATION_NAME] == EXECUTE_TOOL
            assert s[AgentAttr.TOOL_NAME] == "tests:Env" and s[EpisodeAttr.REPLAY] is False
            assert s[AgentAttr.TOOL_CALL_ID] == f"{conversation}-t{s[EpisodeAttr.TURN]}"
        assert {dict(s.attributes or {})[AgentAttr.CONVERSATION_ID] for s in calls} == {
            conversation
        }
    assert conversations == {f"g{generate.attributes['rolloutd.group.id']}-s{i}" for i in (0, 1)}

    m = collect(metric_reader[1])
    assert value(m["rolloutd.episode.turns"]) == 6
    assert value(m["rolloutd.episodes"], end="done") == 2
    assert value(m["rolloutd.episode.step.duration"]).count == 6
    assert value(m["rolloutd.episode.recovered.turns"], disposition="reused") == 0
    assert sum(p.value for p in points(m["rolloutd.episode.step.failures"]).values()) == 0


async def test_a_failed_step_is_an_error_span_and_counted_by_reason(span_exporter, metric_reader):
    observer = observer_for(span_exporter, metric_reader)
    await run_group(observer, Env([], fail_at=1))
    spans = list(span_exporter[1].get_finished_spans())
    for agent, calls in episodes(spans):
        assert agent.status.status_code is StatusCode.ERROR
        assert dict(agent.attributes or {})[AgentAttr.ERROR_TYPE] == "step_failed"
        assert dict(agent.attributes or {})[EpisodeAttr.END] == "step_failed"
        last = calls[-1]
        assert last.name == "execute_tool tests:Env"
        assert dict(last.attributes or {})[EpisodeAttr.TURN] == 1
        assert last.status.status_code is StatusCode.ERROR
        assert last.status.description == "boom"
        assert dict(last.attributes or {})[AgentAttr.ERROR_TYPE] == "step_failed"
        assert all(c.status.status_code is StatusCode.UNSET for c in calls[:-1])
    m = collect(metric_reader[1])
    assert value(m["rolloutd.episode.step.failures"], reason="step_failed") == 2
    assert value(m["rolloutd.episode.step.failures"], reason="step_timeout") == 0
    assert value(m["rolloutd.episodes"], end="step_failed") == 2
    assert value(m["rolloutd.episode.turns"]) == 4
    assert value(m["rolloutd.episode.step.duration"]).count == 4  # the failed step too


async def test_after_a_restore_reused_turns_are_recovered_not_generated(
    span_exporter, metric_reader
):
    engine = SyntheticEngine(FAST)
    whole = RecordingJournal([])
    await EpisodeRunner({}, Env([]), EpisodeLimits(max_turns=5)).run(
        job(engine, EpisodeLog(1, 0, whole))
    )
    # a crash after turn 1 was durable, its step running: reset, turn 0, step 0, turn 1
    kept = [r for _, _, r in whole.records][:4]
    assert [r.kind for r in kept][-1] is RecordKind.TURN

    observer = observer_for(span_exporter, metric_reader)
    observer.generation_started(GenerationStarted(1, "p", 1, 0.0, 16, 1.0, 1.0))
    restored = job(engine, EpisodeLog(1, 0, RecordingJournal([]), list(kept)))
    sample = await EpisodeRunner({}, Env([]), EpisodeLimits(max_turns=5)).run(
        SiblingJob(
            restored.engine,
            restored.request,
            None,
            restored.source,
            restored.episode,
            observer,
        )
    )
    assert sample.finish_reason == "episode:done"

    m = collect(metric_reader[1])
    assert value(m["rolloutd.episode.recovered.turns"], disposition="reused") == 2
    assert value(m["rolloutd.episode.recovered.turns"], disposition="rerun") == 1
    assert value(m["rolloutd.episode.turns"]) == 1  # turn 2 only: 0 and 1 were not generated
    assert value(m["rolloutd.episode.step.duration"]).count == 2  # step 0 was only replayed
    assert value(m["rolloutd.episode.replay.mismatches"]) == 0

    spans = list(span_exporter[1].get_finished_spans())
    [(agent, calls)] = episodes(spans)
    attributes = dict(agent.attributes or {})
    assert attributes[EpisodeAttr.RESTORED] is True
    assert (attributes[EpisodeAttr.TURNS], attributes[EpisodeAttr.TURNS_REUSED]) == (3, 2)
    reused = [e for e in agent.events if e.name == TURN_REUSED_EVENT]
    assert [dict(e.attributes or {})[EpisodeAttr.TURN] for e in reused] == [0, 1]
    named = [(s.name, dict(s.attributes or {})) for s in calls]
    assert [(n, a.get(EpisodeAttr.TURN), a.get(EpisodeAttr.REPLAY)) for n, a in named] == [
        (RESET, None, True),
        ("execute_tool tests:Env", 0, True),  # replayed: its result was durable
        ("execute_tool tests:Env", 1, False),  # called again: it was running at the crash
        ("text_completion tiny", 2, None),  # turns 0 and 1 were reused: no spans
        ("execute_tool tests:Env", 2, False),
    ]
    turn = named[3][1]
    assert turn[EpisodeAttr.RECOVERED] == "rerun" and turn[EpisodeAttr.RESUMED_TOKENS] == 0


def test_a_scripted_run_counts_episodes(metric_reader):
    provider, reader = metric_reader
    observer = MetricsObserver(provider)
    scripted_run(observer)
    m = collect(reader)
    assert value(m["rolloutd.episode.recovered.turns"], disposition="reused") == 2
    assert value(m["rolloutd.episode.recovered.turns"], disposition="rerun") == 1
    assert value(m["rolloutd.episode.turns"]) == 2
    assert value(m["rolloutd.episodes"], end="done") == 1
    assert value(m["rolloutd.episodes"], end="step_timeout") == 1
    assert value(m["rolloutd.episodes"], end="max_turns") == 0
    duration = value(m["rolloutd.episode.step.duration"])  # live steps: replays left out
    assert (duration.count, duration.sum) == (2, pytest.approx(0.7))
    assert value(m["rolloutd.episode.step.failures"], reason="step_timeout") == 1
    assert value(m["rolloutd.episode.replay.mismatches"]) == 1


# --- the real CLI: SIGKILLed mid-episode, restored, over OTLP and /metrics -----------------------

ROOT = Path(__file__).resolve().parents[2]
PROMPTS, GROUP_SIZE, TURNS = 6, 2, 4
"""About half a second a turn: episodes are under way at the first snapshots."""
REUSED = re.compile(
    r'^rolloutd_episode_recovered_turns_total\{[^}]*disposition="reused"[^}]*\} (\S+)$', re.M
)


def _episode_service(tmp: Path, receiver: OtlpReceiver, life: int, *args: str) -> ServeProcess:
    calls = tmp / "calls.jsonl"
    data = tmp / "tools.jsonl"
    data.write_text(
        "".join(json.dumps({"id": f"q{i}", "prompt": f"q{i}"}) + "\n" for i in range(PROMPTS))
    )
    config = tmp / "config.json"
    config.write_text(
        json.dumps(
            {
                "dataset": {
                    "sources": [
                        {
                            "name": "tools",
                            "path": str(data),
                            "environment": "tests.integration.episode_envs:ReplayedEnv",
                            "environment_config": {"log": str(calls), "turns": TURNS},
                        }
                    ],
                    "epochs": 1,
                },
                "group_size": GROUP_SIZE,
                "engine": {
                    "kind": "synthetic",
                    "max_tokens": 16,
                    "synthetic": {"tokens_per_s": 20},
                },
                "limits": {"max_in_flight": PROMPTS},
                "episodes": {"max_turns": TURNS + 1},
            }
        )
    )
    p = ServeProcess(
        [
            "--config", str(config), "--grpc-port", "0", "--http-port", "0",
            "--checkpoint-dir", str(tmp / "ckpt"), "--checkpoint-interval", "0.5", *args,
        ],
        env={
            "PYTHONPATH": f"{ROOT / 'service'}:{ROOT}",
            "OTEL_SDK_DISABLED": "false",
            "OTEL_SERVICE_NAME": f"rolloutd-episodes-{life}",
            "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint("grpc"),
            "OTEL_BSP_SCHEDULE_DELAY": "100",
        },
        cwd=tmp,
        log_path=tmp / f"serve-{life}.log",
    )  # fmt: skip
    p.wait_listening()
    return p


def _steps(calls: Path) -> list[tuple[str, int]]:
    """The live steps called, in order: (episode, turn) each."""
    lines = calls.read_text().splitlines() if calls.exists() else []
    found = [json.loads(line) for line in lines if line.strip()]
    return [(c["episode"], c["turn"]) for c in found if c["call"] == "step" and not c["replay"]]


def _live_steps(calls: Path) -> set[tuple[str, int]]:
    return set(_steps(calls))


@pytest.mark.process
def test_a_restored_service_reports_reused_turns_in_metrics_and_traces(tmp_path):
    receiver = OtlpReceiver().start()
    first = _episode_service(tmp_path, receiver, 1)
    calls = tmp_path / "calls.jsonl"
    try:
        assert first.http is not None

        def snapshots() -> int:
            url = f"http://{first.http}/v1/checkpoints"
            with urllib.request.urlopen(url, timeout=10) as response:
                return len(json.load(response))

        deadline = time.monotonic() + 120
        while not snapshots():  # a restore needs one; the journal holds the turns after it
            assert time.monotonic() < deadline, "no snapshot"
            time.sleep(0.05)
        after = len(_live_steps(calls)) + 2
        while len(_live_steps(calls)) < after:
            assert time.monotonic() < deadline, "no live steps"
            time.sleep(0.02)
    finally:
        first.kill()
    stepped = _steps(calls)
    durable = set(stepped)  # a step is called once its turn is durable

    second = _episode_service(tmp_path, receiver, 2, "--restore", "latest")
    try:
        assert second.grpc is not None and second.http is not None
        delivered: set[str] = set()
        with grpc.insecure_channel(second.grpc) as channel:
            stub = pb_grpc.RolloutServiceStub(channel)
            while len(delivered) < PROMPTS:
                r = stub.FetchGroups(
                    pb.FetchGroupsRequest(max_groups=8, wait_ms=30_000), timeout=60
                )
                delivered |= {g.prompt_id for g in r.groups}
                if r.groups:
                    stub.AckGroups(pb.AckGroupsRequest(lease_id=r.lease_id, trainer_step=1))
        with urllib.request.urlopen(f"http://{second.http}/metrics", timeout=30) as response:
            exposition = response.read().decode()
        assert second.terminate() == 0, second.output
    finally:
        if second.proc.poll() is None:
            second.kill()
        receiver.stop()

    [reused_total] = [float(v) for v in REUSED.findall(exposition)]
    spans = receiver.spans("rolloutd-episodes-2")
    agents = [s for s in spans if s.name == "invoke_agent tools"]
    reused = {
        (
            attributes(s.attributes)[AgentAttr.CONVERSATION_ID],
            attributes(e.attributes)[EpisodeAttr.TURN],
        )
        for s in agents
        for e in s.events
        if e.name == TURN_REUSED_EVENT
    }
    assert reused_total == len(reused) >= 1
    assert sum(attributes(s.attributes)[EpisodeAttr.TURNS_REUSED] for s in agents) == len(reused)
    # only turns durable at the kill are reused: those whose step was called, and those the
    # kill caught between the turn's record and its step, whose step the second life calls
    # live, once
    stepped_again = Counter(_steps(calls)[len(stepped) :])
    caught = reused - durable
    assert all(stepped_again[turn] == 1 for turn in caught), (caught, stepped_again)
    turns = [s for s in spans if s.name.startswith(TEXT_COMPLETION)]
    generated = Counter(
        (a[AgentAttr.CONVERSATION_ID], a[EpisodeAttr.TURN])
        for a in (attributes(s.attributes) for s in turns)
    )
    assert not reused & set(generated), "a reused turn was traced as generated"
    assert set(generated.values()) == {1}
    by_id = {s.span_id: s for s in agents}
    tools = [s for s in spans if s.name.startswith(EXECUTE_TOOL)]
    assert turns and tools
    assert all(s.parent_span_id in by_id for s in [*turns, *tools])
