"""Protobuf messages to domain values and back, validating every field on the way in.

A violation raises InvalidArgument naming the field, before anything is touched.
"""

from __future__ import annotations

import math
import re
import uuid
from collections.abc import Iterable, Sequence

from handoff_proto.v1 import coordinator_pb2 as pb
from handoff_server.domain.delivery import Dispatch
from handoff_server.domain.entries import Entry, StartRequest
from handoff_server.domain.model import (
    MAX_HANDOFF_TIMEOUT_S,
    Action,
    ActionKind,
    Canceled,
    Completion,
    DestinationReserved,
    EndCause,
    EndReason,
    EngineLost,
    Fact,
    Failed,
    InvalidArgument,
    LifecycleEvent,
    LostCause,
    Order,
    Outcome,
    OutcomeKind,
    Phase,
    Release,
    ReleaseReason,
    Role,
    SourceHeld,
    TimedOut,
    TimingMode,
    TransferCompleted,
    TransferTiming,
)
from handoff_server.domain.retained import Retained

ENGINE_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")
# Already canonical: uuid.UUID would parse it only to print it back unchanged.
CANONICAL_UUID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")
MAX_REASON_BYTES = 1024

ORDERS = {
    pb.HANDOFF_ORDER_SOURCE_FIRST: Order.SOURCE_FIRST,
    pb.HANDOFF_ORDER_DESTINATION_FIRST: Order.DESTINATION_FIRST,
}
ORDER_OF_ENGINE = {
    pb.ENGINE_TYPE_VLLM: Order.SOURCE_FIRST,
    pb.ENGINE_TYPE_TRTLLM: Order.SOURCE_FIRST,
    pb.ENGINE_TYPE_SGLANG: Order.DESTINATION_FIRST,
}
EXECUTORS = {
    pb.ROLE_UNSPECIFIED: Role.SOURCE,
    pb.ROLE_SOURCE: Role.SOURCE,
    pb.ROLE_DESTINATION: Role.DESTINATION,
}
TIMING_MODES = {
    pb.TRANSFER_TIMING_MODE_FULL_PROMPT: TimingMode.FULL_PROMPT,
    pb.TRANSFER_TIMING_MODE_DESTINATION_MISSING: TimingMode.DESTINATION_MISSING,
}
OUTCOMES = {
    pb.OUTCOME_KIND_SUBMITTED: OutcomeKind.SUBMITTED,
    pb.OUTCOME_KIND_ACCEPTED: OutcomeKind.ACCEPTED,
    pb.OUTCOME_KIND_SCHEDULED: OutcomeKind.SCHEDULED,
    pb.OUTCOME_KIND_APPLIED: OutcomeKind.APPLIED,
    pb.OUTCOME_KIND_NOOP: OutcomeKind.NOOP,
    pb.OUTCOME_KIND_FAILED: OutcomeKind.FAILED,
}
ACTION_KINDS = {kind: pb.ActionKind.Value("ACTION_KIND_" + kind.name) for kind in ActionKind}
ROLES = {
    Role.SOURCE: pb.ROLE_SOURCE,
    Role.DESTINATION: pb.ROLE_DESTINATION,
    Role.BOTH: pb.ROLE_BOTH,
}
PHASES = {phase: pb.Phase.Value("PHASE_" + phase.name) for phase in Phase}
COMPLETIONS = {c: pb.Completion.Value("COMPLETION_" + c.name) for c in Completion}
END_CAUSES = {c: pb.EndCause.Value("END_CAUSE_" + c.name) for c in EndCause}
LOST_CAUSES = {c: pb.LostCause.Value("LOST_CAUSE_" + c.name) for c in LostCause}
PB_ORDERS = {order: value for value, order in ORDERS.items()}
EVENTS = {
    event: pb.LifecycleEventKind.Value("LIFECYCLE_EVENT_KIND_" + event.name)
    for event in LifecycleEvent
}


# --- in ---------------------------------------------------------------------


def handoff_id(value: str, field: str = "handoff_id") -> str:
    """The canonical lower-case form of a UUID."""
    if CANONICAL_UUID.fullmatch(value):
        return value
    if len(value) > 64:
        raise InvalidArgument(f"{field} must be a UUID, got {len(value)} characters")
    try:
        return str(uuid.UUID(value))
    except ValueError:
        raise InvalidArgument(f"{field} must be a UUID, got {value!r}") from None


