"""The SDK's vocabulary: plain enums and frozen values, so callers never touch protobuf.

Enum values are the proto enum numbers, which makes conversion a lookup; the
``*_UNSPECIFIED`` numbers have no member because the server never sends them
(an unset completion becomes ``None``).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from datetime import datetime


class Order(enum.Enum):
    SOURCE_FIRST = 1  # vLLM, TensorRT-LLM: prefill holds, decode pulls.
    DESTINATION_FIRST = 2  # SGLang: decode reserves, prefill writes.


class EngineType(enum.Enum):
    VLLM = 1
    SGLANG = 2
    TRTLLM = 3


class Role(enum.Enum):
    SOURCE = 1
    DESTINATION = 2
    BOTH = 3  # only for COMPLETE, a notice to both engines


class Phase(enum.Enum):
    ACTIVE = 1
    CLEANING_UP = 2
    COMPLETE = 3


class Completion(enum.Enum):
    SUCCESS = 1
    CANCELED = 2


class ActionKind(enum.Enum):
    SUBMIT_PREFILL = 1
    RESERVE_DESTINATION = 2
    START_TRANSFER = 3
    ACTIVATE_DESTINATION = 4
    RELEASE_SOURCE = 5
    CANCEL_SOURCE = 6
    CANCEL_DESTINATION = 7
    COMPLETE = 8


class OutcomeKind(enum.Enum):
    SUBMITTED = 1
    ACCEPTED = 2
    SCHEDULED = 3
    APPLIED = 4
    NOOP = 5
    FAILED = 6


class TimingMode(enum.Enum):
    FULL_PROMPT = 1
    DESTINATION_MISSING = 2


class LifecycleEventKind(enum.Enum):
    SOURCE_HELD = 1
    DESTINATION_ACCEPTED = 2
    DESTINATION_RESERVED = 3
    DESTINATION_ACTIVATED = 4
    SOURCE_RELEASED = 5
    COMPLETED = 6


# Cleanup actions free memory. The server refuses a FAILED outcome for them:
# an engine that cannot free now must leave the action unacknowledged, and the
# server redelivers it until it can.
CLEANUP_KINDS = frozenset(
    {ActionKind.RELEASE_SOURCE, ActionKind.CANCEL_SOURCE, ActionKind.CANCEL_DESTINATION}
)

# What each action may come to, besides FAILED for the non-cleanup ones.
EXPECTED_OUTCOMES: dict[ActionKind, frozenset[OutcomeKind]] = {
    ActionKind.SUBMIT_PREFILL: frozenset({OutcomeKind.SUBMITTED}),
    ActionKind.RESERVE_DESTINATION: frozenset({OutcomeKind.ACCEPTED}),
    ActionKind.START_TRANSFER: frozenset({OutcomeKind.SCHEDULED}),
    ActionKind.ACTIVATE_DESTINATION: frozenset({OutcomeKind.APPLIED}),
    ActionKind.RELEASE_SOURCE: frozenset({OutcomeKind.APPLIED, OutcomeKind.NOOP}),
    ActionKind.CANCEL_SOURCE: frozenset({OutcomeKind.APPLIED, OutcomeKind.NOOP}),
    ActionKind.CANCEL_DESTINATION: frozenset({OutcomeKind.APPLIED, OutcomeKind.NOOP}),
    ActionKind.COMPLETE: frozenset(),
}


def outcome_allowed(kind: ActionKind, outcome: Outcome) -> bool:
    """Whether the server will accept ``outcome`` for an action of ``kind``."""
    if outcome.kind is OutcomeKind.FAILED:
        return kind not in CLEANUP_KINDS and kind is not ActionKind.COMPLETE
    return outcome.kind in EXPECTED_OUTCOMES[kind]


@dataclass(frozen=True, slots=True)
class Outcome:
    """What executing an action came to. ``reason`` is required for FAILED only."""

    kind: OutcomeKind
    reason: str = ""

    def __post_init__(self) -> None:
        if (self.kind is OutcomeKind.FAILED) != bool(self.reason):
            raise ValueError("an outcome has a reason if and only if it is FAILED")

    @classmethod
    def failed(cls, reason: str) -> Outcome:
        return cls(OutcomeKind.FAILED, reason)


@dataclass(frozen=True, slots=True)
class TransferTiming:
    """How the source sizes the KV transfer; see DESIGN.md §1 for the delay formula."""

    mode: TimingMode
    full_prompt_tokens: int
    kv_bytes_per_token: int | None = None
    bandwidth_gb_s: float | None = None
    state_bytes: int = 0


@dataclass(frozen=True, slots=True)
class SourceHeld:
    transfer_timing: TransferTiming


@dataclass(frozen=True, slots=True)
class DestinationReserved:
    transferable_prompt_tokens: int


@dataclass(frozen=True, slots=True)
class TransferCompleted:
    pass


@dataclass(frozen=True, slots=True)
class Failed:
    reason: str


@dataclass(frozen=True, slots=True)
class TimedOut:
    pass


@dataclass(frozen=True, slots=True)
class Canceled:
    reason: str


Fact = SourceHeld | DestinationReserved | TransferCompleted | Failed | TimedOut | Canceled


@dataclass(frozen=True, slots=True)
class Action:
    """One instruction to one engine."""

    handoff_id: str
    id: int  # per handoff, 0, 1, 2, ... in issue order
    kind: ActionKind
    target: Role
    engine_id: str  # empty in an RPC answer for a COMPLETE sent to both engines
    attempt: int  # delivery attempt on a stream, from 1; 0 in RPC answers
    delay_ms: float = 0.0  # START_TRANSFER only: how long the transfer should take
    traceparent: str = ""  # W3C trace context of the coordinator's span for it, if traced
    tracestate: str = ""


@dataclass(frozen=True, slots=True)
class LifecycleEvent:
    kind: LifecycleEventKind
    at: datetime


@dataclass(frozen=True, slots=True)
class Handoff:
    """The observable state of one handoff, as the server last reported it."""

    handoff_id: str
    order: Order
    phase: Phase
    completion: Completion | None
    source_engine_id: str
    destination_engine_id: str
    transfer_executor: Role
    outstanding_actions: tuple[Action, ...]
    lifecycle: tuple[LifecycleEvent, ...]
    deadline: datetime | None
    started_at: datetime | None
    completed_at: datetime | None
    fallback_transfer_delay_ms: float

    def first(self, kind: LifecycleEventKind) -> datetime | None:
        """When ``kind`` first happened (a reopened handoff completes twice)."""
        return next((event.at for event in self.lifecycle if event.kind is kind), None)


@dataclass(frozen=True, slots=True)
class HandoffUpdate:
    """The answer to a call that changes a handoff: its new state and the actions it caused."""

    handoff: Handoff
    actions: tuple[Action, ...]
