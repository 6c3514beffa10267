"""Proto <-> domain conversion: every proto message the service builds or reads is built or read here."""

from __future__ import annotations

import json
import math
from collections.abc import AsyncIterator, Callable
from typing import Any

from google.protobuf import json_format, struct_pb2

from rolloutd.domain.concurrency import InFlightReason
from rolloutd.domain.controller import AdmissionStatus, ControllerStatus
from rolloutd.domain.encoder import (
    MAX_METADATA_DEPTH,
    Undeliverable,
    metadata_too_deep,
    tools_problem,
)
from rolloutd.domain.errors import InvalidArgument
from rolloutd.domain.fate import EngineState, TokenAccount, TokenFate
from rolloutd.domain.group import Group, Prompt, Sample, ScoreStatus, TurnKind
from rolloutd.domain.lifecycle import ServingState
from rolloutd.domain.report import CheckpointReport, Outcome, Reason, RowKind, SizePart
from rolloutd.domain.sampler import SUBMITTED
from rolloutd.domain.spec import GenerationSpec, SamplingParams
from rolloutd.push_codec import decode_chunk
from rolloutd.v1 import rollout_pb2 as pb
from rolloutd.weights.receive import PushChunk, PushHeader
from rolloutd.weights.staging import FileSpec
from rolloutd.weights.updater import UpdateResult

MAX_PROMPT_CHARS = 1_000_000
MAX_PROMPT_ID_CHARS = 512
ROLES = ("system", "user", "assistant", "tool")
"""Chat roles a prompt's messages may have."""

OUTCOMES = {
    Outcome.COMPLETED: pb.CHECKPOINT_OUTCOME_COMPLETED,
    Outcome.SKIPPED: pb.CHECKPOINT_OUTCOME_SKIPPED,
    Outcome.FAILED: pb.CHECKPOINT_OUTCOME_FAILED,
}
REASONS: dict[Reason, Any] = {
    r: pb.CheckpointReason.Value(f"CHECKPOINT_REASON_{r.name}") for r in Reason
}
SERVING_STATES: dict[ServingState, Any] = {
    s: pb.ServingState.Value(f"SERVING_STATE_{s.name}") for s in ServingState
}
IN_FLIGHT_REASONS: dict[InFlightReason, Any] = {
    r: pb.InFlightReason.Value(f"IN_FLIGHT_REASON_{r.name}") for r in InFlightReason
}


def _struct(d: dict[str, Any]) -> struct_pb2.Struct:
    s = struct_pb2.Struct()
    s.update(d)
    return s


SCORE_STATUSES = {ScoreStatus.OK: pb.SCORE_STATUS_OK, ScoreStatus.FAILED: pb.SCORE_STATUS_FAILED}
"""Every score status, as the proto says it (a test checks none is missing)."""

_METADATA_JSON = json.JSONEncoder(ensure_ascii=False).encode
"""``json.dumps(value, ensure_ascii=False)`` without building an encoder on each call."""


def _sample_fields(s: Sample) -> dict[str, Any]:
    """A ``pb.Sample``'s fields; the arrays as lists, which protobuf takes in one pass where
    it iterates an array element by element."""
    return {
        "index": s.index,
        "token_ids": s.token_ids.tolist(),
        "logprobs": s.logprobs.tolist(),
        "text": s.text,
        "finish_reason": s.finish_reason,
        "policy_version": s.policy_version,
        "prompt_token_ids": s.prompt_token_ids.tolist(),
        "seed": s.seed,
        "started_at": s.started_at,
        "finished_at": s.finished_at,
        "resumed_at": s.resumed_at,
        "parts": [pb.SamplePart(start=p.start, policy_version=p.policy_version) for p in s.parts],
        "loss_mask": s.loss_mask().tolist() if s.turns else [],
        "turn_starts": [pb.TurnStart(start=t.start, kind=_TURN_KINDS[t.kind]) for t in s.turns],
        "episode_reward": s.episode_reward,
        "retokenization_mismatches": s.retokenization_mismatches,
    }


_TURN_KINDS = {
    TurnKind.MODEL: pb.TURN_KIND_MODEL,
    TurnKind.ENVIRONMENT: pb.TURN_KIND_ENVIRONMENT,
}
"""Every turn kind, as the proto says it."""


def spec_to_proto(p: SamplingParams, group_size: int, seed: int) -> pb.GenerationSpec:
    """Every setting of a group, as it was generated."""
    return pb.GenerationSpec(
        temperature=p.temperature,
        top_p=p.top_p,
        top_k=p.top_k,
        min_p=p.min_p,
        max_tokens=p.max_tokens,
        stop=p.stop,
        seed=seed,
        group_size=group_size,
    )


