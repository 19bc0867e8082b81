"""The vocabulary of a handoff: roles, orders, facts, actions, outcomes, releases, errors.

Every layer takes its words from here and nowhere else: the core, the
registry, metrics labels, journal records, the protobuf conversion and the
authorization rules. Everything here is an immutable value; the transitions
between them live in :mod:`handoff_server.domain.core`.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass
from typing import ClassVar, NamedTuple


class Word(enum.Enum):
    """A word of the vocabulary, hashed as the one object it is: Enum's own
    ``__hash__`` is a Python call on every dict lookup, a hundred per
    handoff (bench/RESULTS.md, "Issue 26: enum members hashed by identity")."""

    __hash__ = object.__hash__


class Order(Word):
    """Which side of the handoff moves first."""

    SOURCE_FIRST = "source_first"  # vLLM, TensorRT-LLM: prefill holds, decode pulls.
    DESTINATION_FIRST = "destination_first"  # SGLang: decode reserves, prefill writes.


class Phase(Word):
    ACTIVE = "active"
    CLEANING_UP = "cleaning_up"
    COMPLETE = "complete"


class Completion(Word):
    SUCCESS = "success"
    CANCELED = "canceled"


class Role(Word):
    """An engine's part in a handoff: the prefill (source) or the decode (destination).

    BOTH only addresses an action: Complete is a notice to both engines.
    """

    SOURCE = "source"
    DESTINATION = "destination"
    BOTH = "both"


SIDES = (Role.SOURCE, Role.DESTINATION)


class ActionKind(Word):
    SUBMIT_PREFILL = "submit_prefill"
    RESERVE_DESTINATION = "reserve_destination"
    START_TRANSFER = "start_transfer"
    ACTIVATE_DESTINATION = "activate_destination"
    RELEASE_SOURCE = "release_source"
    CANCEL_SOURCE = "cancel_source"
    CANCEL_DESTINATION = "cancel_destination"
    COMPLETE = "complete"


class OutcomeKind(Word):
    SUBMITTED = "submitted"
    ACCEPTED = "accepted"
    SCHEDULED = "scheduled"
    APPLIED = "applied"
    NOOP = "noop"
    FAILED = "failed"


class TimingMode(Word):
    FULL_PROMPT = "full_prompt"
    DESTINATION_MISSING = "destination_missing"


class LifecycleEvent(Word):
    """The normalized lifecycle: what a caller can prove happened, in order."""

    SOURCE_HELD = "source_held"
    DESTINATION_ACCEPTED = "destination_accepted"
    DESTINATION_RESERVED = "destination_reserved"
    DESTINATION_ACTIVATED = "destination_activated"
    SOURCE_RELEASED = "source_released"
    COMPLETED = "completed"
    SOURCE_LOST = "source_lost"
    DESTINATION_LOST = "destination_lost"


LOST_EVENT = {
    Role.SOURCE: LifecycleEvent.SOURCE_LOST,
    Role.DESTINATION: LifecycleEvent.DESTINATION_LOST,
}


class LostCause(Word):
    """Why the server declared an engine lost in its unfinished handoffs."""

    RESTARTED = "restarted"  # a new incarnation subscribed
    UNREACHABLE = "unreachable"  # no live stream for delivery_timeout
    RECONCILED = "reconciled"  # its sidecar freed the side on its own (lease, orphan)


class EndCause(Word):
    """Why a handoff went into cleanup (or succeeded): one per completion.

    Bounded, so it labels handoff_cancellations_total; the detail beside it
    (EndReason) says which engine, action and text.
    """

    UNSPECIFIED = "unspecified"  # recovered from a journal older than reasons
    SUCCEEDED = "succeeded"
    FRONTEND_CANCELED = "frontend_canceled"  # the caller's CancelHandoff
    DEADLINE = "deadline"  # the handoff's timeout passed
    ENGINE_LOST = "engine_lost"  # an engine's memory for it is gone
    ACTION_FAILED = "action_failed"  # an engine answered an action Failed
    FAILED = "failed"  # a Failed fact (an engine's or the frontend's)
    DRAIN = "drain"  # the server shut down while it was active


@dataclass(frozen=True, slots=True)
class EndReason:
    """Why one completion happened, as GetHandoff and the COMPLETE notice say it."""

    cause: EndCause
    role: Role | None = None  # ENGINE_LOST, ACTION_FAILED: whose side
    engine_id: str = ""  # ENGINE_LOST, ACTION_FAILED
    lost_cause: LostCause | None = None  # ENGINE_LOST: None when the engine reported it
    action: ActionKind | None = None  # ACTION_FAILED
    detail: str = ""  # the engine's or the caller's reason text

    def describe(self) -> str:
        """One line for logs and ``handoff inspect``."""
        parts = [self.cause.value]
        if self.cause is EndCause.ENGINE_LOST:
            why = self.lost_cause.value if self.lost_cause is not None else "reported"
            parts.append(f"{self.role.value if self.role else '?'} {self.engine_id} ({why})")
        elif self.action is not None:
            parts.append(f"{self.action.value} on {self.engine_id}")
        if self.detail:
            parts.append(repr(self.detail))
        return parts[0] + (": " + " ".join(parts[1:]) if parts[1:] else "")


UNSPECIFIED_END = EndReason(EndCause.UNSPECIFIED)
SUCCEEDED_END = EndReason(EndCause.SUCCEEDED)


class ReleaseReason(Word):
    """Why an engine should free a side it holds (Reconcile)."""

    UNKNOWN_HANDOFF = "unknown_handoff"  # never started here, forgotten, or not its side
    CANCELED = "canceled"  # completed CANCELED: nothing is owed to anyone
    SUCCEEDED_AS_SOURCE = "succeeded_as_source"  # completed SUCCESS: the source is done
    ENGINE_LOST = "engine_lost"  # this engine was declared lost in it


class Release(NamedTuple):
    """A side an engine should free, and why."""

    handoff_id: str
    role: Role
    reason: ReleaseReason


# Who executes each action; START_TRANSFER goes to the handoff's executor instead.
ROLE_OF: dict[ActionKind, Role] = {
    ActionKind.SUBMIT_PREFILL: Role.SOURCE,
    ActionKind.RELEASE_SOURCE: Role.SOURCE,
    ActionKind.CANCEL_SOURCE: Role.SOURCE,
    ActionKind.RESERVE_DESTINATION: Role.DESTINATION,
    ActionKind.ACTIVATE_DESTINATION: Role.DESTINATION,
    ActionKind.CANCEL_DESTINATION: Role.DESTINATION,
    ActionKind.COMPLETE: Role.BOTH,
}
# The actions that free (or confirm free) what the source holds.
SOURCE_RELEASES = frozenset({ActionKind.RELEASE_SOURCE, ActionKind.CANCEL_SOURCE})

# Cleanup actions free memory; they may be applied or found to have nothing to do.
CLEANUP_KINDS = frozenset(
    {ActionKind.RELEASE_SOURCE, ActionKind.CANCEL_SOURCE, ActionKind.CANCEL_DESTINATION}
)

ALLOWED_OUTCOMES: dict[ActionKind, frozenset[OutcomeKind]] = {
    ActionKind.SUBMIT_PREFILL: frozenset({OutcomeKind.SUBMITTED}),
    ActionKind.RESERVE_DESTINATION: frozenset({OutcomeKind.ACCEPTED}),
    ActionKind.START_TRANSFER: frozenset({OutcomeKind.SCHEDULED}),
    ActionKind.ACTIVATE_DESTINATION: frozenset({OutcomeKind.APPLIED}),
    ActionKind.RELEASE_SOURCE: frozenset({OutcomeKind.APPLIED, OutcomeKind.NOOP}),
    ActionKind.CANCEL_SOURCE: frozenset({OutcomeKind.APPLIED, OutcomeKind.NOOP}),
    ActionKind.CANCEL_DESTINATION: frozenset({OutcomeKind.APPLIED, OutcomeKind.NOOP}),
    ActionKind.COMPLETE: frozenset(),
}


# A handoff is a prefill plus a KV transfer; a day is already absurd, and the
# bound keeps every deadline a representable timestamp.
MAX_HANDOFF_TIMEOUT_S = 86_400.0


def format_float(value: float) -> str:
    """Render a float the way the reference does in its messages: 1, 0.5, inf, NaN."""
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "inf" if value > 0 else "-inf"
    if value == int(value) and abs(value) < 1e16:
        return str(int(value))
    return repr(value)


# --- errors ---------------------------------------------------------------


class HandoffError(Exception):
    """A rejected call. The handoff is exactly as it was before the call."""

    code: str = "UNKNOWN"  # the gRPC status code name this rejection maps to

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class InvalidArgument(HandoffError):
    """Malformed or impossible values, or an outcome kind the action does not allow."""

    code = "INVALID_ARGUMENT"


class FailedPrecondition(HandoffError):
    """Well-formed, but not allowed in the handoff's current state."""

    code = "FAILED_PRECONDITION"


