"""The episode runner: a :class:`SiblingRunner` that produces a sibling as an episode of model
turns and environment steps (docs/design.md, "Episodes").

One episode: ``reset`` -> [model turn -> turn durable -> ``step`` -> step durable]* until the
environment says done, ``episodes.max_turns`` model turns ran, or the conversation reached
``episodes.max_total_tokens``. A failing environment (it raises, times out, answers something
malformed) ends the episode with that reason; its group is then handled as ``scoring.on_failure``
says.

After a restart the sibling's :class:`EpisodeLog` holds the records that were durable: a durable
model turn is reused, never generated again; a durable step is not called live again (the
environment's state comes back through ``restore(start, state)`` when it has one, else by
replaying the durable steps with ``replay=True``, whose messages are checked against the
recorded ones); a step without a durable result is called again with the same completion; a
model turn caught mid-generation continues token by token from the snapshot's partial tokens.

What an episode did is reported to ``job.observer`` as it happens (:class:`EpisodeStarted`, a
:class:`EpisodeTurn` per model turn, an :class:`EnvironmentCalled` per call, one
:class:`EpisodeEnded`): telemetry turns them into spans and counters. A turn a restore found
durable is reported as recovered (``REUSED``), never as generated.
"""

from __future__ import annotations

import logging
import time
from array import array
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, replace

from rolloutd.domain.conversation import Conversation
from rolloutd.domain.engine import ChatRenderer
from rolloutd.domain.episode import (
    EnvironmentFailure,
    EnvironmentPort,
    EpisodeEnd,
    EpisodeLimits,
    EpisodeStart,
)
from rolloutd.domain.episode_log import EnvironmentReply, EpisodeLog, ModelTurn, RecordKind
from rolloutd.domain.group import Sample, SamplePart, TurnKind, TurnSpan
from rolloutd.domain.observer import (
    EnvironmentCall,
    EnvironmentCalled,
    EpisodeEnded,
    EpisodeStarted,
    EpisodeTurn,
)
from rolloutd.domain.partial import PartialSibling, join_parts
from rolloutd.domain.report import Disposition
from rolloutd.domain.runner import EngineRunner, SiblingJob

log = logging.getLogger(__name__)


@dataclass
class _Call:
    """What a call to the environment answered, as far as its report needs."""

    done: bool = False
    mismatch: bool = False


class EpisodeRunner:
    """Runs an episode for each sibling whose source has an environment; any other sibling is
    one engine request (:class:`EngineRunner`)."""

    def __init__(
        self,
        environments: Mapping[str, EnvironmentPort],
        default: EnvironmentPort | None,
        limits: EpisodeLimits,
    ) -> None:
        self.environments = dict(environments)
        self.default = default
        self.limits = limits
        self._plain = EngineRunner()

    def environment_of(self, source: str) -> EnvironmentPort | None:
        return self.environments.get(source, self.default)

    async def run(self, job: SiblingJob) -> Sample:
        env = self.environment_of(job.source)
        if env is None or job.episode is None:
            return await self._plain.run(job)
        if not isinstance(job.engine, ChatRenderer):
            raise TypeError(f"engine {job.engine.name} cannot render chats: no episodes on it")
        return await _Episode(self, job, env, job.engine, job.episode).run()


