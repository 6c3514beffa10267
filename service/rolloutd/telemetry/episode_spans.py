"""An episode as spans in the OpenTelemetry GenAI conventions (agent spans), under its group's
``rolloutd.group.generate`` span (:mod:`rolloutd.telemetry.generation`)::

    rolloutd.group.generate
    └── invoke_agent <source>                one per episode (sibling), open while it runs
        ├── rolloutd.episode.reset           the environment's reset (or its restore)
        ├── text_completion <model>          a model turn, from request to its last token
        ├── execute_tool <environment>       the step after it
        └── …

Every span carries ``gen_ai.conversation.id``, the episode id (``g<group>-s<sibling>``, stable
across restarts), so one query finds an episode's spans in every life of the service. The runner
reports each turn and call once it is over, with its true start and end, and the episode's span
is ended when the episode ends, whatever ends it (an error status when it failed or stopped).

After a restore, a turn the restore reused is not a ``text_completion``: nothing was generated.
It is an event, ``rolloutd.episode.turn.reused``, on the episode's span. The first turn the
restored episode generates carries ``rolloutd.episode.turn.recovered = rerun``, and environment
calls that rebuild the environment's state carry ``rolloutd.episode.replay = true``.

An episode has spans only when its group's generation span is recorded (sampled, telemetry on).
"""

from __future__ import annotations

from dataclasses import dataclass

from opentelemetry import trace
from opentelemetry.trace import Span, SpanKind, Status, StatusCode, Tracer
from opentelemetry.util.types import AttributeValue

from rolloutd.domain.observer import (
    EnvironmentCall,
    EnvironmentCalled,
    EpisodeEnded,
    EpisodeStarted,
    EpisodeTurn,
)
from rolloutd.domain.report import Disposition
from rolloutd.telemetry.generation import GenAIAttr, GenerationSpans, GroupAttr

INVOKE_AGENT = "invoke_agent"
TEXT_COMPLETION = "text_completion"
EXECUTE_TOOL = "execute_tool"
"""Operation names (``gen_ai.operation.name``), and the first word of their spans' names."""
CALL_SPANS = {
    EnvironmentCall.RESET: "rolloutd.episode.reset",
    EnvironmentCall.RESTORE: "rolloutd.episode.restore",
}
"""Environment calls that are not a tool's execution: spans of rolloutd's own."""
TURN_REUSED_EVENT = "rolloutd.episode.turn.reused"


class AgentAttr:
    """GenAI semantic-convention keys of agent spans (the request keys, and the provider's name,
    are :class:`GenAIAttr`)."""

    AGENT_NAME = "gen_ai.agent.name"
    """The name of the episode's source (``dataset`` for a single dataset, ``submitted``)."""
    CONVERSATION_ID = "gen_ai.conversation.id"
    """The episode id."""
    TOOL_NAME = "gen_ai.tool.name"
    """The environment (its spec, ``package.module:Class``, or URL)."""
    TOOL_CALL_ID = "gen_ai.tool.call.id"
    """``<episode id>-t<turn>``: the key an environment deduplicates side effects on."""
    RESPONSE_FINISH_REASONS = "gen_ai.response.finish_reasons"
    ERROR_TYPE = "error.type"
    """Why it failed: an ``EpisodeEnd`` value (``step_failed``, ``step_timeout``, ``malformed``)
    or, for an episode stopped by an exception, the exception's class."""


class EpisodeAttr:
    """rolloutd's own keys on an episode's spans."""

    SIBLING = "rolloutd.episode.sibling"
    RESTORED = "rolloutd.episode.restored"
    """The episode goes on from records a restore found."""
    TURN = "rolloutd.episode.turn"
    """The model turn (from 0) a ``text_completion`` generated or an ``execute_tool`` answers."""
    RECOVERED = "rolloutd.episode.turn.recovered"
    """``rerun`` on the first turn generated after a restore; ``reused`` on a reused turn's
    event."""
    RESUMED_TOKENS = "rolloutd.episode.turn.resumed_tokens"
    """Tokens a rerun turn continued from (the snapshot had captured them)."""
    REPLAY = "rolloutd.episode.replay"
    REPLAY_MISMATCH = "rolloutd.episode.replay.mismatch"
    """A replayed call answered other messages than the recorded ones (kept)."""
    DONE = "rolloutd.episode.done"
    """The environment said the episode is over."""
    END = "rolloutd.episode.end"
    """How the episode ended (``EpisodeEnd``; the sample's finish reason is ``episode:<end>``)."""
    TURNS = "rolloutd.episode.turns"
    TURNS_REUSED = "rolloutd.episode.turns.reused"
    ENVIRONMENT_TOKENS = "rolloutd.episode.environment_tokens"
    REWARD = "rolloutd.episode.reward"
    RETOKENIZATION_MISMATCHES = "rolloutd.episode.retokenization_mismatches"


@dataclass
class _Open:
    span: Span
    tool: str
    reused: int = 0


