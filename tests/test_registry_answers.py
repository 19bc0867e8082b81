"""Every conformance vector through the registry: what each call answers, and what
the handoff shows (convert.handoff) at every step, live, retained and reopened."""

from __future__ import annotations

from google.protobuf.timestamp_pb2 import Timestamp

from handoff.v1 import coordinator_pb2 as pb
from handoff_server import convert
from handoff_server.conformance import Answer, FactStep, StartStep, Vector, mismatch
from handoff_server.entries import Entry, Retained, StartRequest
from handoff_server.model import HandoffError, Phase
from handoff_server.registry import CallResult
from tests.registry_support import DESTINATION, SOURCE, Harness
from tests.support import all_vectors


def timestamp(seconds: float) -> Timestamp:
    stamp = Timestamp()
    stamp.FromNanoseconds(round(seconds * 1e9))
    return stamp


def shown(entry: Entry | Retained) -> pb.Handoff:
    """What GetHandoff must show, built field by field from the registry's state."""
    core = entry.core
    message = pb.Handoff(
        handoff_id=entry.handoff_id,
        order=convert.PB_ORDERS[core.order],
        phase=convert.PHASES[core.phase],
        completion=convert.COMPLETION_UNSPECIFIED
        if core.completion is None
        else convert.COMPLETIONS[core.completion],
        source_engine_id=entry.source_engine_id,
        destination_engine_id=entry.destination_engine_id,
        transfer_executor=convert.ROLES[entry.transfer_executor],
        fallback_transfer_delay_ms=core.fallback_transfer_delay_ms,
        deadline=timestamp(entry.deadline),
        started_at=timestamp(entry.started_at),
    )
    if isinstance(entry, Entry):
        for action in entry.core.outstanding:
            message.outstanding_actions.append(convert.outstanding_action(entry, action))
    for event, at in zip(core.lifecycle, entry.lifecycle_at, strict=True):
        message.lifecycle.append(pb.LifecycleEvent(kind=convert.EVENTS[event], at=timestamp(at)))
    if entry.completed_at is not None:
        message.completed_at.CopyFrom(timestamp(entry.completed_at))
    return message


def call(h: Harness, handoff_id: str, step: object) -> CallResult:
    if isinstance(step, StartStep):
        request = StartRequest(
            handoff_id, step.order, SOURCE, DESTINATION, step.fallback_transfer_delay_ms
        )
        return h.registry.start(request)
    if isinstance(step, FactStep):
        return h.registry.report_fact(handoff_id, step.fact)
    return h.registry.report_outcome(handoff_id, step.action_id, step.outcome)  # type: ignore[attr-defined]


def replay(h: Harness, vector: Vector) -> str | None:
    handoff_id = vector.handoff_id
    shown_at_completion: pb.Handoff | None = None
    for index, step in enumerate(vector.steps):
        h.clock.advance(0.001)
        result: CallResult | None = None
        error: HandoffError | None = None
        try:
            result = call(h, handoff_id, step)
        except HandoffError as rejected:
            error = rejected
        # The engines' streams write what the vector's engines then act on.
        h.drain(SOURCE)
        h.drain(DESTINATION)
        if isinstance(step, StartStep) and error is not None:
            refused = Answer(False, error.code, (), None, None, error.message)
            return None if mismatch(step.expect, refused) is None else vector.name
        known = h.registry.get(handoff_id)
        completion = known.core.completion
        observed = Answer(
            ok=error is None,
            code=None if error is None else error.code,
            actions=() if result is None else tuple(d.action for d in result.actions),
            phase=known.core.phase.value,
            completion=None if completion is None else completion.value,
            message="" if error is None else error.message,
        )
        reason = mismatch(step.expect, observed)
        answers = [convert.handoff(known)] + (
            [] if result is None else [convert.handoff(result.entry)]
        )
        if any(answer != shown(known) for answer in answers):
            reason = "convert.handoff shows something else than the registry holds"
        if known.core.phase is not Phase.COMPLETE:
            assert isinstance(known, Entry)
            shown_at_completion = None
        else:
            assert isinstance(known, Retained)
            if shown_at_completion is None:
                # The call that completed it answered from the full entry.
                assert result is not None
                shown_at_completion = shown(result.entry)
            if any(answer != shown_at_completion for answer in answers):
                reason = "the retained handoff shows something else than it did in full"
        if reason is not None:
            return f"{vector.name} step {index}: {reason}"
    return None


def test_every_answer_and_every_view_of_every_vector() -> None:
    h = Harness(max_retained=10_000)
    h.subscribe(SOURCE)
    h.subscribe(DESTINATION)
    failures = [f for v in all_vectors() if (f := replay(h, v)) is not None]
    assert failures == []
    retained = [e for e in h.registry.handoffs.values() if isinstance(e, Retained)]
    assert len(retained) > 1000
    assert h.registry.active_count == len(h.registry.handoffs) - len(retained)