class _Episode:
    """One episode's run (see the module docstring)."""

    def __init__(
        self,
        runner: EpisodeRunner,
        job: SiblingJob,
        env: EnvironmentPort,
        renderer: ChatRenderer,
        episode: EpisodeLog,
    ) -> None:
        r = job.request
        prompt = r.prompt
        messages = prompt.messages or ({"role": "user", "content": prompt.text},)
        self.runner, self.job, self.env, self.renderer, self.log = (
            runner,
            job,
            env,
            renderer,
            episode,
        )
        self.limits = runner.limits
        self.observer = job.observer
        self.start = EpisodeStart(
            episode_id=r.request_id,
            group_id=r.group_id,
            sibling=r.index,
            prompt_id=prompt.prompt_id,
            messages=tuple(messages),
            metadata=prompt.metadata,
            tools=tuple(prompt.tools),
        )
        self.conversation = Conversation(renderer, messages, prompt.tools)
        recovered = episode.records[: episode.restored]
        episode.restored = 0  # a retry of this sibling recovers nothing more
        self.recovered_turns = {r.turn for r in recovered if r.kind is RecordKind.TURN}
        """Turns a restore found durable: reported as reused."""
        self.restored = bool(recovered)
        """The next turn generated is the first after a restore (reported as rerun)."""
        self.turns = 0
        self.model_tokens = 0
        self.tokens = array("i")
        self.logprobs = array("f")
        self.spans: list[TurnSpan] = []
        self.parts: list[SamplePart] = []
        self.ended_by: list[int | None] = []
        self.prompt_ids = array("i")
        self.reward: float | None = None
        self.final = False

    async def run(self) -> Sample:
        started = time.time()
        self.observer.episode_started(
            EpisodeStarted(
                self.start.group_id,
                self.start.sibling,
                self.start.episode_id,
                self.job.source,
                self.env.name,
                time.time_ns(),
                self.restored,
            )
        )
        try:
            end = await self._episode()
            await self.log.settle()  # the last step's result is durable before the sample ends
            mismatches = await self.conversation.mismatches(self.ended_by, self.final)
        except BaseException as exc:  # reported, then raised as it was
            self.log.abandon()
            self._ended(None, 0, f"{type(exc).__name__}: {exc}")
            raise
        self._ended(end, mismatches)
        version = self.parts[0].policy_version if self.parts else self.job.engine.policy_version
        return Sample(
            index=self.job.request.index,
            token_ids=self.tokens,
            logprobs=self.logprobs,
            text=self.renderer.decode(self.tokens),
            finish_reason=end.finish_reason,
            policy_version=min((p.policy_version for p in self.parts), default=version),
            prompt_token_ids=self.prompt_ids,
            seed=self.job.request.seed,
            started_at=started,
            finished_at=time.time(),
            parts=tuple(self.parts),
            turns=tuple(self.spans),
            episode_reward=self.reward,
            retokenization_mismatches=mismatches,
            episode_end=end,
        )

    def _ended(self, end: EpisodeEnd | None, mismatches: int, error: str = "") -> None:
        model = self.model_tokens
        self.observer.episode_ended(
            EpisodeEnded(
                self.start.episode_id,
                time.time_ns(),
                end,
                self.turns,
                len(self.prompt_ids),
                model,
                len(self.tokens) - model,
                self.reward,
                mismatches,
                error,
            )
        )

    @contextmanager
    def _calling(
        self, call: EnvironmentCall, turn: int = -1, *, replay: bool = False
    ) -> Iterator[_Call]:
        """Times a call to the environment (the body) and reports it, failed or not."""
        began = time.time_ns()
        answer = _Call()
        try:
            yield answer
        except EnvironmentFailure as exc:
            self.observer.environment_called(
                EnvironmentCalled(
                    self.start.episode_id,
                    call,
                    turn,
                    began,
                    time.time_ns(),
                    replay,
                    failure=exc.end,
                    detail=exc.detail,
                )
            )
            raise
        self.observer.environment_called(
            EnvironmentCalled(
                self.start.episode_id,
                call,
                turn,
                began,
                time.time_ns(),
                replay,
                answer.mismatch,
                answer.done,
            )
        )

    async def _episode(self) -> EpisodeEnd:
        try:
            await self._reset()
        except EnvironmentFailure as exc:
            return self._failed(exc, "reset")
        for turn in range(self.limits.max_turns):
            if len(self.prompt_ids) + len(self.tokens) >= self.limits.max_total_tokens:
                return EpisodeEnd.MAX_TOTAL_TOKENS
            model = await self._model_turn(turn)
            try:
                reply = await self._step(turn, model)
            except EnvironmentFailure as exc:
                return self._failed(exc, f"step {turn}")
            if reply.done:
                self.reward = reply.reward
                return EpisodeEnd.DONE
        return EpisodeEnd.MAX_TURNS

    def _failed(self, exc: EnvironmentFailure, what: str) -> EpisodeEnd:
        log.warning(
            "episode %s: %s failed (%s): %s", self.start.episode_id, what, exc.end.value, exc
        )
        return exc.end

    async def _reset(self) -> None:
        found = self.log.find(RecordKind.RESET, -1)
        if found is None:
            with self._calling(EnvironmentCall.RESET):
                messages = await self.env.reset(self.start)
                state = await self.env.state(self.start.episode_id) if self.env.has_state else None
            ids = await self.conversation.add_environment(messages)
            await self.log.append(
                EnvironmentReply(-1, tuple(messages), ids, state=state), wait=False
            )
        else:
            assert isinstance(found, EnvironmentReply)
            await self._bring_back_environment(found)
            self.conversation.messages.extend(found.messages)
            self.conversation.segments.append(found.token_ids)
            ids = found.token_ids
        self.prompt_ids = ids

    async def _bring_back_environment(self, reset: EnvironmentReply) -> None:
        """The environment as it was after the last durable record: restored from the last
        state saved, or reset and replayed through the durable steps."""
        steps = [r for r in self.log.records if r.kind is RecordKind.STEP]
        if self.env.has_state:
            last = steps[-1] if steps else reset
            assert isinstance(last, EnvironmentReply)
            if last.state is not None:
                with self._calling(EnvironmentCall.RESTORE):
                    await self.env.restore(self.start, last.state)
                return
        with self._calling(EnvironmentCall.RESET, replay=True) as answer:
            messages = await self.env.reset(self.start)
            answer.mismatch = tuple(messages) != reset.messages
        for step in steps:
            assert isinstance(step, EnvironmentReply)
            turn = self.log.find(RecordKind.TURN, step.turn)
            assert isinstance(turn, ModelTurn)
            with self._calling(EnvironmentCall.STEP, step.turn, replay=True) as answer:
                again = await self.env.step(
                    self.start.episode_id, step.turn, turn.text, replay=True
                )
                answer.done = again.done
                answer.mismatch = tuple(again.messages) != step.messages
            if answer.mismatch:
                log.warning(
                    "episode %s: replayed step %d answered other messages than recorded; the "
                    "recorded ones are kept",
                    self.start.episode_id,
                    step.turn,
                )

    async def _model_turn(self, turn: int) -> ModelTurn:
        found = self.log.find(RecordKind.TURN, turn)
        context = len(self.prompt_ids) + len(self.tokens)
        if found is not None:
            assert isinstance(found, ModelTurn)
            model = found
            if turn in self.recovered_turns:
                now = time.time_ns()
                self._turn_durable(model, now, now, context, Disposition.REUSED)
        else:
            recovered = Disposition.RERUN if self.restored else None
            self.restored = False  # only the first turn generated after a restore is recovered
            request = self.job.request
            prefix = (
                request.prefix
                if request.prefix is not None and request.prefix.turn == turn
                else None
            )
            began = time.time_ns()
            model = await self._generate(turn, prefix)
            generated = time.time_ns()
            await self.log.append(model)
            resumed = len(prefix) if prefix is not None else 0
            self._turn_durable(model, began, generated, context, recovered, resumed)
        self.turns += 1
        self.model_tokens += len(model.token_ids)
        offset = len(self.tokens)
        self.spans.append(TurnSpan(offset, TurnKind.MODEL))
        for p in model.parts:
            if not self.parts or self.parts[-1].policy_version != p.policy_version:
                self.parts.append(SamplePart(offset + p.start, p.policy_version))
        self.tokens.extend(model.token_ids)
        self.logprobs.extend(model.logprobs)
        self.conversation.add_model()
        return model

    def _turn_durable(
        self,
        model: ModelTurn,
        began: int,
        ended: int,
        context: int,
        recovered: Disposition | None,
        resumed: int = 0,
    ) -> None:
        self.observer.episode_turn(
            EpisodeTurn(
                self.start.episode_id,
                model.turn,
                began,
                ended,
                context,
                len(model.token_ids),
                model.finish_reason,
                recovered,
                resumed,
            )
        )

    async def _generate(self, turn: int, prefix: PartialSibling | None) -> ModelTurn:
        request = self.job.request
        used = len(self.prompt_ids) + len(self.tokens)
        max_tokens = min(request.params.max_tokens, self.limits.max_total_tokens - used)
        self.log.begin_turn(turn, prefix.deltas if prefix is not None else ())
        context = self.prompt_ids + self.tokens
        sample = await self.job.engine.generate(
            replace(
                request,
                params=replace(request.params, max_tokens=max(max_tokens, 1)),
                seed=(request.seed + turn * 7_919) % (2**31 - 1),
                context=context,
                prefix=prefix,
            ),
            self.log.on_delta,
        )
        parts = sample.parts or join_parts((), 0, sample.policy_version, len(sample.token_ids))
        return ModelTurn(
            turn,
            sample.token_ids,
            sample.logprobs,
            parts,
            sample.finish_reason,
            sample.text,
        )

    async def _step(self, turn: int, model: ModelTurn) -> EnvironmentReply:
        found = self.log.find(RecordKind.STEP, turn)
        if found is None:
            with self._calling(EnvironmentCall.STEP, turn) as answer:
                result = await self.env.step(self.start.episode_id, turn, model.text)
                state = await self.env.state(self.start.episode_id) if self.env.has_state else None
                answer.done = result.done
            ids = await self._environment_tokens(result.messages, model, result.done)
            reply = EnvironmentReply(
                turn, tuple(result.messages), ids, result.done, result.reward, state
            )
            await self.log.append(reply, wait=False)  # the next turn's write waits for it
        else:
            assert isinstance(found, EnvironmentReply)
            reply = found
            self.conversation.messages.extend(found.messages)
            self.conversation.segments.append(found.token_ids)
            self.ended_by.append(_ended_on(model))
        self.final = reply.done
        if reply.token_ids:
            self.spans.append(TurnSpan(len(self.tokens), TurnKind.ENVIRONMENT))
            self.tokens.extend(reply.token_ids)
            self.logprobs.extend(array("f", bytes(4 * len(reply.token_ids))))
        return reply

    async def _environment_tokens(self, messages, model: ModelTurn, done: bool) -> array[int]:  # type: ignore[no-untyped-def]
        last = _ended_on(model)
        self.ended_by.append(last)
        return await self.conversation.add_environment(messages, last_model_token=last, final=done)


def _ended_on(model: ModelTurn) -> int | None:
    """The token a model turn stopped on (its end-of-turn token), which the template's closing
    of the turn must not repeat."""
    if model.finish_reason == "stop" and model.token_ids:
        return model.token_ids[-1]
    return None
