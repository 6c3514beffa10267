"""Episodes on the synthetic engine: exact tokens and loss mask, durable turns in order, restore
from the records, failures that end an episode while the service goes on."""

from __future__ import annotations

import asyncio
from array import array

import pyarrow as pa

from rolloutd.domain.controller import Controller, ControllerConfig
from rolloutd.domain.engine import GenerationRequest, SamplingParams
from rolloutd.domain.episode import (
    EnvironmentFailure,
    EpisodeEnd,
    EpisodeLimits,
    EpisodeStart,
    StepResult,
)
from rolloutd.domain.episode_log import EnvironmentReply, EpisodeLog, ModelTurn, RecordKind
from rolloutd.domain.episode_runner import EpisodeRunner
from rolloutd.domain.group import Prompt, Sample, TurnKind
from rolloutd.domain.journal import NullJournal
from rolloutd.domain.runner import SiblingJob
from rolloutd.domain.sampler import Sampler
from rolloutd.engines.synthetic import SyntheticConfig, SyntheticEngine
from tests.controllers import fetch
from tests.fakes import settle

FAST = SyntheticConfig(tokens_per_s=0, min_tokens=4)


class Env:
    """Answers each turn with the completion's length; done after ``turns`` steps. Records
    every call (and, through ``events``, its order with the journal's writes)."""

    name = "tests:Env"
    has_state = False

    def __init__(
        self,
        events: list[tuple[str, int]],
        turns: int = 3,
        fail_at: int | None = None,
        hang_at: int | None = None,
        bad_at: int | None = None,
    ) -> None:
        self.events, self.turns = events, turns
        self.fail_at, self.hang_at, self.bad_at = fail_at, hang_at, bad_at
        self.calls: list[tuple[str, int, str, bool]] = []

    async def reset(self, start: EpisodeStart):  # type: ignore[no-untyped-def]
        self.events.append(("reset", -1))
        return ({"role": "system", "content": f"episode {start.episode_id}"},)

    async def step(self, episode_id: str, turn: int, completion: str, *, replay: bool = False):  # type: ignore[no-untyped-def]
        self.calls.append((episode_id, turn, completion, replay))
        self.events.append(("step", turn))
        if turn == self.fail_at:
            raise EnvironmentFailure(EpisodeEnd.STEP_FAILED, "boom")
        if turn == self.hang_at:
            raise EnvironmentFailure(EpisodeEnd.STEP_TIMEOUT, "ran past 0.1 s")
        if turn == self.bad_at:
            raise EnvironmentFailure(EpisodeEnd.MALFORMED, "messages must be a list")
        done = turn + 1 >= self.turns
        return StepResult(
            ({"role": "tool", "content": f"len {len(completion)}"},),
            done,
            float(turn) if done else None,
        )

    async def state(self, episode_id: str) -> bytes:
        raise AssertionError("no state")

    async def restore(self, start: EpisodeStart, state: bytes) -> None:
        raise AssertionError("no state")

    async def close(self) -> None:
        return None


class RecordingJournal:
    """Journals episode records (durable once the returned future resolves), noting when."""

    def __init__(self, events: list[tuple[str, int]]) -> None:
        self.events = events
        self.records: list[tuple[int, int, object]] = []

    fail: RecordKind | None = None
    """Records of this kind fail to be written (the disk's error, delivered to the writer)."""

    def episode(self, group_id: int, index: int, record):  # type: ignore[no-untyped-def]
        fut = asyncio.get_running_loop().create_future()
        self.events.append((f"queued-{record.kind.value}", record.turn))

        def durable() -> None:
            if record.kind is self.fail:
                fut.set_exception(OSError(28, "No space left on device"))
                return
            self.records.append((group_id, index, record))
            self.events.append((f"durable-{record.kind.value}", record.turn))
            fut.set_result(len(self.records))

        asyncio.get_running_loop().call_later(0.001, durable)
        return fut


class Generating:
    """An engine that notes when each model turn begins to generate."""

    def __init__(self, engine: SyntheticEngine, events: list[tuple[str, int]]) -> None:
        self.engine, self.events, self.turns = engine, events, 0

    def __getattr__(self, name: str):  # type: ignore[no-untyped-def]
        return getattr(self.engine, name)

    async def generate(self, request, on_delta):  # type: ignore[no-untyped-def]
        self.events.append(("generate", self.turns))
        self.turns += 1
        return await self.engine.generate(request, on_delta)


def job(engine, log, max_tokens=16):  # type: ignore[no-untyped-def]
    request = GenerationRequest(
        "g1-s0", 1, 0, Prompt("p", "what is 2+2?"), 7, SamplingParams(max_tokens=max_tokens)
    )
    return SiblingJob(engine, request, None, "dataset", log)


