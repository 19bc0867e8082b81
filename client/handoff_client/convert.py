"""Conversion between the SDK's values and the wire messages, in one place.

Enums are written by proto name and read by number (the SDK enums use the
proto numbers as values).
"""

from __future__ import annotations

from collections.abc import Iterable
from datetime import UTC, datetime

from google.protobuf.timestamp_pb2 import Timestamp

from handoff_client.model import (
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
    Handoff,
    LifecycleEvent,
    LifecycleEventKind,
    LostCause,
    Order,
    Outcome,
    Phase,
    Role,
    SourceHeld,
    TimedOut,
    TransferCompleted,
    TransferTiming,
)
from handoff_proto.v1 import coordinator_pb2 as pb

_ACTION_KINDS = {kind.value for kind in ActionKind}
_ROLES = {role.value for role in Role}
_COMPLETIONS = {completion.value for completion in Completion}
_END_CAUSES = {cause.value for cause in EndCause}
_LOST_CAUSES = {cause.value for cause in LostCause}


def action_from_pb(message: pb.Action) -> Action:
    """The action; one of a kind (or for a role) this SDK does not know is ``UNKNOWN``.

    Reading never fails on a newer server's action: the sidecar skips it
    instead of dropping the stream, which would only get it redelivered.
    """
    known = message.kind in _ACTION_KINDS and message.target in _ROLES
    return Action(
        handoff_id=message.handoff_id,
        id=message.id,
        kind=ActionKind(message.kind) if known else ActionKind.UNKNOWN,
        target=Role(message.target) if known else Role.BOTH,
        engine_id=message.engine_id,
        attempt=message.attempt,
        delay_ms=message.delay_ms,
        completion=Completion(message.completion) if message.completion in _COMPLETIONS else None,
        traceparent=message.traceparent,
        tracestate=message.tracestate,
        end_reason=end_reason_from_pb(message.end_reason)
        if message.HasField("end_reason")
        else None,
    )


def actions_from_pb(messages: Iterable[pb.Action]) -> tuple[Action, ...]:
    return tuple(action_from_pb(m) for m in messages)


def _time(stamp: Timestamp, is_set: bool) -> datetime | None:
    return stamp.ToDatetime(tzinfo=UTC) if is_set else None


def handoff_from_pb(message: pb.Handoff) -> Handoff:
    return Handoff(
        handoff_id=message.handoff_id,
        order=Order(message.order),
        phase=Phase(message.phase),
        completion=Completion(message.completion) if message.completion else None,
        source_engine_id=message.source_engine_id,
        destination_engine_id=message.destination_engine_id,
        transfer_executor=Role(message.transfer_executor),
        outstanding_actions=actions_from_pb(message.outstanding_actions),
        lifecycle=tuple(
            LifecycleEvent(LifecycleEventKind(e.kind), e.at.ToDatetime(tzinfo=UTC))
            for e in message.lifecycle
        ),
        deadline=_time(message.deadline, message.HasField("deadline")),
        started_at=_time(message.started_at, message.HasField("started_at")),
        completed_at=_time(message.completed_at, message.HasField("completed_at")),
        fallback_transfer_delay_ms=message.fallback_transfer_delay_ms,
        abandoned=message.abandoned,
        end_reasons=tuple(end_reason_from_pb(r) for r in message.end_reasons),
    )


def end_reason_from_pb(message: pb.EndReason) -> EndReason:
    """The reason; a cause (or lost cause) this SDK does not know reads as UNSPECIFIED."""
    cause = EndCause(message.cause) if message.cause in _END_CAUSES else EndCause.UNSPECIFIED
    lost = None
    if cause is EndCause.ENGINE_LOST:
        lost = LostCause(message.lost_cause) if message.lost_cause in _LOST_CAUSES else None
    return EndReason(
        cause=cause,
        role=Role(message.role) if message.role in _ROLES and message.role else None,
        engine_id=message.engine_id,
        lost_cause=lost,
        action=ActionKind(message.action)
        if message.action in _ACTION_KINDS and message.action
        else None,
        detail=message.detail,
    )


def outcome_to_pb(outcome: Outcome) -> pb.Outcome:
    return pb.Outcome(
        kind=pb.OutcomeKind.Value("OUTCOME_KIND_" + outcome.kind.name), reason=outcome.reason
    )


def timing_to_pb(timing: TransferTiming) -> pb.TransferTiming:
    # None leaves an optional field absent ("the engine cannot say"), which is not 0.
    return pb.TransferTiming(
        mode=pb.TransferTimingMode.Value("TRANSFER_TIMING_MODE_" + timing.mode.name),
        full_prompt_tokens=timing.full_prompt_tokens,
        kv_bytes_per_token=timing.kv_bytes_per_token,
        bandwidth_gb_s=timing.bandwidth_gb_s,
        state_bytes=timing.state_bytes,
    )


def fact_to_pb(fact: Fact) -> pb.Fact:
    match fact:
        case SourceHeld(timing):
            return pb.Fact(source_held=pb.SourceHeld(transfer_timing=timing_to_pb(timing)))
        case DestinationReserved(tokens):
            return pb.Fact(
                destination_reserved=pb.DestinationReserved(transferable_prompt_tokens=tokens)
            )
        case TransferCompleted():
            return pb.Fact(transfer_completed=pb.TransferCompleted())
        case Failed(reason):
            return pb.Fact(failed=pb.Failed(reason=reason))
        case TimedOut():
            return pb.Fact(timed_out=pb.TimedOut())
        case Canceled(reason):
            return pb.Fact(canceled=pb.Canceled(reason=reason))
        case EngineLost(role):
            return pb.Fact(engine_lost=pb.EngineLost(role=pb.Role.Value("ROLE_" + role.name)))