def spec_from_proto(s: pb.GenerationSpec) -> GenerationSpec:
    """The settings a prompt sets (its fields present in ``s``)."""
    return GenerationSpec(
        **{
            name: getattr(s, name)
            for name in ("temperature", "top_p", "top_k", "min_p", "max_tokens", "seed")
            if s.HasField(name)
        },
        stop=tuple(s.stop) or None,
        group_size=s.group_size if s.HasField("group_size") else None,
    )


def group_to_proto(g: Group, source: str, params: SamplingParams) -> pb.Group:
    """The group with its samples built in place (a list of built samples passed to
    ``pb.Group`` would be copied into it): ``FetchGroups`` builds one per delivered group.
    ``source``: the name of its source; ``params``: its sampling settings."""
    m = g.meta
    position = m.position
    metadata = m.prompt.metadata
    group = pb.Group(
        group_id=g.group_id,
        prompt_id=m.prompt.prompt_id,
        epoch=position.epoch if position else 0,
        offset=position.offset if position else 0,
        source=pb.PROMPT_SOURCE_DATASET if position else pb.PROMPT_SOURCE_SUBMITTED,
        prompt_text=m.prompt.text,
        metadata=_struct(metadata) if isinstance(metadata, dict) else None,
        metadata_json=_METADATA_JSON(metadata),
        policy_version=m.policy_version,
        admitted_at=m.admitted_at,
        committed_at=m.committed_at or 0.0,
        generation=spec_to_proto(params, m.group_size, m.seed),
        source_name=source,
    )
    add = group.samples.add
    scores = m.scores
    if scores is None:
        for s in g.ordered_samples():
            add(**_sample_fields(s))
        return group
    group.reward_mean, group.reward_std = scores.mean, scores.std
    for s, score in zip(g.ordered_samples(), scores.samples, strict=True):
        add(
            **_sample_fields(s),
            reward=score.reward,
            reward_info_json=score.info,
            score_status=SCORE_STATUSES[score.status],
        )
    return group


class GroupEncoder:
    """Encodes the groups of a ``FetchGroups`` response before their lease is granted
    (``domain.delivery.GroupEncoder``): a group no trainer could decode (metadata nested too
    deep for protobuf's parsers) or that alone is larger than a message is refused, and a
    response holds no more groups than one message does."""

    RESERVE = 4096
    """Bytes of a response kept for its other fields and each group's framing."""

    def __init__(
        self, max_message_bytes: int, settings: Callable[[Group], tuple[str, SamplingParams]]
    ) -> None:
        """``settings``: a group's source name and sampling settings (``Controller.settings_of``)."""
        self.max_bytes = max_message_bytes - self.RESERVE
        self._settings = settings

    def encode(self, group: Group) -> tuple[pb.Group, int]:
        metadata = group.meta.prompt.metadata
        if metadata is not None and metadata_too_deep(metadata):
            raise Undeliverable(
                f"its metadata is nested deeper than {MAX_METADATA_DEPTH} levels, more than "
                "protobuf parses"
            )
        message = group_to_proto(group, *self._settings(group))
        size = message.ByteSize() + 16  # the field's tag and length
        if size > self.max_bytes:
            raise Undeliverable(
                f"{size} bytes encoded, more than one gRPC message holds (grpc.max_message_mb)"
            )
        return message, size


def prompt_from_proto(p: pb.Prompt, i: int, max_metadata_bytes: float = math.inf) -> Prompt:
    """The domain's prompt; ``metadata_json`` longer than ``max_metadata_bytes`` is refused
    before it is parsed (the domain checks the parsed metadata's size and depth again)."""
    field = f"prompts[{i}]"
    if not p.prompt_id:
        raise InvalidArgument(f"{field}.prompt_id", "must not be empty")
    if len(p.prompt_id) > MAX_PROMPT_ID_CHARS:
        raise InvalidArgument(
            f"{field}.prompt_id", f"must be at most {MAX_PROMPT_ID_CHARS} characters"
        )
    messages = tuple({"role": m.role, "content": m.content} for m in p.messages)
    if messages and p.text:
        raise InvalidArgument(field, "give text or messages, not both")
    for j, m in enumerate(messages):
        if m["role"] not in ROLES:
            raise InvalidArgument(
                f"{field}.messages[{j}].role",
                f"must be one of {', '.join(ROLES)}, not {m['role']!r}",
            )
        if not m["content"].strip():
            raise InvalidArgument(f"{field}.messages[{j}].content", "must not be empty")
    if not p.text.strip() and not messages:
        raise InvalidArgument(f"{field}.text", "must not be empty (or give messages)")
    text = p.text if p.text.strip() else "\n".join(m["content"] for m in messages)
    if len(text) > MAX_PROMPT_CHARS:
        raise InvalidArgument(f"{field}.text", f"must be at most {MAX_PROMPT_CHARS} characters")
    metadata = _metadata(p, field, max_metadata_bytes)
    return Prompt(
        prompt_id=p.prompt_id,
        text=text,
        metadata=metadata,
        messages=messages,
        generation=spec_from_proto(p.generation) if p.HasField("generation") else GenerationSpec(),
        tools=_tools(p, field, max_metadata_bytes),
    )