def engine_id(value: str, field: str = "engine_id") -> str:
    if not ENGINE_ID.fullmatch(value):
        shown = value if len(value) <= 40 else value[:40] + "..."
        raise InvalidArgument(f"{field} must be 1-128 characters of [A-Za-z0-9._:-], got {shown!r}")
    return value


def incarnation(value: str, field: str = "incarnation") -> str:
    """An engine's incarnation: empty (no fencing) or like an engine id."""
    return engine_id(value, field) if value else value


# How far an incarnation's start time may be ahead of the server's clock:
# clocks of one cluster differ by less; more is a forged "newest ever".
INCARNATION_AHEAD_S = 300.0
STARTED_MS = re.compile(r"[0-9]{13}")


def plausible_incarnation(value: str, now: float, field: str = "incarnation") -> str:
    """An incarnation that starts with its start time in unix milliseconds (the
    SDK's, 13 digits) may not be ahead of ``now`` by more than
    INCARNATION_AHEAD_S: a newer incarnation fences the older ones out, so one
    dated in the future would fence out every real one until it is reached."""
    if STARTED_MS.match(value):
        ahead = int(value[:13]) / 1000 - now
        if ahead > INCARNATION_AHEAD_S:
            raise InvalidArgument(
                f"{field} {value[:40]} starts {ahead:.0f} s ahead of the coordinator's clock, "
                f"more than {INCARNATION_AHEAD_S:g} s: not a real start time"
            )
    return value


def session_id(value: str, field: str = "session_id") -> str:
    if value and not ENGINE_ID.fullmatch(value):
        raise InvalidArgument(f"{field} must be at most 128 characters of [A-Za-z0-9._:-]")
    return value


def _finite_non_negative(value: float, field: str) -> float:
    if not (math.isfinite(value) and value >= 0.0):
        raise InvalidArgument(f"{field} must be finite and >= 0, got {value}")
    return value


def start_request(request: pb.StartHandoffRequest) -> StartRequest:
    order = ORDERS.get(request.order)
    implied = ORDER_OF_ENGINE.get(request.engine_type)
    if request.order and order is None:
        raise InvalidArgument(f"order has an unknown value {request.order}")
    if request.engine_type and implied is None:
        raise InvalidArgument(f"engine_type has an unknown value {request.engine_type}")
    if order is None and implied is None:
        raise InvalidArgument("order or engine_type is required")
    if order is not None and implied is not None and order is not implied:
        raise InvalidArgument(
            f"order {order.value} contradicts engine_type "
            f"{pb.EngineType.Name(request.engine_type)} (which implies {implied.value})"
        )
    executor = EXECUTORS.get(request.transfer_executor)
    if executor is None:
        raise InvalidArgument("transfer_executor must be ROLE_SOURCE or ROLE_DESTINATION")
    timeout_s: float | None = None
    if request.HasField("timeout_s"):
        timeout_s = _finite_non_negative(request.timeout_s, "timeout_s")
        if not 0.0 < timeout_s <= MAX_HANDOFF_TIMEOUT_S:
            raise InvalidArgument(
                f"timeout_s must be > 0 and at most {MAX_HANDOFF_TIMEOUT_S:.0f}, got {timeout_s}"
            )
    resolved = order if order is not None else implied
    assert resolved is not None
    return StartRequest(
        handoff_id=handoff_id(request.handoff_id),
        order=resolved,
        source_engine_id=engine_id(request.source_engine_id, "source_engine_id"),
        destination_engine_id=engine_id(request.destination_engine_id, "destination_engine_id"),
        fallback_transfer_delay_ms=_finite_non_negative(
            request.fallback_transfer_delay_ms, "fallback_transfer_delay_ms"
        ),
        transfer_executor=executor,
        timeout_s=timeout_s,
    )