class NotFound(HandoffError):
    """An unknown action id or handoff."""

    code = "NOT_FOUND"


class AlreadyExists(HandoffError):
    """A handoff id that is live or still retained."""

    code = "ALREADY_EXISTS"


class ResourceExhausted(HandoffError):
    """An admission limit was reached."""

    code = "RESOURCE_EXHAUSTED"


class PermissionDenied(HandoffError):
    """The caller's identity does not allow this report or this engine's stream."""

    code = "PERMISSION_DENIED"


class Unavailable(HandoffError):
    """The server is draining and takes no new handoffs."""

    code = "UNAVAILABLE"


class Internal(HandoffError):
    """An unexpected failure; the handoff was restored to its state before the call."""

    code = "INTERNAL"


# --- values -------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class TransferTiming:
    """How the source sizes the KV transfer it is about to hold."""

    mode: TimingMode
    full_prompt_tokens: int
    kv_bytes_per_token: int | None = None
    bandwidth_gb_s: float | None = None
    state_bytes: int = 0  # a per-request constant, e.g. a recurrent-state copy

    def delay_ms(self, transferable_prompt_tokens: int) -> float | None:
        """The modelled transfer time, or None when the model is incomplete."""
        if self.mode is TimingMode.FULL_PROMPT:
            return self._delay_ms(self.full_prompt_tokens)
        return self._delay_ms(transferable_prompt_tokens)

    def _delay_ms(self, tokens: int) -> float | None:
        if self.kv_bytes_per_token is None or self.bandwidth_gb_s is None:
            return None
        if not self.bandwidth_gb_s > 0.0:
            return None
        payload = float(tokens) * float(self.kv_bytes_per_token) + float(self.state_bytes)
        return payload / (self.bandwidth_gb_s * 1e9) * 1000.0

    def validate(self) -> None:
        """Reject a timing that can never yield a usable delay."""
        bandwidth = self.bandwidth_gb_s
        if bandwidth is not None and not (math.isfinite(bandwidth) and bandwidth >= 0.0):
            raise InvalidArgument(f"invalid handoff transfer bandwidth {format_float(bandwidth)}")
        # The full prompt's delay whatever the mode (docs/semantics.md, correction 6).
        validate_delay_ms(self._delay_ms(self.full_prompt_tokens))