def _tools(p: pb.Prompt, field: str, max_bytes: float) -> tuple[dict[str, Any], ...]:
    """``tools_json`` as a list of JSON objects (none when empty); bounded before it is parsed
    and checked after (shape, depth, size) as metadata is."""
    if not p.tools_json:
        return ()
    where = f"{field}.tools_json"
    if len(p.tools_json) > max_bytes:  # characters: at most the bytes of UTF-8
        raise InvalidArgument(
            where,
            f"of prompt {p.prompt_id!r}: {len(p.tools_json)} characters, more than "
            f"limits.max_metadata_bytes={int(max_bytes)}",
        )
    try:
        tools = json.loads(p.tools_json)
    except json.JSONDecodeError as exc:
        raise InvalidArgument(where, f"not JSON: {exc}") from None
    except RecursionError:
        raise InvalidArgument(
            where, f"of prompt {p.prompt_id!r}: nested deeper than {MAX_METADATA_DEPTH} levels"
        ) from None
    problem = tools_problem(tools, max_bytes)
    if problem is not None:
        raise InvalidArgument(where, f"of prompt {p.prompt_id!r}: {problem}")
    return tuple(tools)


def _metadata(p: pb.Prompt, field: str, max_bytes: float) -> Any:
    """``metadata_json`` exactly as given (any JSON value), else the Struct, else None."""
    if p.metadata_json:
        if len(p.metadata_json) > max_bytes:  # characters: at most the bytes of UTF-8
            raise InvalidArgument(
                f"{field}.metadata_json",
                f"of prompt {p.prompt_id!r}: {len(p.metadata_json)} characters, more than "
                f"limits.max_metadata_bytes={int(max_bytes)}",
            )
        if p.HasField("metadata"):
            raise InvalidArgument(
                f"{field}.metadata_json", "give metadata_json or metadata, not both"
            )
        try:
            return json.loads(p.metadata_json)
        except json.JSONDecodeError as exc:
            raise InvalidArgument(f"{field}.metadata_json", f"not JSON: {exc}") from None
        except RecursionError:
            raise InvalidArgument(
                f"{field}.metadata_json",
                f"of prompt {p.prompt_id!r}: nested deeper than {MAX_METADATA_DEPTH} levels",
            ) from None
    return json_format.MessageToDict(p.metadata) if p.HasField("metadata") else None


def checkpoint_to_proto(r: CheckpointReport) -> pb.CheckpointResponse:
    return pb.CheckpointResponse(
        outcome=OUTCOMES[r.outcome],
        reason=REASONS[r.reason],
        sequence=r.sequence or 0,
        phase_seconds=r.phase_seconds(),
        rows_written=r.rows.get(RowKind.NEW, 0),
        bytes_written=r.size_bytes.get(SizePart.TOTAL, 0),
        message=r.message(),
    )


def checkpoint_status_to_proto(
    sequence: int,
    consecutive_failures: int,
    completed_at: float,
    last_attempt: CheckpointReport | None,
) -> pb.CheckpointStatus:
    status = pb.CheckpointStatus(
        sequence=sequence, consecutive_failures=consecutive_failures, completed_at=completed_at
    )
    if last_attempt is not None:
        status.outcome = OUTCOMES[last_attempt.outcome]
        status.reason = REASONS[last_attempt.reason]
        status.attempted_at = last_attempt.ended_ns / 1e9
        status.tag = last_attempt.tag
    return status


