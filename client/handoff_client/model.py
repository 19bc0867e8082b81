"""The SDK's vocabulary: plain enums and frozen values, so callers never touch protobuf.

Enum values are the proto enum numbers, which makes conversion a lookup; the
``*_UNSPECIFIED`` numbers have no member because the server never sends them
(an unset completion becomes ``None``), except :attr:`ActionKind.UNKNOWN`,
which stands for any action kind this SDK does not know (a newer server).
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
    UNKNOWN = 0  # a kind a newer server sends and this SDK cannot execute
    SUBMIT_PREFILL = 1
    RESERVE_DESTINATION = 2
    START_TRANSFER = 3
    ACTIVATE_DESTINATION = 4
    RELEASE_SOURCE = 5
    CANCEL_SOURCE = 6
    CANCEL_DESTINATION = 7
    COMPLETE = 8


class Origin(enum.Enum):
    """Who made an action: the coordinator, or the sidecar freeing a side on its own.

    Only the coordinator's actions have a real action id (and de-duplicate
    by (handoff id, action id)); a free the sidecar makes up has id
    :data:`MADE_UP_ACTION_ID` and says why it runs.
    """

    COORDINATOR = 0  # sent by the coordinator
    COMPLETE = 1  # a COMPLETE notice for what no cleanup action will free
    LEASE = 2  # the lease ran out with the coordinator silent
    RECONCILE = 3  # the coordinator does not expect the side held (or answered NOT_FOUND)
    FENCED = 4  # a newer incarnation of the engine subscribed
    STOP = 5  # the sidecar stopped for good (``stop(free_held=True)``)
    LATE = 6  # a handler that ignored its cancellation took something after the side was freed


# The id of every action the sidecar makes up: no action of any handoff has it.
MADE_UP_ACTION_ID = -1


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
    SOURCE_LOST = 7  # EngineLost{source} was first applied
    DESTINATION_LOST = 8  # EngineLost{destination} was first applied


# Cleanup actions free memory. The server refuses a FAILED outcome for them:
# an engine that cannot free now must leave the action unacknowledged, and the
# server redelivers it until it can.
CLEANUP_KINDS = frozenset(
    {ActionKind.RELEASE_SOURCE, ActionKind.CANCEL_SOURCE, ActionKind.CANCEL_DESTINATION}
)

# Actions that make an engine take something (blocks, a reservation, a
# transfer, a running decode) for a handoff.
ACQUIRING_KINDS = frozenset(
    {
        ActionKind.SUBMIT_PREFILL,
        ActionKind.RESERVE_DESTINATION,
        ActionKind.START_TRANSFER,
        ActionKind.ACTIVATE_DESTINATION,
    }
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
    ActionKind.UNKNOWN: frozenset(),
}


def outcome_allowed(kind: ActionKind, outcome: Outcome) -> bool:
    """Whether the server will accept ``outcome`` for an action of ``kind``."""
    if outcome.kind is OutcomeKind.FAILED:
        return kind in ACQUIRING_KINDS
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


# The outcomes a handler returns, ready-made; FAILED is ``failed(reason)``.
SUBMITTED = Outcome(OutcomeKind.SUBMITTED)  # SubmitPrefill: the prefill is running
ACCEPTED = Outcome(OutcomeKind.ACCEPTED)  # ReserveDestination: the reservation is under way
SCHEDULED = Outcome(OutcomeKind.SCHEDULED)  # StartTransfer: the transfer is under way
APPLIED = Outcome(OutcomeKind.APPLIED)  # ActivateDestination, or a cleanup that freed something
NOOP = Outcome(OutcomeKind.NOOP)  # a cleanup that found nothing to free


def failed(reason: str) -> Outcome:
    """FAILED with ``reason`` (for the acquiring actions only: a cleanup may not fail)."""
    return Outcome.failed(reason)


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


@dataclass(frozen=True, slots=True)
class EngineLost:
    """The engine of ``role`` lost its memory for the handoff (the frontend may report it,
    say when Kubernetes reports the pod dead); nothing is owed to it any more."""

    role: Role


Fact = (
    SourceHeld | DestinationReserved | TransferCompleted | Failed | TimedOut | Canceled | EngineLost
)


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
    completion: Completion | None = None  # COMPLETE only: how the handoff ended
    traceparent: str = ""  # W3C trace context of the coordinator's span for it, if traced
    tracestate: str = ""
    # COORDINATOR for every action the server sent; else a free the sidecar made
    # up (id MADE_UP_ACTION_ID, attempt 0), which rule 1's de-duplication skips.
    origin: Origin = Origin.COORDINATOR
    # COMPLETE only: why the handoff ended; None from an older server.
    end_reason: EndReason | None = None


class EndCause(enum.Enum):
    """Why a handoff ended (one per completion); UNSPECIFIED from an older server
    or journal, or a cause this SDK does not know."""

    UNSPECIFIED = 0
    SUCCEEDED = 1
    FRONTEND_CANCELED = 2
    DEADLINE = 3
    ENGINE_LOST = 4
    ACTION_FAILED = 5
    FAILED = 6
    DRAIN = 7


class LostCause(enum.Enum):
    """Why an engine was lost: REPORTED unless the server found it itself."""

    REPORTED = 0
    UNREACHABLE = 1
    RESTARTED = 2
    RECONCILED = 3


@dataclass(frozen=True, slots=True)
class EndReason:
    """Why one completion happened: which engine and action, and the reason text."""

    cause: EndCause
    role: Role | None = None  # ENGINE_LOST, ACTION_FAILED
    engine_id: str = ""
    lost_cause: LostCause | None = None  # ENGINE_LOST only
    action: ActionKind | None = None  # ACTION_FAILED only
    detail: str = ""  # the engine's or the frontend's reason

    def describe(self) -> str:
        """One line, as ``handoff inspect`` prints it."""
        parts = [self.cause.name.lower()]
        if self.cause is EndCause.ENGINE_LOST:
            why = (self.lost_cause or LostCause.REPORTED).name.lower()
            role = self.role.name.lower() if self.role else "?"
            parts.append(f"{role} {self.engine_id} ({why})")
        elif self.action is not None:
            parts.append(f"{self.action.name.lower()} on {self.engine_id}")
        if self.detail:
            parts.append(repr(self.detail))
        return parts[0] + (": " + " ".join(parts[1:]) if parts[1:] else "")


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
    # Abandoned while cleaning up: outstanding_actions is what was left unacknowledged.
    abandoned: bool = False
    # Why it ended, one per completion (a reopened handoff has two), newest last.
    end_reasons: tuple[EndReason, ...] = ()

    def first(self, kind: LifecycleEventKind) -> datetime | None:
        """When ``kind`` first happened (a reopened handoff completes twice)."""
        return next((event.at for event in self.lifecycle if event.kind is kind), None)


@dataclass(frozen=True, slots=True)
class HandoffUpdate:
    """The answer to a call that changes a handoff: its new state and the actions it caused."""

    handoff: Handoff
    actions: tuple[Action, ...]
    # StartHandoff only: the id was already started with the same parameters
    # (a retry); ``handoff`` is its current state and ``actions`` is empty.
    already_started: bool = False


class ReleaseReason(enum.Enum):
    """Why the coordinator told an engine to free a side it holds (Reconcile)."""

    UNSPECIFIED = 0  # a reason this SDK does not know (a newer server)
    UNKNOWN_HANDOFF = 1  # never started there, or forgotten (a coordinator without a journal)
    CANCELED = 2  # completed CANCELED
    SUCCEEDED_AS_SOURCE = 3  # completed SUCCESS: the source is done
    ENGINE_LOST = 4  # the engine was declared lost in it


@dataclass(frozen=True, slots=True)
class Release:
    """A held side the engine should free now, through its own cancel handler."""

    handoff_id: str
    role: Role
    reason: ReleaseReason


@dataclass(frozen=True, slots=True)
class Reconciled:
    """The coordinator's answer to a reconcile: what to free, and how many of the
    sides freed on their own it reported as EngineLost."""

    releases: tuple[Release, ...]
    lost_applied: int
