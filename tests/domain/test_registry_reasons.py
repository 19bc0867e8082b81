"""Why a handoff ended: one reason per completion, set by the registry from the
cause of its transition into cleanup (the core does not change)."""

from __future__ import annotations

from handoff_server.domain.entries import Entry
from handoff_server.domain.model import (
    ActionKind,
    Canceled,
    EndCause,
    EndReason,
    EngineLost,
    LostCause,
    Outcome,
    OutcomeKind,
    Role,
)
from tests.support.registry import DESTINATION, SOURCE, Harness


def test_a_frontend_cancel_keeps_its_text_and_is_counted_by_reason() -> None:
    h = Harness()
    handoff_id = h.start()
    h.registry.report_fact(handoff_id, Canceled(), origin="engine", detail="client went away")
    (reason,) = h.registry.get(handoff_id).reasons
    assert reason == EndReason(EndCause.FRONTEND_CANCELED, detail="client went away")


def test_the_deadline_is_the_reason_and_labels_the_cancellation() -> None:
    h = Harness(default_timeout_s=5.0)
    h.subscribe(SOURCE)
    handoff_id = h.start()
    h.advance(5.1)
    assert h.registry.get(handoff_id).reasons == (EndReason(EndCause.DEADLINE),)
    # Nothing reached the source: the server settled its cleanup, and it completed.
    assert h.value("handoff_cancellations_total", reason="deadline") == 1


def test_an_unreachable_engine_names_its_side_and_why() -> None:
    h = Harness(delivery_timeout_s=10.0)
    h.subscribe(SOURCE)
    handoff_id = h.start()
    h.advance(10.1)
    (reason,) = h.registry.get(handoff_id).reasons
    assert reason.cause is EndCause.ENGINE_LOST
    assert (reason.role, reason.engine_id) == (Role.DESTINATION, DESTINATION)
    assert reason.lost_cause is LostCause.UNREACHABLE


def test_a_restarted_engine_is_the_reason() -> None:
    h = Harness()
    first = h.registry.subscribe(SOURCE, lambda: None, incarnation="first")
    handoff_id = h.start()
    assert h.registry.take(first, 10)  # its SubmitPrefill reached the old process
    h.registry.subscribe(SOURCE, lambda: None, incarnation="second")
    (reason,) = h.registry.get(handoff_id).reasons
    assert (reason.cause, reason.role, reason.lost_cause) == (
        EndCause.ENGINE_LOST,
        Role.SOURCE,
        LostCause.RESTARTED,
    )


def test_an_engine_reported_lost_has_no_server_cause() -> None:
    h = Harness()
    handoff_id = h.start()
    h.registry.report_fact(handoff_id, EngineLost(Role.SOURCE))
    (reason,) = h.registry.get(handoff_id).reasons
    assert reason == EndReason(EndCause.ENGINE_LOST, Role.SOURCE, SOURCE)
    assert "reported" in reason.describe()


def test_a_failed_action_names_the_action_the_engine_and_its_reason() -> None:
    h = Harness()
    handoff_id = h.start()
    h.registry.report_outcome(handoff_id, 0, Outcome(OutcomeKind.FAILED, "out of KV blocks"))
    (reason,) = h.registry.get(handoff_id).reasons
    assert reason == EndReason(
        EndCause.ACTION_FAILED,
        Role.SOURCE,
        SOURCE,
        action=ActionKind.SUBMIT_PREFILL,
        detail="out of KV blocks",
    )
    assert reason.describe() == "action_failed: submit_prefill on prefill-a 'out of KV blocks'"


def test_a_drain_is_the_reason() -> None:
    h = Harness()
    handoff_id = h.start()
    h.registry.cancel_active("shutting down")
    (reason,) = h.registry.get(handoff_id).reasons
    assert reason.cause is EndCause.DRAIN


def test_a_reopened_handoff_has_two_reasons_newest_last() -> None:
    h = Harness()
    h.subscribe(DESTINATION)
    handoff_id = h.start()
    h.succeed(handoff_id)
    h.drain(DESTINATION)
    assert [r.cause for r in h.registry.get(handoff_id).reasons] == [EndCause.SUCCEEDED]
    h.registry.report_fact(handoff_id, EngineLost(Role.DESTINATION))
    entry = h.registry.get(handoff_id)
    assert [r.cause for r in entry.reasons] == [EndCause.SUCCEEDED, EndCause.ENGINE_LOST]
    assert h.value("handoff_cancellations_total", reason="engine_lost") == 1


def test_a_success_has_no_cancellation() -> None:
    h = Harness()
    h.subscribe(DESTINATION)
    handoff_id = h.start()
    h.succeed(handoff_id)
    assert [r.cause for r in h.registry.get(handoff_id).reasons] == [EndCause.SUCCEEDED]
    assert h.value("handoff_cancellations_total", reason="unspecified") == 0


def test_a_side_its_sidecar_freed_is_lost_as_reconciled() -> None:
    h = Harness()
    handoff_id = h.start()
    h.reconcile(SOURCE, [], [(handoff_id, Role.SOURCE)])
    (reason,) = h.registry.get(handoff_id).reasons
    assert reason == EndReason(EndCause.ENGINE_LOST, Role.SOURCE, SOURCE, LostCause.RECONCILED)
    assert reason.describe() == "engine_lost: source prefill-a (reconciled)"


def test_the_complete_notice_carries_the_newest_reason() -> None:
    h = Harness()
    h.subscribe(SOURCE)
    h.subscribe(DESTINATION)
    handoff_id = h.start()
    h.succeed(handoff_id)
    (first,) = [d for d in h.drain(SOURCE) if d.action.kind is ActionKind.COMPLETE]
    assert first.reason == EndReason(EndCause.SUCCEEDED)
    h.registry.report_fact(handoff_id, Canceled(), detail="client went away")
    reopened = h.registry.get(handoff_id)
    assert isinstance(reopened, Entry)
    for action in list(reopened.core.outstanding):  # CancelDestination
        h.registry.report_outcome(handoff_id, action.id, Outcome(OutcomeKind.APPLIED))
    (second,) = [d for d in h.drain(DESTINATION) if d.action.kind is ActionKind.COMPLETE][-1:]
    assert second.reason == EndReason(EndCause.FRONTEND_CANCELED, detail="client went away")
    assert [d.reason for d in h.drain(SOURCE)] == [second.reason]  # to both engines
