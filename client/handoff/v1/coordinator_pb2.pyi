import datetime

from google.protobuf import timestamp_pb2 as _timestamp_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class HandoffOrder(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    HANDOFF_ORDER_UNSPECIFIED: _ClassVar[HandoffOrder]
    HANDOFF_ORDER_SOURCE_FIRST: _ClassVar[HandoffOrder]
    HANDOFF_ORDER_DESTINATION_FIRST: _ClassVar[HandoffOrder]

class EngineType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ENGINE_TYPE_UNSPECIFIED: _ClassVar[EngineType]
    ENGINE_TYPE_VLLM: _ClassVar[EngineType]
    ENGINE_TYPE_SGLANG: _ClassVar[EngineType]
    ENGINE_TYPE_TRTLLM: _ClassVar[EngineType]

class Role(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ROLE_UNSPECIFIED: _ClassVar[Role]
    ROLE_SOURCE: _ClassVar[Role]
    ROLE_DESTINATION: _ClassVar[Role]
    ROLE_BOTH: _ClassVar[Role]

class Phase(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PHASE_UNSPECIFIED: _ClassVar[Phase]
    PHASE_ACTIVE: _ClassVar[Phase]
    PHASE_CLEANING_UP: _ClassVar[Phase]
    PHASE_COMPLETE: _ClassVar[Phase]

class Completion(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    COMPLETION_UNSPECIFIED: _ClassVar[Completion]
    COMPLETION_SUCCESS: _ClassVar[Completion]
    COMPLETION_CANCELED: _ClassVar[Completion]

class ActionKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ACTION_KIND_UNSPECIFIED: _ClassVar[ActionKind]
    ACTION_KIND_SUBMIT_PREFILL: _ClassVar[ActionKind]
    ACTION_KIND_RESERVE_DESTINATION: _ClassVar[ActionKind]
    ACTION_KIND_START_TRANSFER: _ClassVar[ActionKind]
    ACTION_KIND_ACTIVATE_DESTINATION: _ClassVar[ActionKind]
    ACTION_KIND_RELEASE_SOURCE: _ClassVar[ActionKind]
    ACTION_KIND_CANCEL_SOURCE: _ClassVar[ActionKind]
    ACTION_KIND_CANCEL_DESTINATION: _ClassVar[ActionKind]
    ACTION_KIND_COMPLETE: _ClassVar[ActionKind]

class OutcomeKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    OUTCOME_KIND_UNSPECIFIED: _ClassVar[OutcomeKind]
    OUTCOME_KIND_SUBMITTED: _ClassVar[OutcomeKind]
    OUTCOME_KIND_ACCEPTED: _ClassVar[OutcomeKind]
    OUTCOME_KIND_SCHEDULED: _ClassVar[OutcomeKind]
    OUTCOME_KIND_APPLIED: _ClassVar[OutcomeKind]
    OUTCOME_KIND_NOOP: _ClassVar[OutcomeKind]
    OUTCOME_KIND_FAILED: _ClassVar[OutcomeKind]

class TransferTimingMode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TRANSFER_TIMING_MODE_UNSPECIFIED: _ClassVar[TransferTimingMode]
    TRANSFER_TIMING_MODE_FULL_PROMPT: _ClassVar[TransferTimingMode]
    TRANSFER_TIMING_MODE_DESTINATION_MISSING: _ClassVar[TransferTimingMode]

class LifecycleEventKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    LIFECYCLE_EVENT_KIND_UNSPECIFIED: _ClassVar[LifecycleEventKind]
    LIFECYCLE_EVENT_KIND_SOURCE_HELD: _ClassVar[LifecycleEventKind]
    LIFECYCLE_EVENT_KIND_DESTINATION_ACCEPTED: _ClassVar[LifecycleEventKind]
    LIFECYCLE_EVENT_KIND_DESTINATION_RESERVED: _ClassVar[LifecycleEventKind]
    LIFECYCLE_EVENT_KIND_DESTINATION_ACTIVATED: _ClassVar[LifecycleEventKind]
    LIFECYCLE_EVENT_KIND_SOURCE_RELEASED: _ClassVar[LifecycleEventKind]
    LIFECYCLE_EVENT_KIND_COMPLETED: _ClassVar[LifecycleEventKind]
HANDOFF_ORDER_UNSPECIFIED: HandoffOrder
HANDOFF_ORDER_SOURCE_FIRST: HandoffOrder
HANDOFF_ORDER_DESTINATION_FIRST: HandoffOrder
ENGINE_TYPE_UNSPECIFIED: EngineType
ENGINE_TYPE_VLLM: EngineType
ENGINE_TYPE_SGLANG: EngineType
ENGINE_TYPE_TRTLLM: EngineType
ROLE_UNSPECIFIED: Role
ROLE_SOURCE: Role
ROLE_DESTINATION: Role
ROLE_BOTH: Role
PHASE_UNSPECIFIED: Phase
PHASE_ACTIVE: Phase
PHASE_CLEANING_UP: Phase
PHASE_COMPLETE: Phase
COMPLETION_UNSPECIFIED: Completion
COMPLETION_SUCCESS: Completion
COMPLETION_CANCELED: Completion
ACTION_KIND_UNSPECIFIED: ActionKind
ACTION_KIND_SUBMIT_PREFILL: ActionKind
ACTION_KIND_RESERVE_DESTINATION: ActionKind
ACTION_KIND_START_TRANSFER: ActionKind
ACTION_KIND_ACTIVATE_DESTINATION: ActionKind
ACTION_KIND_RELEASE_SOURCE: ActionKind
ACTION_KIND_CANCEL_SOURCE: ActionKind
ACTION_KIND_CANCEL_DESTINATION: ActionKind
ACTION_KIND_COMPLETE: ActionKind
OUTCOME_KIND_UNSPECIFIED: OutcomeKind
OUTCOME_KIND_SUBMITTED: OutcomeKind
OUTCOME_KIND_ACCEPTED: OutcomeKind
OUTCOME_KIND_SCHEDULED: OutcomeKind
OUTCOME_KIND_APPLIED: OutcomeKind
OUTCOME_KIND_NOOP: OutcomeKind
OUTCOME_KIND_FAILED: OutcomeKind
TRANSFER_TIMING_MODE_UNSPECIFIED: TransferTimingMode
TRANSFER_TIMING_MODE_FULL_PROMPT: TransferTimingMode
TRANSFER_TIMING_MODE_DESTINATION_MISSING: TransferTimingMode
LIFECYCLE_EVENT_KIND_UNSPECIFIED: LifecycleEventKind
LIFECYCLE_EVENT_KIND_SOURCE_HELD: LifecycleEventKind
LIFECYCLE_EVENT_KIND_DESTINATION_ACCEPTED: LifecycleEventKind
LIFECYCLE_EVENT_KIND_DESTINATION_RESERVED: LifecycleEventKind
LIFECYCLE_EVENT_KIND_DESTINATION_ACTIVATED: LifecycleEventKind
LIFECYCLE_EVENT_KIND_SOURCE_RELEASED: LifecycleEventKind
LIFECYCLE_EVENT_KIND_COMPLETED: LifecycleEventKind

class TransferTiming(_message.Message):
    __slots__ = ("mode", "full_prompt_tokens", "kv_bytes_per_token", "bandwidth_gb_s", "state_bytes")
    MODE_FIELD_NUMBER: _ClassVar[int]
    FULL_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    KV_BYTES_PER_TOKEN_FIELD_NUMBER: _ClassVar[int]
    BANDWIDTH_GB_S_FIELD_NUMBER: _ClassVar[int]
    STATE_BYTES_FIELD_NUMBER: _ClassVar[int]
    mode: TransferTimingMode
    full_prompt_tokens: int
    kv_bytes_per_token: int
    bandwidth_gb_s: float
    state_bytes: int
    def __init__(self, mode: _Optional[_Union[TransferTimingMode, str]] = ..., full_prompt_tokens: _Optional[int] = ..., kv_bytes_per_token: _Optional[int] = ..., bandwidth_gb_s: _Optional[float] = ..., state_bytes: _Optional[int] = ...) -> None: ...

class SourceHeld(_message.Message):
    __slots__ = ("transfer_timing",)
    TRANSFER_TIMING_FIELD_NUMBER: _ClassVar[int]
    transfer_timing: TransferTiming
    def __init__(self, transfer_timing: _Optional[_Union[TransferTiming, _Mapping]] = ...) -> None: ...

class DestinationReserved(_message.Message):
    __slots__ = ("transferable_prompt_tokens",)
    TRANSFERABLE_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    transferable_prompt_tokens: int
    def __init__(self, transferable_prompt_tokens: _Optional[int] = ...) -> None: ...

class TransferCompleted(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class Failed(_message.Message):
    __slots__ = ("reason",)
    REASON_FIELD_NUMBER: _ClassVar[int]
    reason: str
    def __init__(self, reason: _Optional[str] = ...) -> None: ...

class TimedOut(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class Canceled(_message.Message):
    __slots__ = ("reason",)
    REASON_FIELD_NUMBER: _ClassVar[int]
    reason: str
    def __init__(self, reason: _Optional[str] = ...) -> None: ...

class Fact(_message.Message):
    __slots__ = ("source_held", "destination_reserved", "transfer_completed", "failed", "timed_out", "canceled")
    SOURCE_HELD_FIELD_NUMBER: _ClassVar[int]
    DESTINATION_RESERVED_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_COMPLETED_FIELD_NUMBER: _ClassVar[int]
    FAILED_FIELD_NUMBER: _ClassVar[int]
    TIMED_OUT_FIELD_NUMBER: _ClassVar[int]
    CANCELED_FIELD_NUMBER: _ClassVar[int]
    source_held: SourceHeld
    destination_reserved: DestinationReserved
    transfer_completed: TransferCompleted
    failed: Failed
    timed_out: TimedOut
    canceled: Canceled
    def __init__(self, source_held: _Optional[_Union[SourceHeld, _Mapping]] = ..., destination_reserved: _Optional[_Union[DestinationReserved, _Mapping]] = ..., transfer_completed: _Optional[_Union[TransferCompleted, _Mapping]] = ..., failed: _Optional[_Union[Failed, _Mapping]] = ..., timed_out: _Optional[_Union[TimedOut, _Mapping]] = ..., canceled: _Optional[_Union[Canceled, _Mapping]] = ...) -> None: ...

class Outcome(_message.Message):
    __slots__ = ("kind", "reason")
    KIND_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    kind: OutcomeKind
    reason: str
    def __init__(self, kind: _Optional[_Union[OutcomeKind, str]] = ..., reason: _Optional[str] = ...) -> None: ...

class Action(_message.Message):
    __slots__ = ("handoff_id", "id", "kind", "delay_ms", "target", "attempt", "engine_id")
    HANDOFF_ID_FIELD_NUMBER: _ClassVar[int]
    ID_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    DELAY_MS_FIELD_NUMBER: _ClassVar[int]
    TARGET_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    handoff_id: str
    id: int
    kind: ActionKind
    delay_ms: float
    target: Role
    attempt: int
    engine_id: str
    def __init__(self, handoff_id: _Optional[str] = ..., id: _Optional[int] = ..., kind: _Optional[_Union[ActionKind, str]] = ..., delay_ms: _Optional[float] = ..., target: _Optional[_Union[Role, str]] = ..., attempt: _Optional[int] = ..., engine_id: _Optional[str] = ...) -> None: ...

class LifecycleEvent(_message.Message):
    __slots__ = ("kind", "at")
    KIND_FIELD_NUMBER: _ClassVar[int]
    AT_FIELD_NUMBER: _ClassVar[int]
    kind: LifecycleEventKind
    at: _timestamp_pb2.Timestamp
    def __init__(self, kind: _Optional[_Union[LifecycleEventKind, str]] = ..., at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ...) -> None: ...

class Handoff(_message.Message):
    __slots__ = ("handoff_id", "order", "phase", "completion", "source_engine_id", "destination_engine_id", "transfer_executor", "outstanding_actions", "lifecycle", "deadline", "started_at", "completed_at", "fallback_transfer_delay_ms")
    HANDOFF_ID_FIELD_NUMBER: _ClassVar[int]
    ORDER_FIELD_NUMBER: _ClassVar[int]
    PHASE_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_FIELD_NUMBER: _ClassVar[int]
    SOURCE_ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    DESTINATION_ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_EXECUTOR_FIELD_NUMBER: _ClassVar[int]
    OUTSTANDING_ACTIONS_FIELD_NUMBER: _ClassVar[int]
    LIFECYCLE_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_FIELD_NUMBER: _ClassVar[int]
    STARTED_AT_FIELD_NUMBER: _ClassVar[int]
    COMPLETED_AT_FIELD_NUMBER: _ClassVar[int]
    FALLBACK_TRANSFER_DELAY_MS_FIELD_NUMBER: _ClassVar[int]
    handoff_id: str
    order: HandoffOrder
    phase: Phase
    completion: Completion
    source_engine_id: str
    destination_engine_id: str
    transfer_executor: Role
    outstanding_actions: _containers.RepeatedCompositeFieldContainer[Action]
    lifecycle: _containers.RepeatedCompositeFieldContainer[LifecycleEvent]
    deadline: _timestamp_pb2.Timestamp
    started_at: _timestamp_pb2.Timestamp
    completed_at: _timestamp_pb2.Timestamp
    fallback_transfer_delay_ms: float
    def __init__(self, handoff_id: _Optional[str] = ..., order: _Optional[_Union[HandoffOrder, str]] = ..., phase: _Optional[_Union[Phase, str]] = ..., completion: _Optional[_Union[Completion, str]] = ..., source_engine_id: _Optional[str] = ..., destination_engine_id: _Optional[str] = ..., transfer_executor: _Optional[_Union[Role, str]] = ..., outstanding_actions: _Optional[_Iterable[_Union[Action, _Mapping]]] = ..., lifecycle: _Optional[_Iterable[_Union[LifecycleEvent, _Mapping]]] = ..., deadline: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., started_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., completed_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., fallback_transfer_delay_ms: _Optional[float] = ...) -> None: ...

class StartHandoffRequest(_message.Message):
    __slots__ = ("handoff_id", "order", "engine_type", "source_engine_id", "destination_engine_id", "fallback_transfer_delay_ms", "transfer_executor", "timeout_s")
    HANDOFF_ID_FIELD_NUMBER: _ClassVar[int]
    ORDER_FIELD_NUMBER: _ClassVar[int]
    ENGINE_TYPE_FIELD_NUMBER: _ClassVar[int]
    SOURCE_ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    DESTINATION_ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    FALLBACK_TRANSFER_DELAY_MS_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_EXECUTOR_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    handoff_id: str
    order: HandoffOrder
    engine_type: EngineType
    source_engine_id: str
    destination_engine_id: str
    fallback_transfer_delay_ms: float
    transfer_executor: Role
    timeout_s: float
    def __init__(self, handoff_id: _Optional[str] = ..., order: _Optional[_Union[HandoffOrder, str]] = ..., engine_type: _Optional[_Union[EngineType, str]] = ..., source_engine_id: _Optional[str] = ..., destination_engine_id: _Optional[str] = ..., fallback_transfer_delay_ms: _Optional[float] = ..., transfer_executor: _Optional[_Union[Role, str]] = ..., timeout_s: _Optional[float] = ...) -> None: ...

class StartHandoffResponse(_message.Message):
    __slots__ = ("handoff", "actions")
    HANDOFF_FIELD_NUMBER: _ClassVar[int]
    ACTIONS_FIELD_NUMBER: _ClassVar[int]
    handoff: Handoff
    actions: _containers.RepeatedCompositeFieldContainer[Action]
    def __init__(self, handoff: _Optional[_Union[Handoff, _Mapping]] = ..., actions: _Optional[_Iterable[_Union[Action, _Mapping]]] = ...) -> None: ...

class ReportFactRequest(_message.Message):
    __slots__ = ("handoff_id", "fact")
    HANDOFF_ID_FIELD_NUMBER: _ClassVar[int]
    FACT_FIELD_NUMBER: _ClassVar[int]
    handoff_id: str
    fact: Fact
    def __init__(self, handoff_id: _Optional[str] = ..., fact: _Optional[_Union[Fact, _Mapping]] = ...) -> None: ...

class ReportFactResponse(_message.Message):
    __slots__ = ("handoff", "actions")
    HANDOFF_FIELD_NUMBER: _ClassVar[int]
    ACTIONS_FIELD_NUMBER: _ClassVar[int]
    handoff: Handoff
    actions: _containers.RepeatedCompositeFieldContainer[Action]
    def __init__(self, handoff: _Optional[_Union[Handoff, _Mapping]] = ..., actions: _Optional[_Iterable[_Union[Action, _Mapping]]] = ...) -> None: ...

class ReportOutcomeRequest(_message.Message):
    __slots__ = ("handoff_id", "action_id", "outcome")
    HANDOFF_ID_FIELD_NUMBER: _ClassVar[int]
    ACTION_ID_FIELD_NUMBER: _ClassVar[int]
    OUTCOME_FIELD_NUMBER: _ClassVar[int]
    handoff_id: str
    action_id: int
    outcome: Outcome
    def __init__(self, handoff_id: _Optional[str] = ..., action_id: _Optional[int] = ..., outcome: _Optional[_Union[Outcome, _Mapping]] = ...) -> None: ...

class ReportOutcomeResponse(_message.Message):
    __slots__ = ("handoff", "actions")
    HANDOFF_FIELD_NUMBER: _ClassVar[int]
    ACTIONS_FIELD_NUMBER: _ClassVar[int]
    handoff: Handoff
    actions: _containers.RepeatedCompositeFieldContainer[Action]
    def __init__(self, handoff: _Optional[_Union[Handoff, _Mapping]] = ..., actions: _Optional[_Iterable[_Union[Action, _Mapping]]] = ...) -> None: ...

class StreamActionsRequest(_message.Message):
    __slots__ = ("engine_id",)
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    def __init__(self, engine_id: _Optional[str] = ...) -> None: ...

class GetHandoffRequest(_message.Message):
    __slots__ = ("handoff_id",)
    HANDOFF_ID_FIELD_NUMBER: _ClassVar[int]
    handoff_id: str
    def __init__(self, handoff_id: _Optional[str] = ...) -> None: ...

class GetHandoffResponse(_message.Message):
    __slots__ = ("handoff",)
    HANDOFF_FIELD_NUMBER: _ClassVar[int]
    handoff: Handoff
    def __init__(self, handoff: _Optional[_Union[Handoff, _Mapping]] = ...) -> None: ...

class ConnectHello(_message.Message):
    __slots__ = ("engine_id",)
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    def __init__(self, engine_id: _Optional[str] = ...) -> None: ...

class ConnectRequest(_message.Message):
    __slots__ = ("request_id", "hello", "fact", "outcome")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    HELLO_FIELD_NUMBER: _ClassVar[int]
    FACT_FIELD_NUMBER: _ClassVar[int]
    OUTCOME_FIELD_NUMBER: _ClassVar[int]
    request_id: int
    hello: ConnectHello
    fact: ReportFactRequest
    outcome: ReportOutcomeRequest
    def __init__(self, request_id: _Optional[int] = ..., hello: _Optional[_Union[ConnectHello, _Mapping]] = ..., fact: _Optional[_Union[ReportFactRequest, _Mapping]] = ..., outcome: _Optional[_Union[ReportOutcomeRequest, _Mapping]] = ...) -> None: ...

class ConnectAck(_message.Message):
    __slots__ = ("request_id", "code", "message", "actions", "handoff")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    ACTIONS_FIELD_NUMBER: _ClassVar[int]
    HANDOFF_FIELD_NUMBER: _ClassVar[int]
    request_id: int
    code: int
    message: str
    actions: _containers.RepeatedCompositeFieldContainer[Action]
    handoff: Handoff
    def __init__(self, request_id: _Optional[int] = ..., code: _Optional[int] = ..., message: _Optional[str] = ..., actions: _Optional[_Iterable[_Union[Action, _Mapping]]] = ..., handoff: _Optional[_Union[Handoff, _Mapping]] = ...) -> None: ...

class ConnectResponse(_message.Message):
    __slots__ = ("action", "ack")
    ACTION_FIELD_NUMBER: _ClassVar[int]
    ACK_FIELD_NUMBER: _ClassVar[int]
    action: Action
    ack: ConnectAck
    def __init__(self, action: _Optional[_Union[Action, _Mapping]] = ..., ack: _Optional[_Union[ConnectAck, _Mapping]] = ...) -> None: ...