async def test_an_episode_interleaves_model_and_environment_tokens_with_an_exact_mask():
    events: list[tuple[str, int]] = []
    env, journal = Env(events), RecordingJournal(events)
    runner = EpisodeRunner({}, env, EpisodeLimits(max_turns=5))
    engine = Generating(SyntheticEngine(FAST), events)
    sample = await runner.run(job(engine, EpisodeLog(1, 0, journal)))
    assert sample.finish_reason == "episode:done" and sample.episode_reward == 2.0
    assert [t.kind for t in sample.turns] == [TurnKind.MODEL, TurnKind.ENVIRONMENT] * 3
    mask = sample.loss_mask()
    assert len(mask) == len(sample.token_ids) == len(sample.logprobs)
    turns = [r for _, _, r in journal.records if isinstance(r, ModelTurn)]
    model = array("i")
    for t in turns:
        model.extend(t.token_ids)
    assert array("i", [x for x, m in zip(sample.token_ids, mask, strict=True) if m]) == model
    assert all(lp == 0.0 for lp, m in zip(sample.logprobs, mask, strict=True) if not m)
    assert sample.retokenization_mismatches == 0
    # every environment span is the template's rendering after the conversation so far
    text = "".join(map(chr, sample.prompt_token_ids))
    assert text.startswith("<|bos|><|user|>\nwhat is 2+2?<|end|>\n<|system|>\nepisode g1-s0")
    assert text.endswith("<|assistant|>\n")
    # durability order: each turn durable before its step; a step's result (and reset's) is
    # written while the next turn generates, and durable before that turn's record is queued;
    # the last one before the sample ends
    assert events == [
        ("reset", -1),
        ("queued-reset", -1),
        ("generate", 0),
        ("durable-reset", -1),
        ("queued-turn", 0),
        ("durable-turn", 0),
        ("step", 0),
        ("queued-step", 0),
        ("generate", 1),
        ("durable-step", 0),
        ("queued-turn", 1),
        ("durable-turn", 1),
        ("step", 1),
        ("queued-step", 1),
        ("generate", 2),
        ("durable-step", 1),
        ("queued-turn", 2),
        ("durable-turn", 2),
        ("step", 2),
        ("queued-step", 2),
        ("durable-step", 2),
    ]


async def test_a_failed_write_of_a_step_fails_the_episode_and_nothing_after_it_is_queued():
    events: list[tuple[str, int]] = []
    env, journal = Env(events), RecordingJournal(events)
    journal.fail = RecordKind.STEP
    runner = EpisodeRunner({}, env, EpisodeLimits(max_turns=5))
    try:
        await runner.run(job(SyntheticEngine(FAST), EpisodeLog(1, 0, journal)))
    except OSError as exc:
        assert exc.errno == 28
    else:
        raise AssertionError("the episode went on past a step it could not make durable")
    # turn 1 was generated beside the failing write, but never queued: the journal holds no
    # record without those before it
    queued = [e for e in events if e[0].startswith("queued-")]
    assert queued == [("queued-reset", -1), ("queued-turn", 0), ("queued-step", 0)]
    assert [r.kind for _, _, r in journal.records] == [RecordKind.RESET, RecordKind.TURN]


async def test_a_restored_episode_reuses_durable_turns_and_steps_and_replays_the_rest():
    events: list[tuple[str, int]] = []
    env, journal = Env(events), RecordingJournal(events)
    runner = EpisodeRunner({}, env, EpisodeLimits(max_turns=5))
    engine = SyntheticEngine(FAST)
    whole = await runner.run(job(engine, EpisodeLog(1, 0, journal)))
    records = [r for _, _, r in journal.records]
    # a crash after turn 1 was durable, its step running: reset, turn 0, step 0, turn 1
    kept = records[:4]
    assert [r.kind for r in kept] == [
        RecordKind.RESET,
        RecordKind.TURN,
        RecordKind.STEP,
        RecordKind.TURN,
    ]
    env2 = Env([])
    again = await EpisodeRunner({}, env2, EpisodeLimits(max_turns=5)).run(
        job(engine, EpisodeLog(1, 0, RecordingJournal([]), list(kept)))
    )
    assert again.token_ids == whole.token_ids and again.loss_mask() == whole.loss_mask()
    turn1 = kept[3]
    assert isinstance(turn1, ModelTurn)
    # step 0 durable: replayed only; step 1 not durable: called again with the same completion
    assert [(t, replay) for _, t, _, replay in env2.calls] == [(0, True), (1, False), (2, False)]
    assert env2.calls[1][2] == turn1.text == env.calls[1][2]


async def test_limits_end_an_episode_with_their_reason():
    engine = SyntheticEngine(FAST)
    turns = await EpisodeRunner({}, Env([], turns=10), EpisodeLimits(max_turns=2)).run(
        job(engine, EpisodeLog(1, 0, None))
    )
    assert turns.finish_reason == "episode:max_turns"
    assert sum(1 for t in turns.turns if t.kind is TurnKind.MODEL) == 2
    tokens = await EpisodeRunner({}, Env([], turns=10), EpisodeLimits(max_total_tokens=80)).run(
        job(engine, EpisodeLog(1, 0, None))
    )
    assert tokens.finish_reason == "episode:max_total_tokens"