# Values without a payload, immutable: one of each serves every report.
FACT_TRANSFER_COMPLETED, FACT_TIMED_OUT, FACT_FAILED, FACT_CANCELED = (
    TransferCompleted(),
    TimedOut(),
    Failed(),
    Canceled(),
)
LOST = {
    pb.ROLE_SOURCE: EngineLost(Role.SOURCE),
    pb.ROLE_DESTINATION: EngineLost(Role.DESTINATION),
}
PLAIN_OUTCOMES = {kind: Outcome(kind) for kind in OutcomeKind if kind is not OutcomeKind.FAILED}


def fact(message: pb.Fact) -> Fact:
    which = message.WhichOneof("kind")
    if which is None:
        raise InvalidArgument("fact is required: set one of its kinds")
    if which == "source_held":
        # Each read of a sub-message builds a wrapper: read each once, and
        # pass the fields by position (frozen dataclasses set each by hand).
        held = message.source_held
        if not held.HasField("transfer_timing"):
            raise InvalidArgument("fact.source_held.transfer_timing is required")
        timing = held.transfer_timing
        mode = TIMING_MODES.get(timing.mode)
        if mode is None:
            raise InvalidArgument("fact.source_held.transfer_timing.mode is required")
        # Bandwidth and delay are range-checked by the core, whose messages
        # the conformance vectors define.
        return SourceHeld(
            TransferTiming(
                mode,
                timing.full_prompt_tokens,
                timing.kv_bytes_per_token if timing.HasField("kv_bytes_per_token") else None,
                timing.bandwidth_gb_s if timing.HasField("bandwidth_gb_s") else None,
                timing.state_bytes,
            )
        )
    if which == "destination_reserved":
        return DestinationReserved(message.destination_reserved.transferable_prompt_tokens)
    if which == "failed":
        _reason(message.failed.reason, "fact.failed.reason", required=False)
        return FACT_FAILED
    if which == "canceled":
        _reason(message.canceled.reason, "fact.canceled.reason", required=False)
        return FACT_CANCELED
    if which == "engine_lost":
        lost = LOST.get(message.engine_lost.role)
        if lost is None:
            raise InvalidArgument("fact.engine_lost.role must be ROLE_SOURCE or ROLE_DESTINATION")
        return lost
    return FACT_TRANSFER_COMPLETED if which == "transfer_completed" else FACT_TIMED_OUT


def fact_text(message: pb.Fact) -> str:
    """The reason text a Canceled or Failed fact brings (why it ended), else ''."""
    which = message.WhichOneof("kind")
    if which == "canceled":
        return message.canceled.reason
    return message.failed.reason if which == "failed" else ""


def _reason(value: str, field: str, required: bool) -> str:
    if required and not value:
        raise InvalidArgument(f"{field} is required for a failed outcome")
    if len(value.encode()) > MAX_REASON_BYTES:
        raise InvalidArgument(f"{field} must be at most {MAX_REASON_BYTES} bytes")
    return value


def outcome(message: pb.Outcome) -> Outcome:
    kind = OUTCOMES.get(message.kind)
    if kind is None:
        raise InvalidArgument("outcome.kind is required")
    if kind is OutcomeKind.FAILED:
        return Outcome(kind, _reason(message.reason, "outcome.reason", required=True))
    # A reason on a success means nothing; dropping it keeps a re-report with
    # or without one from looking like a conflicting outcome.
    return PLAIN_OUTCOMES[kind]


# --- out --------------------------------------------------------------------


def action(dispatch: Dispatch) -> pb.Action:
    message = pb.Action(
        handoff_id=dispatch.handoff_id,
        id=dispatch.action.id,
        kind=ACTION_KINDS[dispatch.action.kind],
        target=ROLES[dispatch.target],
        attempt=dispatch.attempt,
        engine_id=dispatch.engine_id,
    )
    if dispatch.action.delay_ms is not None:
        message.delay_ms = dispatch.action.delay_ms
    if dispatch.action.completion is not None:
        message.completion = COMPLETIONS[dispatch.action.completion]
    if dispatch.trace is not None:
        message.traceparent, message.tracestate = dispatch.trace
    if dispatch.reason is not None:
        message.end_reason.CopyFrom(end_reason(dispatch.reason))
    return message


def outstanding_action(entry: Entry, core_action: Action) -> pb.Action:
    role = entry.role_of(core_action.kind)
    engines = entry.engine_for(role)
    return action(Dispatch(entry.handoff_id, core_action, role, engines[0]))