def validate_delay_ms(delay_ms: float | None) -> None:
    if delay_ms is not None and not (math.isfinite(delay_ms) and delay_ms >= 0.0):
        raise InvalidArgument(f"invalid handoff transfer delay {format_float(delay_ms)}")


@dataclass(frozen=True, slots=True)
class SourceHeld:
    """The prefill finished and holds its KV blocks for the transfer."""

    kind: ClassVar[str] = "source_held"

    transfer_timing: TransferTiming


@dataclass(frozen=True, slots=True)
class DestinationReserved:
    """The decode engine reserved room for this many prompt tokens."""

    kind: ClassVar[str] = "destination_reserved"

    transferable_prompt_tokens: int


@dataclass(frozen=True, slots=True)
class TransferCompleted:
    """The KV bytes have arrived at the destination."""

    kind: ClassVar[str] = "transfer_completed"


@dataclass(frozen=True, slots=True)
class Failed:
    """Terminal: something broke; clean up."""

    kind: ClassVar[str] = "failed"


@dataclass(frozen=True, slots=True)
class TimedOut:
    """Terminal: the handoff ran out of time; clean up."""

    kind: ClassVar[str] = "timed_out"


@dataclass(frozen=True, slots=True)
class Canceled:
    """Terminal: the client no longer wants the request; clean up."""

    kind: ClassVar[str] = "canceled"


@dataclass(frozen=True, slots=True)
class EngineLost:
    """That engine's memory for this handoff is gone (docs/semantics.md, correction 7):
    it died, restarted empty, or freed on its own. Never rejected; nothing is
    owed to that side any more."""

    kind: ClassVar[str] = "engine_lost"

    role: Role  # SOURCE or DESTINATION


Fact = (
    SourceHeld | DestinationReserved | TransferCompleted | Failed | TimedOut | Canceled | EngineLost
)
TERMINAL_FACTS = (Failed, TimedOut, Canceled)
FACTS = (SourceHeld, DestinationReserved, TransferCompleted, Failed, TimedOut, Canceled, EngineLost)
FACT_KINDS = tuple(fact.kind for fact in FACTS)  # metrics labels, journal record heads


@dataclass(frozen=True, slots=True)
class Outcome:
    """What an engine reports after executing an action."""

    kind: OutcomeKind
    reason: str = ""  # only meaningful for FAILED

    def describe(self) -> str:
        if self.kind is OutcomeKind.FAILED:
            return f"Failed({self.reason!r})"
        return self.kind.name.capitalize()


@dataclass(frozen=True, slots=True)
class Action:
    """An instruction the coordinator issued, numbered per handoff from 0."""

    id: int
    kind: ActionKind
    delay_ms: float | None = None  # set for START_TRANSFER only
    completion: Completion | None = None  # set for COMPLETE only: how the handoff ended
