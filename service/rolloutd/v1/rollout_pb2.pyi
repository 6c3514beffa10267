from google.protobuf import struct_pb2 as _struct_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class PromptSource(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PROMPT_SOURCE_UNSPECIFIED: _ClassVar[PromptSource]
    PROMPT_SOURCE_DATASET: _ClassVar[PromptSource]
    PROMPT_SOURCE_SUBMITTED: _ClassVar[PromptSource]

class TurnKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TURN_KIND_UNSPECIFIED: _ClassVar[TurnKind]
    TURN_KIND_MODEL: _ClassVar[TurnKind]
    TURN_KIND_ENVIRONMENT: _ClassVar[TurnKind]

class ScoreStatus(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SCORE_STATUS_UNSPECIFIED: _ClassVar[ScoreStatus]
    SCORE_STATUS_OK: _ClassVar[ScoreStatus]
    SCORE_STATUS_FAILED: _ClassVar[ScoreStatus]

class CheckpointOutcome(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    CHECKPOINT_OUTCOME_UNSPECIFIED: _ClassVar[CheckpointOutcome]
    CHECKPOINT_OUTCOME_COMPLETED: _ClassVar[CheckpointOutcome]
    CHECKPOINT_OUTCOME_SKIPPED: _ClassVar[CheckpointOutcome]
    CHECKPOINT_OUTCOME_FAILED: _ClassVar[CheckpointOutcome]

class CheckpointReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    CHECKPOINT_REASON_UNSPECIFIED: _ClassVar[CheckpointReason]
    CHECKPOINT_REASON_COMPLETED: _ClassVar[CheckpointReason]
    CHECKPOINT_REASON_NO_CHANGES: _ClassVar[CheckpointReason]
    CHECKPOINT_REASON_IN_PROGRESS: _ClassVar[CheckpointReason]
    CHECKPOINT_REASON_RESTORING: _ClassVar[CheckpointReason]
    CHECKPOINT_REASON_SHUTTING_DOWN: _ClassVar[CheckpointReason]
    CHECKPOINT_REASON_IO_ERROR: _ClassVar[CheckpointReason]
    CHECKPOINT_REASON_TIMEOUT: _ClassVar[CheckpointReason]
    CHECKPOINT_REASON_INVARIANT_ERROR: _ClassVar[CheckpointReason]

class ServingState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SERVING_STATE_UNSPECIFIED: _ClassVar[ServingState]
    SERVING_STATE_STARTING: _ClassVar[ServingState]
    SERVING_STATE_RESTORING: _ClassVar[ServingState]
    SERVING_STATE_SERVING: _ClassVar[ServingState]
    SERVING_STATE_NOT_READY: _ClassVar[ServingState]
    SERVING_STATE_DRAINING: _ClassVar[ServingState]

class InFlightReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    IN_FLIGHT_REASON_UNSPECIFIED: _ClassVar[InFlightReason]
    IN_FLIGHT_REASON_FIXED: _ClassVar[InFlightReason]
    IN_FLIGHT_REASON_STARTING: _ClassVar[InFlightReason]
    IN_FLIGHT_REASON_GROWING: _ClassVar[InFlightReason]
    IN_FLIGHT_REASON_KV_CACHE_HIGH: _ClassVar[InFlightReason]
    IN_FLIGHT_REASON_PREEMPTED: _ClassVar[InFlightReason]
    IN_FLIGHT_REASON_CEILING: _ClassVar[InFlightReason]
    IN_FLIGHT_REASON_NOT_LIMITING: _ClassVar[InFlightReason]
PROMPT_SOURCE_UNSPECIFIED: PromptSource
PROMPT_SOURCE_DATASET: PromptSource
PROMPT_SOURCE_SUBMITTED: PromptSource
TURN_KIND_UNSPECIFIED: TurnKind
TURN_KIND_MODEL: TurnKind
TURN_KIND_ENVIRONMENT: TurnKind
SCORE_STATUS_UNSPECIFIED: ScoreStatus
SCORE_STATUS_OK: ScoreStatus
SCORE_STATUS_FAILED: ScoreStatus
CHECKPOINT_OUTCOME_UNSPECIFIED: CheckpointOutcome
CHECKPOINT_OUTCOME_COMPLETED: CheckpointOutcome
CHECKPOINT_OUTCOME_SKIPPED: CheckpointOutcome
CHECKPOINT_OUTCOME_FAILED: CheckpointOutcome
CHECKPOINT_REASON_UNSPECIFIED: CheckpointReason
CHECKPOINT_REASON_COMPLETED: CheckpointReason
CHECKPOINT_REASON_NO_CHANGES: CheckpointReason
CHECKPOINT_REASON_IN_PROGRESS: CheckpointReason
CHECKPOINT_REASON_RESTORING: CheckpointReason
CHECKPOINT_REASON_SHUTTING_DOWN: CheckpointReason
CHECKPOINT_REASON_IO_ERROR: CheckpointReason
CHECKPOINT_REASON_TIMEOUT: CheckpointReason
CHECKPOINT_REASON_INVARIANT_ERROR: CheckpointReason
SERVING_STATE_UNSPECIFIED: ServingState
SERVING_STATE_STARTING: ServingState
SERVING_STATE_RESTORING: ServingState
SERVING_STATE_SERVING: ServingState
SERVING_STATE_NOT_READY: ServingState
SERVING_STATE_DRAINING: ServingState
IN_FLIGHT_REASON_UNSPECIFIED: InFlightReason
IN_FLIGHT_REASON_FIXED: InFlightReason
IN_FLIGHT_REASON_STARTING: InFlightReason
IN_FLIGHT_REASON_GROWING: InFlightReason
IN_FLIGHT_REASON_KV_CACHE_HIGH: InFlightReason
IN_FLIGHT_REASON_PREEMPTED: InFlightReason
IN_FLIGHT_REASON_CEILING: InFlightReason
IN_FLIGHT_REASON_NOT_LIMITING: InFlightReason

class ChatMessage(_message.Message):
    __slots__ = ("role", "content")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: str
    def __init__(self, role: _Optional[str] = ..., content: _Optional[str] = ...) -> None: ...

class Prompt(_message.Message):
    __slots__ = ("prompt_id", "text", "metadata", "messages", "metadata_json", "generation", "tools_json")
    PROMPT_ID_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    METADATA_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    METADATA_JSON_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    TOOLS_JSON_FIELD_NUMBER: _ClassVar[int]
    prompt_id: str
    text: str
    metadata: _struct_pb2.Struct
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    metadata_json: str
    generation: GenerationSpec
    tools_json: str
    def __init__(self, prompt_id: _Optional[str] = ..., text: _Optional[str] = ..., metadata: _Optional[_Union[_struct_pb2.Struct, _Mapping]] = ..., messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ..., metadata_json: _Optional[str] = ..., generation: _Optional[_Union[GenerationSpec, _Mapping]] = ..., tools_json: _Optional[str] = ...) -> None: ...

class GenerationSpec(_message.Message):
    __slots__ = ("temperature", "top_p", "top_k", "min_p", "max_tokens", "stop", "seed", "group_size")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    GROUP_SIZE_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    max_tokens: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    seed: int
    group_size: int
    def __init__(self, temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., min_p: _Optional[float] = ..., max_tokens: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., seed: _Optional[int] = ..., group_size: _Optional[int] = ...) -> None: ...

class Sample(_message.Message):
    __slots__ = ("index", "token_ids", "logprobs", "text", "finish_reason", "policy_version", "prompt_token_ids", "seed", "started_at", "finished_at", "resumed_at", "parts", "reward", "reward_info_json", "score_status", "loss_mask", "turn_starts", "episode_reward", "retokenization_mismatches")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    STARTED_AT_FIELD_NUMBER: _ClassVar[int]
    FINISHED_AT_FIELD_NUMBER: _ClassVar[int]
    RESUMED_AT_FIELD_NUMBER: _ClassVar[int]
    PARTS_FIELD_NUMBER: _ClassVar[int]
    REWARD_FIELD_NUMBER: _ClassVar[int]
    REWARD_INFO_JSON_FIELD_NUMBER: _ClassVar[int]
    SCORE_STATUS_FIELD_NUMBER: _ClassVar[int]
    LOSS_MASK_FIELD_NUMBER: _ClassVar[int]
    TURN_STARTS_FIELD_NUMBER: _ClassVar[int]
    EPISODE_REWARD_FIELD_NUMBER: _ClassVar[int]
    RETOKENIZATION_MISMATCHES_FIELD_NUMBER: _ClassVar[int]
    index: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    text: str
    finish_reason: str
    policy_version: int
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    seed: int
    started_at: float
    finished_at: float
    resumed_at: int
    parts: _containers.RepeatedCompositeFieldContainer[SamplePart]
    reward: float
    reward_info_json: str
    score_status: ScoreStatus
    loss_mask: _containers.RepeatedScalarFieldContainer[int]
    turn_starts: _containers.RepeatedCompositeFieldContainer[TurnStart]
    episode_reward: float
    retokenization_mismatches: int
    def __init__(self, index: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[float]] = ..., text: _Optional[str] = ..., finish_reason: _Optional[str] = ..., policy_version: _Optional[int] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., seed: _Optional[int] = ..., started_at: _Optional[float] = ..., finished_at: _Optional[float] = ..., resumed_at: _Optional[int] = ..., parts: _Optional[_Iterable[_Union[SamplePart, _Mapping]]] = ..., reward: _Optional[float] = ..., reward_info_json: _Optional[str] = ..., score_status: _Optional[_Union[ScoreStatus, str]] = ..., loss_mask: _Optional[_Iterable[int]] = ..., turn_starts: _Optional[_Iterable[_Union[TurnStart, _Mapping]]] = ..., episode_reward: _Optional[float] = ..., retokenization_mismatches: _Optional[int] = ...) -> None: ...

class TurnStart(_message.Message):
    __slots__ = ("start", "kind")
    START_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    start: int
    kind: TurnKind
    def __init__(self, start: _Optional[int] = ..., kind: _Optional[_Union[TurnKind, str]] = ...) -> None: ...

class SamplePart(_message.Message):
    __slots__ = ("start", "policy_version")
    START_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    start: int
    policy_version: int
    def __init__(self, start: _Optional[int] = ..., policy_version: _Optional[int] = ...) -> None: ...

class Group(_message.Message):
    __slots__ = ("group_id", "prompt_id", "epoch", "samples", "offset", "source", "prompt_text", "metadata", "policy_version", "admitted_at", "committed_at", "metadata_json", "reward_mean", "reward_std", "generation", "source_name")
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TEXT_FIELD_NUMBER: _ClassVar[int]
    METADATA_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    ADMITTED_AT_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_AT_FIELD_NUMBER: _ClassVar[int]
    METADATA_JSON_FIELD_NUMBER: _ClassVar[int]
    REWARD_MEAN_FIELD_NUMBER: _ClassVar[int]
    REWARD_STD_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    SOURCE_NAME_FIELD_NUMBER: _ClassVar[int]
    group_id: int
    prompt_id: str
    epoch: int
    samples: _containers.RepeatedCompositeFieldContainer[Sample]
    offset: int
    source: PromptSource
    prompt_text: str
    metadata: _struct_pb2.Struct
    policy_version: int
    admitted_at: float
    committed_at: float
    metadata_json: str
    reward_mean: float
    reward_std: float
    generation: GenerationSpec
    source_name: str
    def __init__(self, group_id: _Optional[int] = ..., prompt_id: _Optional[str] = ..., epoch: _Optional[int] = ..., samples: _Optional[_Iterable[_Union[Sample, _Mapping]]] = ..., offset: _Optional[int] = ..., source: _Optional[_Union[PromptSource, str]] = ..., prompt_text: _Optional[str] = ..., metadata: _Optional[_Union[_struct_pb2.Struct, _Mapping]] = ..., policy_version: _Optional[int] = ..., admitted_at: _Optional[float] = ..., committed_at: _Optional[float] = ..., metadata_json: _Optional[str] = ..., reward_mean: _Optional[float] = ..., reward_std: _Optional[float] = ..., generation: _Optional[_Union[GenerationSpec, _Mapping]] = ..., source_name: _Optional[str] = ...) -> None: ...

class FetchGroupsRequest(_message.Message):
    __slots__ = ("max_groups", "wait_ms", "consumer")
    MAX_GROUPS_FIELD_NUMBER: _ClassVar[int]
    WAIT_MS_FIELD_NUMBER: _ClassVar[int]
    CONSUMER_FIELD_NUMBER: _ClassVar[int]
    max_groups: int
    wait_ms: int
    consumer: str
    def __init__(self, max_groups: _Optional[int] = ..., wait_ms: _Optional[int] = ..., consumer: _Optional[str] = ...) -> None: ...

class FetchGroupsResponse(_message.Message):
    __slots__ = ("lease_id", "groups", "lease_expires_at")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    GROUPS_FIELD_NUMBER: _ClassVar[int]
    LEASE_EXPIRES_AT_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    groups: _containers.RepeatedCompositeFieldContainer[Group]
    lease_expires_at: float
    def __init__(self, lease_id: _Optional[str] = ..., groups: _Optional[_Iterable[_Union[Group, _Mapping]]] = ..., lease_expires_at: _Optional[float] = ...) -> None: ...

class AckGroupsRequest(_message.Message):
    __slots__ = ("lease_id", "trainer_step")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    TRAINER_STEP_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    trainer_step: int
    def __init__(self, lease_id: _Optional[str] = ..., trainer_step: _Optional[int] = ...) -> None: ...

class AckGroupsResponse(_message.Message):
    __slots__ = ("acked_groups", "already_acked")
    ACKED_GROUPS_FIELD_NUMBER: _ClassVar[int]
    ALREADY_ACKED_FIELD_NUMBER: _ClassVar[int]
    acked_groups: int
    already_acked: bool
    def __init__(self, acked_groups: _Optional[int] = ..., already_acked: _Optional[bool] = ...) -> None: ...

class SubmitPromptsRequest(_message.Message):
    __slots__ = ("prompts",)
    PROMPTS_FIELD_NUMBER: _ClassVar[int]
    prompts: _containers.RepeatedCompositeFieldContainer[Prompt]
    def __init__(self, prompts: _Optional[_Iterable[_Union[Prompt, _Mapping]]] = ...) -> None: ...

class SubmitPromptsResponse(_message.Message):
    __slots__ = ("accepted", "duplicates")
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    DUPLICATES_FIELD_NUMBER: _ClassVar[int]
    accepted: int
    duplicates: int
    def __init__(self, accepted: _Optional[int] = ..., duplicates: _Optional[int] = ...) -> None: ...

class UpdateWeightsRequest(_message.Message):
    __slots__ = ("version", "weights_path", "base_version")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_PATH_FIELD_NUMBER: _ClassVar[int]
    BASE_VERSION_FIELD_NUMBER: _ClassVar[int]
    version: int
    weights_path: str
    base_version: int
    def __init__(self, version: _Optional[int] = ..., weights_path: _Optional[str] = ..., base_version: _Optional[int] = ...) -> None: ...

class UpdateWeightsResponse(_message.Message):
    __slots__ = ("policy_version", "evicted_groups", "seconds", "bytes", "phase_seconds", "density")
    class PhaseSecondsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    EVICTED_GROUPS_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    PHASE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    DENSITY_FIELD_NUMBER: _ClassVar[int]
    policy_version: int
    evicted_groups: int
    seconds: float
    bytes: int
    phase_seconds: _containers.ScalarMap[str, float]
    density: float
    def __init__(self, policy_version: _Optional[int] = ..., evicted_groups: _Optional[int] = ..., seconds: _Optional[float] = ..., bytes: _Optional[int] = ..., phase_seconds: _Optional[_Mapping[str, float]] = ..., density: _Optional[float] = ...) -> None: ...

class WeightsFile(_message.Message):
    __slots__ = ("name", "size", "sha256")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    name: str
    size: int
    sha256: str
    def __init__(self, name: _Optional[str] = ..., size: _Optional[int] = ..., sha256: _Optional[str] = ...) -> None: ...

class PushWeightsHeader(_message.Message):
    __slots__ = ("version", "files", "base_version")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    FILES_FIELD_NUMBER: _ClassVar[int]
    BASE_VERSION_FIELD_NUMBER: _ClassVar[int]
    version: int
    files: _containers.RepeatedCompositeFieldContainer[WeightsFile]
    base_version: int
    def __init__(self, version: _Optional[int] = ..., files: _Optional[_Iterable[_Union[WeightsFile, _Mapping]]] = ..., base_version: _Optional[int] = ...) -> None: ...

class WeightsChunk(_message.Message):
    __slots__ = ("file", "offset", "data")
    FILE_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    file: str
    offset: int
    data: bytes
    def __init__(self, file: _Optional[str] = ..., offset: _Optional[int] = ..., data: _Optional[bytes] = ...) -> None: ...

class PushWeightsRequest(_message.Message):
    __slots__ = ("header", "chunk")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    header: PushWeightsHeader
    chunk: WeightsChunk
    def __init__(self, header: _Optional[_Union[PushWeightsHeader, _Mapping]] = ..., chunk: _Optional[_Union[WeightsChunk, _Mapping]] = ...) -> None: ...

class PushWeightsResponse(_message.Message):
    __slots__ = ("policy_version", "evicted_groups", "seconds", "bytes", "phase_seconds", "density")
    class PhaseSecondsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    EVICTED_GROUPS_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    PHASE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    DENSITY_FIELD_NUMBER: _ClassVar[int]
    policy_version: int
    evicted_groups: int
    seconds: float
    bytes: int
    phase_seconds: _containers.ScalarMap[str, float]
    density: float
    def __init__(self, policy_version: _Optional[int] = ..., evicted_groups: _Optional[int] = ..., seconds: _Optional[float] = ..., bytes: _Optional[int] = ..., phase_seconds: _Optional[_Mapping[str, float]] = ..., density: _Optional[float] = ...) -> None: ...

class CheckpointRequest(_message.Message):
    __slots__ = ("trainer_step", "tag")
    TRAINER_STEP_FIELD_NUMBER: _ClassVar[int]
    TAG_FIELD_NUMBER: _ClassVar[int]
    trainer_step: int
    tag: str
    def __init__(self, trainer_step: _Optional[int] = ..., tag: _Optional[str] = ...) -> None: ...

class CheckpointResponse(_message.Message):
    __slots__ = ("outcome", "reason", "sequence", "phase_seconds", "rows_written", "bytes_written", "message")
    class PhaseSecondsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    OUTCOME_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    PHASE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    ROWS_WRITTEN_FIELD_NUMBER: _ClassVar[int]
    BYTES_WRITTEN_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    outcome: CheckpointOutcome
    reason: CheckpointReason
    sequence: int
    phase_seconds: _containers.ScalarMap[str, float]
    rows_written: int
    bytes_written: int
    message: str
    def __init__(self, outcome: _Optional[_Union[CheckpointOutcome, str]] = ..., reason: _Optional[_Union[CheckpointReason, str]] = ..., sequence: _Optional[int] = ..., phase_seconds: _Optional[_Mapping[str, float]] = ..., rows_written: _Optional[int] = ..., bytes_written: _Optional[int] = ..., message: _Optional[str] = ...) -> None: ...

class RewindRequest(_message.Message):
    __slots__ = ("trainer_step",)
    TRAINER_STEP_FIELD_NUMBER: _ClassVar[int]
    trainer_step: int
    def __init__(self, trainer_step: _Optional[int] = ...) -> None: ...

class RewindResponse(_message.Message):
    __slots__ = ("redelivered_groups", "readmitted_prompts")
    REDELIVERED_GROUPS_FIELD_NUMBER: _ClassVar[int]
    READMITTED_PROMPTS_FIELD_NUMBER: _ClassVar[int]
    redelivered_groups: int
    readmitted_prompts: int
    def __init__(self, redelivered_groups: _Optional[int] = ..., readmitted_prompts: _Optional[int] = ...) -> None: ...

class GetStatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class BufferStatus(_message.Message):
    __slots__ = ("generating", "committed", "leased", "acked", "capacity", "max_in_flight", "finishing")
    GENERATING_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_FIELD_NUMBER: _ClassVar[int]
    LEASED_FIELD_NUMBER: _ClassVar[int]
    ACKED_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_FIELD_NUMBER: _ClassVar[int]
    MAX_IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    FINISHING_FIELD_NUMBER: _ClassVar[int]
    generating: int
    committed: int
    leased: int
    acked: int
    capacity: int
    max_in_flight: int
    finishing: int
    def __init__(self, generating: _Optional[int] = ..., committed: _Optional[int] = ..., leased: _Optional[int] = ..., acked: _Optional[int] = ..., capacity: _Optional[int] = ..., max_in_flight: _Optional[int] = ..., finishing: _Optional[int] = ...) -> None: ...

class CheckpointStatus(_message.Message):
    __slots__ = ("sequence", "outcome", "reason", "attempted_at", "completed_at", "tag", "consecutive_failures")
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    OUTCOME_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    ATTEMPTED_AT_FIELD_NUMBER: _ClassVar[int]
    COMPLETED_AT_FIELD_NUMBER: _ClassVar[int]
    TAG_FIELD_NUMBER: _ClassVar[int]
    CONSECUTIVE_FAILURES_FIELD_NUMBER: _ClassVar[int]
    sequence: int
    outcome: CheckpointOutcome
    reason: CheckpointReason
    attempted_at: float
    completed_at: float
    tag: str
    consecutive_failures: int
    def __init__(self, sequence: _Optional[int] = ..., outcome: _Optional[_Union[CheckpointOutcome, str]] = ..., reason: _Optional[_Union[CheckpointReason, str]] = ..., attempted_at: _Optional[float] = ..., completed_at: _Optional[float] = ..., tag: _Optional[str] = ..., consecutive_failures: _Optional[int] = ...) -> None: ...

class Counters(_message.Message):
    __slots__ = ("admitted_groups", "committed_groups", "acked_groups", "finalized_groups", "evicted_groups", "committed_tokens", "generation_tokens", "requeued_groups", "dropped_groups", "dropped_by_reason", "dropped_tokens")
    class DroppedByReasonEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    ADMITTED_GROUPS_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_GROUPS_FIELD_NUMBER: _ClassVar[int]
    ACKED_GROUPS_FIELD_NUMBER: _ClassVar[int]
    FINALIZED_GROUPS_FIELD_NUMBER: _ClassVar[int]
    EVICTED_GROUPS_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    GENERATION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    REQUEUED_GROUPS_FIELD_NUMBER: _ClassVar[int]
    DROPPED_GROUPS_FIELD_NUMBER: _ClassVar[int]
    DROPPED_BY_REASON_FIELD_NUMBER: _ClassVar[int]
    DROPPED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    admitted_groups: int
    committed_groups: int
    acked_groups: int
    finalized_groups: int
    evicted_groups: int
    committed_tokens: int
    generation_tokens: int
    requeued_groups: int
    dropped_groups: int
    dropped_by_reason: _containers.ScalarMap[str, int]
    dropped_tokens: int
    def __init__(self, admitted_groups: _Optional[int] = ..., committed_groups: _Optional[int] = ..., acked_groups: _Optional[int] = ..., finalized_groups: _Optional[int] = ..., evicted_groups: _Optional[int] = ..., committed_tokens: _Optional[int] = ..., generation_tokens: _Optional[int] = ..., requeued_groups: _Optional[int] = ..., dropped_groups: _Optional[int] = ..., dropped_by_reason: _Optional[_Mapping[str, int]] = ..., dropped_tokens: _Optional[int] = ...) -> None: ...

class AdmissionStatus(_message.Message):
    __slots__ = ("in_flight_limit", "in_flight_reason", "in_flight_ceiling", "adaptive", "staleness_gating", "consumed_per_version", "staleness_room")
    IN_FLIGHT_LIMIT_FIELD_NUMBER: _ClassVar[int]
    IN_FLIGHT_REASON_FIELD_NUMBER: _ClassVar[int]
    IN_FLIGHT_CEILING_FIELD_NUMBER: _ClassVar[int]
    ADAPTIVE_FIELD_NUMBER: _ClassVar[int]
    STALENESS_GATING_FIELD_NUMBER: _ClassVar[int]
    CONSUMED_PER_VERSION_FIELD_NUMBER: _ClassVar[int]
    STALENESS_ROOM_FIELD_NUMBER: _ClassVar[int]
    in_flight_limit: int
    in_flight_reason: InFlightReason
    in_flight_ceiling: int
    adaptive: bool
    staleness_gating: bool
    consumed_per_version: float
    staleness_room: int
    def __init__(self, in_flight_limit: _Optional[int] = ..., in_flight_reason: _Optional[_Union[InFlightReason, str]] = ..., in_flight_ceiling: _Optional[int] = ..., adaptive: _Optional[bool] = ..., staleness_gating: _Optional[bool] = ..., consumed_per_version: _Optional[float] = ..., staleness_room: _Optional[int] = ...) -> None: ...

class SourceStatus(_message.Message):
    __slots__ = ("name", "weight", "epoch", "offset", "prompts", "exhausted", "committed_groups", "committed_tokens", "delivered_groups")
    NAME_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    PROMPTS_FIELD_NUMBER: _ClassVar[int]
    EXHAUSTED_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_GROUPS_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DELIVERED_GROUPS_FIELD_NUMBER: _ClassVar[int]
    name: str
    weight: float
    epoch: int
    offset: int
    prompts: int
    exhausted: bool
    committed_groups: int
    committed_tokens: int
    delivered_groups: int
    def __init__(self, name: _Optional[str] = ..., weight: _Optional[float] = ..., epoch: _Optional[int] = ..., offset: _Optional[int] = ..., prompts: _Optional[int] = ..., exhausted: _Optional[bool] = ..., committed_groups: _Optional[int] = ..., committed_tokens: _Optional[int] = ..., delivered_groups: _Optional[int] = ...) -> None: ...

class GetStatusResponse(_message.Message):
    __slots__ = ("state", "engine", "policy_version", "group_size", "buffer", "inflight_samples", "pending_prompts", "cursor_epoch", "cursor_offset", "dataset_exhausted", "last_checkpoint", "counters", "replica", "replicas", "sources", "submitted_committed_groups", "submitted_delivered_groups", "admission", "tokens", "engine_time")
    STATE_FIELD_NUMBER: _ClassVar[int]
    ENGINE_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    GROUP_SIZE_FIELD_NUMBER: _ClassVar[int]
    BUFFER_FIELD_NUMBER: _ClassVar[int]
    INFLIGHT_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    PENDING_PROMPTS_FIELD_NUMBER: _ClassVar[int]
    CURSOR_EPOCH_FIELD_NUMBER: _ClassVar[int]
    CURSOR_OFFSET_FIELD_NUMBER: _ClassVar[int]
    DATASET_EXHAUSTED_FIELD_NUMBER: _ClassVar[int]
    LAST_CHECKPOINT_FIELD_NUMBER: _ClassVar[int]
    COUNTERS_FIELD_NUMBER: _ClassVar[int]
    REPLICA_FIELD_NUMBER: _ClassVar[int]
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    SOURCES_FIELD_NUMBER: _ClassVar[int]
    SUBMITTED_COMMITTED_GROUPS_FIELD_NUMBER: _ClassVar[int]
    SUBMITTED_DELIVERED_GROUPS_FIELD_NUMBER: _ClassVar[int]
    ADMISSION_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    ENGINE_TIME_FIELD_NUMBER: _ClassVar[int]
    state: ServingState
    engine: str
    policy_version: int
    group_size: int
    buffer: BufferStatus
    inflight_samples: int
    pending_prompts: int
    cursor_epoch: int
    cursor_offset: int
    dataset_exhausted: bool
    last_checkpoint: CheckpointStatus
    counters: Counters
    replica: int
    replicas: int
    sources: _containers.RepeatedCompositeFieldContainer[SourceStatus]
    submitted_committed_groups: int
    submitted_delivered_groups: int
    admission: AdmissionStatus
    tokens: TokenAccount
    engine_time: EngineTime
    def __init__(self, state: _Optional[_Union[ServingState, str]] = ..., engine: _Optional[str] = ..., policy_version: _Optional[int] = ..., group_size: _Optional[int] = ..., buffer: _Optional[_Union[BufferStatus, _Mapping]] = ..., inflight_samples: _Optional[int] = ..., pending_prompts: _Optional[int] = ..., cursor_epoch: _Optional[int] = ..., cursor_offset: _Optional[int] = ..., dataset_exhausted: _Optional[bool] = ..., last_checkpoint: _Optional[_Union[CheckpointStatus, _Mapping]] = ..., counters: _Optional[_Union[Counters, _Mapping]] = ..., replica: _Optional[int] = ..., replicas: _Optional[int] = ..., sources: _Optional[_Iterable[_Union[SourceStatus, _Mapping]]] = ..., submitted_committed_groups: _Optional[int] = ..., submitted_delivered_groups: _Optional[int] = ..., admission: _Optional[_Union[AdmissionStatus, _Mapping]] = ..., tokens: _Optional[_Union[TokenAccount, _Mapping]] = ..., engine_time: _Optional[_Union[EngineTime, _Mapping]] = ...) -> None: ...

class TokenAccount(_message.Message):
    __slots__ = ("generated", "delivered", "evicted", "dropped", "regenerated", "failed", "buffered", "goodput")
    GENERATED_FIELD_NUMBER: _ClassVar[int]
    DELIVERED_FIELD_NUMBER: _ClassVar[int]
    EVICTED_FIELD_NUMBER: _ClassVar[int]
    DROPPED_FIELD_NUMBER: _ClassVar[int]
    REGENERATED_FIELD_NUMBER: _ClassVar[int]
    FAILED_FIELD_NUMBER: _ClassVar[int]
    BUFFERED_FIELD_NUMBER: _ClassVar[int]
    GOODPUT_FIELD_NUMBER: _ClassVar[int]
    generated: int
    delivered: int
    evicted: int
    dropped: int
    regenerated: int
    failed: int
    buffered: int
    goodput: float
    def __init__(self, generated: _Optional[int] = ..., delivered: _Optional[int] = ..., evicted: _Optional[int] = ..., dropped: _Optional[int] = ..., regenerated: _Optional[int] = ..., failed: _Optional[int] = ..., buffered: _Optional[int] = ..., goodput: _Optional[float] = ...) -> None: ...

class EngineTime(_message.Message):
    __slots__ = ("generating_seconds", "weight_update_seconds", "idle_no_work_seconds", "idle_buffer_full_seconds")
    GENERATING_SECONDS_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_UPDATE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    IDLE_NO_WORK_SECONDS_FIELD_NUMBER: _ClassVar[int]
    IDLE_BUFFER_FULL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    generating_seconds: float
    weight_update_seconds: float
    idle_no_work_seconds: float
    idle_buffer_full_seconds: float
    def __init__(self, generating_seconds: _Optional[float] = ..., weight_update_seconds: _Optional[float] = ..., idle_no_work_seconds: _Optional[float] = ..., idle_buffer_full_seconds: _Optional[float] = ...) -> None: ...