def handoff(entry: Entry | Retained) -> pb.Handoff:
    """The whole handoff, as StartHandoff, the unary reports and GetHandoff answer it."""
    core = entry.core
    # Sub-messages are written in place: one given to a constructor is copied.
    message = pb.Handoff(
        handoff_id=entry.handoff_id,
        order=PB_ORDERS[core.order],
        phase=PHASES[core.phase],
        source_engine_id=entry.source_engine_id,
        destination_engine_id=entry.destination_engine_id,
        transfer_executor=ROLES[entry.transfer_executor],
        fallback_transfer_delay_ms=core.fallback_transfer_delay_ms,
    )
    if core.completion is not None:
        message.completion = COMPLETIONS[core.completion]
    message.started_at.FromNanoseconds(_nanoseconds(entry.started_at))
    message.deadline.FromNanoseconds(_nanoseconds(entry.deadline))
    add_event = message.lifecycle.add
    for event, at in zip(core.lifecycle, entry.lifecycle_at, strict=True):
        add_event(kind=EVENTS[event]).at.FromNanoseconds(_nanoseconds(at))
    if isinstance(entry, Entry) and (outstanding := entry.core.outstanding):
        message.outstanding_actions.extend([outstanding_action(entry, a) for a in outstanding])
    if entry.completed_at is not None:
        message.completed_at.FromNanoseconds(_nanoseconds(entry.completed_at))
    if entry.abandoned_at is not None:
        message.abandoned = True
    message.end_reasons.extend([end_reason(r) for r in entry.reasons])
    return message


def end_reason(reason: EndReason) -> pb.EndReason:
    message = pb.EndReason(
        cause=END_CAUSES[reason.cause], engine_id=reason.engine_id, detail=reason.detail
    )
    if reason.role is not None:
        message.role = ROLES[reason.role]
    if reason.lost_cause is not None:
        message.lost_cause = LOST_CAUSES[reason.lost_cause]
    if reason.action is not None:
        message.action = ACTION_KINDS[reason.action]
    return message


def _nanoseconds(seconds: float) -> int:
    return round(seconds * 1e9)


SIDE_ROLES = {pb.ROLE_SOURCE: Role.SOURCE, pb.ROLE_DESTINATION: Role.DESTINATION}
RELEASE_REASONS = {
    ReleaseReason.UNKNOWN_HANDOFF: pb.RELEASE_REASON_UNKNOWN_HANDOFF,
    ReleaseReason.CANCELED: pb.RELEASE_REASON_CANCELED,
    ReleaseReason.SUCCEEDED_AS_SOURCE: pb.RELEASE_REASON_SUCCEEDED_AS_SOURCE,
    ReleaseReason.ENGINE_LOST: pb.RELEASE_REASON_ENGINE_LOST,
}


def held_sides(sides: Iterable[pb.HeldSide], field: str) -> list[tuple[str, Role]]:
    """Each side's handoff id and role (the source's or the destination's)."""
    decoded = []
    for index, side in enumerate(sides):
        role = SIDE_ROLES.get(side.role)
        if role is None:
            raise InvalidArgument(f"{field}[{index}].role must be ROLE_SOURCE or ROLE_DESTINATION")
        decoded.append((handoff_id(side.handoff_id, f"{field}[{index}].handoff_id"), role))
    return decoded


def release(release: Release) -> pb.Release:
    return pb.Release(
        handoff_id=release.handoff_id,
        role=ROLES[release.role],
        reason=RELEASE_REASONS[release.reason],
    )


# Reports in one Connect message at most: all of a message's reports are
# answered before any of their acks can be written, so this also bounds what
# one message can make the server queue. A message with more is refused whole.
MAX_REPORTS_PER_MESSAGE = 128


def reports_of(request: pb.ConnectRequest) -> Sequence[pb.ConnectRequest | pb.ConnectReport]:
    """The reports in one Connect message after the hello, in order; one ack is owed each.

    The message's own kind counts as a report even when it is not one (a
    second hello, nothing at all), so that it is acknowledged with an error
    rather than ignored; unless the message only carries ``reports``.
    """
    batch = request.reports
    if batch and request.WhichOneof("kind") is None:
        return batch  # the field itself: counting it makes no wrapper per report
    return [request, *batch]