async def test_failing_steps_end_the_episode_and_the_service_goes_on():
    for kw, end in (
        ({"fail_at": 1}, "step_failed"),
        ({"hang_at": 0}, "step_timeout"),
        ({"bad_at": 1}, "malformed"),
    ):
        env = Env([], **kw)
        cfg = ControllerConfig(group_size=2, max_in_flight=4, buffer_capacity=8)
        c = Controller(
            cfg,
            SyntheticEngine(FAST),
            Sampler([Prompt("p0", "q")], seed=0, epochs=1),
            runner=EpisodeRunner({}, env, EpisodeLimits()),
            journal=NullJournal(),
        )
        c.start()
        try:
            got = await fetch(c, 1, 10_000, "t")
            assert got is not None
            [group] = got[1]
            assert {s.finish_reason for s in group.ordered_samples()} == {f"episode:{end}"}
            assert c.rooms.liveness.fatal is None
            c.rooms.liveness.check_serving()
        finally:
            await c.stop()


async def test_the_tokens_of_failed_episodes_are_counted_failed():
    """Where generation goes (domain/fate.py): an episode's sample, environment tokens and all,
    counts when it is staged; a group whose episodes failed is dropped by the scoring stage, its
    tokens counted as failed, and the fates still add up."""
    from rolloutd.domain.fate import TokenFate
    from rolloutd.scoring.stage import OnFailure, ScoringStage

    c = Controller(
        ControllerConfig(group_size=2, max_in_flight=4, buffer_capacity=8),
        SyntheticEngine(FAST),
        Sampler([Prompt("p0", "q"), Prompt("p1", "r")], seed=0, epochs=1),
        runner=EpisodeRunner({}, Env([], fail_at=1), EpisodeLimits()),
        journal=NullJournal(),
        stage=ScoringStage(None, on_failure=OnFailure.DROP),
    )
    c.start()
    try:
        await settle(lambda: c.rooms.accounting.counters.dropped_groups == 2)
    finally:
        await c.stop()
    account = c.token_account()
    assert (
        account.fates[TokenFate.FAILED]
        == account.generated
        == c.rooms.accounting.counters.dropped_tokens
        > 0
    )
    assert sum(account.fates.values()) == account.generated


async def test_episode_rewards_are_scores_and_a_failed_episode_is_handled_as_on_failure_says():
    from rolloutd.domain.finishing import FinishingGroup
    from rolloutd.scoring.stage import OnFailure, ScoringStage

    def sample(i, reason, reward):  # type: ignore[no-untyped-def]
        end = EpisodeEnd.of_finish_reason(reason)
        return Sample(
            i,
            array("i"),
            array("f"),
            "",
            reason,
            0,
            array("i"),
            0,
            0.0,
            0.0,
            episode_reward=reward,
            episode_end=end,
        )

    ok = [sample(0, "episode:done", 1.0), sample(1, "episode:done", 0.0)]
    failed = [sample(0, "episode:done", 1.0), sample(1, "episode:step_timeout", None)]
    prompt = Prompt("p", "q")
    stage = ScoringStage(None, on_failure=OnFailure.DROP)
    verdict = await stage.finish(FinishingGroup(1, prompt, None, 0, ok, "dataset"))
    assert verdict.drop_reason is None and verdict.scores is not None
    assert [s.reward for s in verdict.scores.samples] == [1.0, 0.0] and verdict.scores.std == 0.5
    dropped = await stage.finish(FinishingGroup(2, prompt, None, 0, failed, "dataset"))
    assert dropped.drop_reason == "scoring_failed"
    kept = await ScoringStage(None, on_failure=OnFailure.DELIVER).finish(
        FinishingGroup(3, prompt, None, 0, failed, "dataset")
    )
    assert kept.drop_reason is None and kept.scores is not None
    assert kept.scores.samples[1].info == "episode ended: step_timeout"


def test_episode_records_round_trip_through_the_journal_and_the_partials_file():
    from rolloutd.checkpoint import journal_records, partials
    from rolloutd.domain.group import SamplePart
    from rolloutd.domain.journal import JournaledEpisode
    from rolloutd.domain.partial import PartialSibling, TokenDelta

    turn = ModelTurn(
        0, array("i", [5, 6]), array("f", [-0.5, -1.0]), (SamplePart(0, 3),), "stop", "ab"
    )
    step = EnvironmentReply(
        0, ({"role": "tool", "content": "x"},), array("i", [9]), True, 1.5, b"\x00s"
    )
    for record in (turn, step):
        event = journal_records.decode(journal_records.episode(4, 1, record))
        assert event == JournaledEpisode(4, 1, record)
    delta = TokenDelta(array("i", [7]), array("f", [-0.1]), 3)
    partial = PartialSibling(4, 1, [delta], 1, turn=1, episode=[turn, step], episode_count=2)
    [back], _ = partials.from_table(pa.Table.from_batches([partials.to_batch([partial], {})]))
    assert (back.turn, list(back.episode_records)) == (1, [turn, step])
    assert back.token_ids() == array("i", [7])