def status_to_proto(
    s: ControllerStatus,
    engine: str,
    state: ServingState,
    generation_tokens: int,
    last_checkpoint: pb.CheckpointStatus,
    tokens: TokenAccount,
) -> pb.GetStatusResponse:
    c = s.counters
    fates, seconds = tokens.fates, tokens.engine_seconds
    return pb.GetStatusResponse(
        state=SERVING_STATES[state],
        engine=engine,
        policy_version=s.policy_version,
        group_size=s.group_size,
        buffer=pb.BufferStatus(
            generating=s.buffer.generating,
            committed=s.buffer.committed,
            leased=s.buffer.leased,
            acked=s.buffer.acked,
            finishing=s.buffer.finishing,
            capacity=s.capacity,
            max_in_flight=s.max_in_flight,
        ),
        inflight_samples=s.inflight_samples,
        pending_prompts=s.pending_prompts,
        cursor_epoch=s.cursor_epoch,
        cursor_offset=s.cursor_offset,
        dataset_exhausted=s.dataset_exhausted,
        counters=pb.Counters(
            admitted_groups=c.admitted_groups,
            committed_groups=c.committed_groups,
            acked_groups=c.acked_groups,
            finalized_groups=c.finalized_groups,
            evicted_groups=c.evicted_groups,
            committed_tokens=c.committed_tokens,
            requeued_groups=c.requeued_groups,
            generation_tokens=generation_tokens,
            dropped_groups=c.dropped_groups,
            dropped_by_reason=c.dropped_by_reason,
            dropped_tokens=c.dropped_tokens,
        ),
        last_checkpoint=last_checkpoint,
        replica=s.replica,
        replicas=s.replicas,
        sources=[
            pb.SourceStatus(
                name=src.name,
                weight=src.weight,
                epoch=src.cursor.epoch,
                offset=src.cursor.offset,
                prompts=src.prompts,
                exhausted=src.exhausted,
                committed_groups=c.committed_by_source.get(src.name, 0),
                committed_tokens=c.committed_tokens_by_source.get(src.name, 0),
                delivered_groups=c.acked_by_source.get(src.name, 0),
            )
            for src in s.sources
        ],
        submitted_committed_groups=c.committed_by_source.get(SUBMITTED, 0),
        submitted_delivered_groups=c.acked_by_source.get(SUBMITTED, 0),
        tokens=pb.TokenAccount(
            generated=tokens.generated,
            delivered=fates[TokenFate.DELIVERED],
            evicted=fates[TokenFate.EVICTED],
            dropped=fates[TokenFate.DROPPED],
            regenerated=fates[TokenFate.REGENERATED],
            failed=fates[TokenFate.FAILED],
            buffered=fates[TokenFate.BUFFERED],
            goodput=tokens.goodput,
        ),
        engine_time=pb.EngineTime(
            generating_seconds=seconds[EngineState.GENERATING],
            weight_update_seconds=seconds[EngineState.WEIGHT_UPDATE],
            idle_no_work_seconds=seconds[EngineState.IDLE_NO_WORK],
            idle_buffer_full_seconds=seconds[EngineState.IDLE_BUFFER_FULL],
        ),
        admission=admission_to_proto(s.admission),
    )


def admission_to_proto(a: AdmissionStatus) -> pb.AdmissionStatus:
    return pb.AdmissionStatus(
        in_flight_limit=a.in_flight_limit,
        in_flight_reason=IN_FLIGHT_REASONS[a.in_flight_reason],
        in_flight_ceiling=a.in_flight_ceiling,
        adaptive=a.adaptive,
        staleness_gating=a.staleness_gating,
        consumed_per_version=a.consumed_per_version,
        staleness_room=a.staleness_room,
    )


def push_request(raw: bytes) -> pb.PushWeightsRequest | PushChunk:
    """The request deserializer of ``PushWeights``: a chunk is read straight off the wire
    (:func:`rolloutd.push_codec.decode_chunk`), its bytes kept as a view of the received message;
    anything else, and anything malformed, is parsed by protobuf, which parses or refuses it."""
    chunk = decode_chunk(raw)
    return pb.PushWeightsRequest.FromString(raw) if chunk is None else PushChunk(*chunk)


async def push_messages(
    requests: AsyncIterator[pb.PushWeightsRequest | PushChunk],
) -> AsyncIterator[PushHeader | PushChunk]:
    """A push's messages as the updater's plain values; chunk bytes are passed on, not copied."""
    async for r in requests:
        if isinstance(r, PushChunk):
            yield r
            continue
        kind = r.WhichOneof("payload")
        if kind == "header":
            files = tuple(FileSpec(f.name, f.size, f.sha256 or None) for f in r.header.files)
            base = r.header.base_version if r.header.HasField("base_version") else None
            yield PushHeader(r.header.version, files, base)
        elif kind == "chunk":
            yield PushChunk(r.chunk.file, r.chunk.offset, r.chunk.data)
        else:
            raise InvalidArgument("payload", "each message must hold a header or a chunk")


def weights_update_fields(result: UpdateResult, seconds: float) -> dict[str, Any]:
    """The fields UpdateWeightsResponse and PushWeightsResponse share."""
    return {
        "policy_version": result.policy_version,
        "evicted_groups": result.evicted_groups,
        "seconds": seconds,
        "bytes": result.report.bytes,
        "phase_seconds": result.report.phase_seconds(),
        "density": result.report.density or 0.0,
    }