class EpisodeSpans:
    """The open ``invoke_agent`` spans, by episode id (event-loop only)."""

    def __init__(self, tracer: Tracer, generation: GenerationSpans) -> None:
        self._tracer = tracer
        self._generation = generation
        self._open: dict[str, _Open] = {}

    def __len__(self) -> int:
        return len(self._open)

    def _common(self, episode_id: str) -> dict[str, AttributeValue]:
        attributes: dict[str, AttributeValue] = {AgentAttr.CONVERSATION_ID: episode_id}
        if self._generation.engine is not None:
            attributes[GenAIAttr.PROVIDER_NAME] = self._generation.engine
        if self._generation.model is not None:
            attributes[GenAIAttr.REQUEST_MODEL] = self._generation.model
        return attributes

    def _child(
        self, parent: Span, name: str, start_ns: int, attributes: dict[str, AttributeValue]
    ) -> Span:
        return self._tracer.start_span(
            name,
            context=trace.set_span_in_context(parent),
            kind=SpanKind.INTERNAL,
            attributes=attributes,
            start_time=start_ns,
        )

    def started(self, event: EpisodeStarted) -> None:
        parent = self._generation.get(event.group_id)
        if parent is None:
            return  # not recorded: nothing of the episode is
        attributes = self._common(event.episode_id)
        attributes.update(
            {
                GenAIAttr.OPERATION_NAME: INVOKE_AGENT,
                GroupAttr.ID: event.group_id,
                EpisodeAttr.SIBLING: event.sibling,
                EpisodeAttr.RESTORED: event.restored,
            }
        )
        name = INVOKE_AGENT
        if event.source:
            attributes[AgentAttr.AGENT_NAME] = event.source
            name = f"{INVOKE_AGENT} {event.source}"
        span = self._child(parent, name, event.started_ns, attributes)
        self._open[event.episode_id] = _Open(span, event.environment)

    def turn(self, event: EpisodeTurn) -> None:
        episode = self._open.get(event.episode_id)
        if episode is None:
            return
        if event.recovered is Disposition.REUSED:
            episode.reused += 1
            episode.span.add_event(
                TURN_REUSED_EVENT,
                {
                    EpisodeAttr.TURN: event.turn,
                    EpisodeAttr.RECOVERED: Disposition.REUSED.value,
                    GenAIAttr.USAGE_OUTPUT_TOKENS: event.output_tokens,
                },
                timestamp=event.ended_ns,
            )
            return
        attributes = self._common(event.episode_id)
        attributes.update(
            {
                GenAIAttr.OPERATION_NAME: TEXT_COMPLETION,
                EpisodeAttr.TURN: event.turn,
                GenAIAttr.USAGE_INPUT_TOKENS: event.input_tokens,
                GenAIAttr.USAGE_OUTPUT_TOKENS: event.output_tokens,
                AgentAttr.RESPONSE_FINISH_REASONS: (event.finish_reason,),
            }
        )
        if event.recovered is not None:
            attributes[EpisodeAttr.RECOVERED] = event.recovered.value
            attributes[EpisodeAttr.RESUMED_TOKENS] = event.resumed_tokens
        model = self._generation.model
        name = TEXT_COMPLETION if model is None else f"{TEXT_COMPLETION} {model}"
        self._child(episode.span, name, event.started_ns, attributes).end(event.ended_ns)

    def called(self, event: EnvironmentCalled) -> None:
        episode = self._open.get(event.episode_id)
        if episode is None:
            return
        attributes: dict[str, AttributeValue] = {
            AgentAttr.CONVERSATION_ID: event.episode_id,
            EpisodeAttr.REPLAY: event.replay,
        }
        if event.call is EnvironmentCall.STEP:
            attributes.update(
                {
                    GenAIAttr.OPERATION_NAME: EXECUTE_TOOL,
                    AgentAttr.TOOL_NAME: episode.tool,
                    AgentAttr.TOOL_CALL_ID: f"{event.episode_id}-t{event.turn}",
                    EpisodeAttr.TURN: event.turn,
                    EpisodeAttr.DONE: event.done,
                }
            )
            name = f"{EXECUTE_TOOL} {episode.tool}"
        else:
            name = CALL_SPANS[event.call]
        if event.replay:
            attributes[EpisodeAttr.REPLAY_MISMATCH] = event.mismatch
        span = self._child(episode.span, name, event.started_ns, attributes)
        if event.failure is not None:
            span.set_attribute(AgentAttr.ERROR_TYPE, event.failure.value)
            span.set_status(Status(StatusCode.ERROR, event.detail or event.failure.value))
        span.end(event.ended_ns)

    def ended(self, event: EpisodeEnded) -> None:
        episode = self._open.pop(event.episode_id, None)
        if episode is None:
            return
        span = episode.span
        span.set_attributes(
            {
                EpisodeAttr.TURNS: event.turns,
                EpisodeAttr.TURNS_REUSED: episode.reused,
                GenAIAttr.USAGE_INPUT_TOKENS: event.prompt_tokens,
                GenAIAttr.USAGE_OUTPUT_TOKENS: event.model_tokens,
                EpisodeAttr.ENVIRONMENT_TOKENS: event.environment_tokens,
                EpisodeAttr.RETOKENIZATION_MISMATCHES: event.retokenization_mismatches,
            }
        )
        if event.reward is not None:
            span.set_attribute(EpisodeAttr.REWARD, event.reward)
        if event.end is None:  # stopped by an exception: "Class: message"
            span.set_attribute(AgentAttr.ERROR_TYPE, event.error.split(":", 1)[0] or "_OTHER")
            span.set_status(Status(StatusCode.ERROR, event.error))
        else:
            span.set_attribute(EpisodeAttr.END, event.end.value)
            if event.end.failed:
                span.set_attribute(AgentAttr.ERROR_TYPE, event.end.value)
                span.set_status(Status(StatusCode.ERROR, event.end.value))
        span.end(event.ended_ns)
