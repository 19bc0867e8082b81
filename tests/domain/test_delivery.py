"""Delivery through the registry, on a fake clock: issue order, incarnations and
fencing, lost engines, cleanup settled for engines that never received anything."""

from __future__ import annotations

import logging
import uuid

import pytest

from handoff_server.domain.delivery import Fence, Fenced, Subscription
from handoff_server.domain.entries import Entry, StartRequest
from handoff_server.domain.model import (
    ActionKind,
    AlreadyExists,
    Canceled,
    Completion,
    DestinationReserved,
    Order,
    Outcome,
    OutcomeKind,
    Phase,
    SourceHeld,
    TransferCompleted,
)
from handoff_server.domain.timers import TimerKind
from tests.support.registry import APPLIED, DESTINATION, SOURCE, SUBMITTED, TIMING, Harness, kinds

ACCEPTED = Outcome(OutcomeKind.ACCEPTED)
SCHEDULED = Outcome(OutcomeKind.SCHEDULED)
NOOP = Outcome(OutcomeKind.NOOP)
OLD, NEW = "0001800000000000-aa", "0001800000001000-bb"


def subscribe(h: Harness, engine_id: str, incarnation: str = "", session: str = "") -> Subscription:
    subscription = h.registry.subscribe(engine_id, lambda: None, incarnation, session)
    h.subscriptions[engine_id] = subscription
    return subscription


def to_transfer_completed(h: Harness, handoff_id: str) -> None:
    """SOURCE_FIRST up to TransferCompleted, the engines draining as they go."""
    r = h.registry
    r.report_outcome(handoff_id, 0, SUBMITTED)
    r.report_fact(handoff_id, SourceHeld(TIMING))
    r.report_outcome(handoff_id, 1, ACCEPTED)
    r.report_fact(handoff_id, DestinationReserved(1000))
    r.report_outcome(handoff_id, 2, SCHEDULED)
    r.report_fact(handoff_id, TransferCompleted())


# --- issue order -----------------------------------------------------------------


def test_a_redelivered_action_goes_out_before_the_newer_ones() -> None:
    """Reordered redelivery leaked: [CancelSource, SubmitPrefill] ran the prefill
    after its cancel answered NOOP."""
    h = Harness()
    first = h.subscribe(SOURCE)
    handoff_id = h.start()
    assert kinds(h.drain(SOURCE)) == [ActionKind.SUBMIT_PREFILL]
    h.registry.delivery.unsubscribe(first)
    h.registry.report_fact(handoff_id, Canceled())
    h.subscribe(SOURCE)
    again = h.drain(SOURCE)
    assert kinds(again) == [ActionKind.SUBMIT_PREFILL, ActionKind.CANCEL_SOURCE]
    assert [d.attempt for d in again] == [2, 1]


def test_issue_order_holds_across_handoffs_when_cleanup_is_redelivered() -> None:
    h = Harness(cleanup_redelivery_s=1.0)
    h.subscribe(SOURCE)
    early = h.start()
    h.drain(SOURCE)
    h.registry.report_fact(early, Canceled())
    h.drain(SOURCE)  # CancelSource written, not acknowledged
    late = h.start()  # its SubmitPrefill waits in the queue
    h.clock.advance(1.0)
    h.registry.fire_due()  # CancelSource is redelivered
    batch = h.drain(SOURCE)
    assert [(d.handoff_id, d.action.kind) for d in batch] == [
        (early, ActionKind.CANCEL_SOURCE),
        (late, ActionKind.SUBMIT_PREFILL),
    ]


# --- incarnations and fencing ------------------------------------------------------


def test_a_restarted_engine_is_lost_at_once_where_its_actions_reached_it(
    caplog: pytest.LogCaptureFixture,
) -> None:
    h = Harness()
    subscribe(h, SOURCE, OLD, "s1")
    subscribe(h, DESTINATION, OLD, "d1")
    reached = h.start()
    h.drain(SOURCE)
    h.drain(DESTINATION)
    waiting = h.start()  # its SubmitPrefill never reached the old process
    with caplog.at_level(logging.WARNING, logger="handoff.registry"):
        subscribe(h, SOURCE, NEW, "s2")
    # The source lost its prefill: the handoff ends at once (nothing was asked
    # of the decode), instead of waiting out its deadline.
    assert h.registry.get(reached).core.completion is Completion.CANCELED
    assert h.phase(waiting) is Phase.ACTIVE
    assert [(d.handoff_id, d.action.kind) for d in h.drain(SOURCE)] == [
        (waiting, ActionKind.SUBMIT_PREFILL),
        (reached, ActionKind.COMPLETE),
    ]
    assert h.value("handoff_engines_lost_total", cause="restarted") == 1
    assert h.value("handoff_facts_total", kind="engine_lost", origin="server") == 1
    assert any("restarted" in r.getMessage() for r in caplog.records)


def test_a_restart_never_reopens_a_completed_handoff() -> None:
    h = Harness()
    subscribe(h, SOURCE, OLD, "s1")
    subscribe(h, DESTINATION, OLD, "d1")
    handoff_id = h.start()
    h.succeed(handoff_id)
    h.drain(SOURCE)
    h.drain(DESTINATION)
    subscribe(h, DESTINATION, NEW, "d2")
    assert h.registry.get(handoff_id).core.completion is Completion.SUCCESS
    assert h.value("handoff_reopened_total") == 0
    assert h.value("handoff_engines_lost_total", cause="restarted") == 0


def test_the_same_incarnation_resubscribing_gets_its_actions_again() -> None:
    h = Harness()
    first = subscribe(h, SOURCE, OLD, "s1")
    handoff_id = h.start()
    h.drain(SOURCE)
    h.registry.delivery.unsubscribe(first)
    subscribe(h, SOURCE, OLD, "s2")  # another session, once the first stream is gone
    (again,) = h.drain(SOURCE)
    assert (again.handoff_id, again.attempt) == (handoff_id, 2)
    assert h.phase(handoff_id) is Phase.ACTIVE


def test_the_same_session_replaces_its_own_stream() -> None:
    h = Harness()
    first = subscribe(h, SOURCE, OLD, "s1")
    h.start()
    h.drain(SOURCE)
    subscribe(h, SOURCE, OLD, "s1")  # a reconnect before the old stream was noticed gone
    assert first.closed
    assert [d.attempt for d in h.drain(SOURCE)] == [2]


def test_a_twin_is_refused_while_the_first_sidecar_is_live() -> None:
    h = Harness()
    first = subscribe(h, SOURCE, OLD, "session-one")
    with pytest.raises(Fenced, match="another sidecar \\(session session-\\)") as refused:
        subscribe(h, SOURCE, OLD, "session-two")
    assert refused.value.fence is Fence.SESSION_CONFLICT
    assert "prefill-a" in refused.value.message
    assert not first.closed  # the live one keeps its stream: no flapping
    h.registry.delivery.unsubscribe(first)
    subscribe(h, SOURCE, OLD, "session-two")  # once it is gone, the second gets in


def test_an_older_incarnation_is_refused() -> None:
    h = Harness()
    subscribe(h, SOURCE, NEW, "s2")
    with pytest.raises(Fenced, match=f"incarnation {OLD} is older than {NEW}") as refused:
        subscribe(h, SOURCE, OLD, "s1")
    assert refused.value.fence is Fence.OLDER_INCARNATION


def test_a_legacy_client_is_not_fenced() -> None:
    h = Harness()
    subscribe(h, SOURCE, NEW, "s2")
    handoff_id = h.start()
    h.drain(SOURCE)
    subscribe(h, SOURCE)  # no incarnation: replaces the stream, redelivers
    assert [d.attempt for d in h.drain(SOURCE)] == [2]
    assert h.phase(handoff_id) is Phase.ACTIVE


# --- unreachable = lost ------------------------------------------------------------


def test_a_dead_prefill_does_not_cancel_a_healthy_decode() -> None:
    """Activated, ReleaseSource outstanding, the prefill dies: the decode keeps
    the request (EngineLost, not Failed, which reopened cleanup)."""
    h = Harness(delivery_timeout_s=10.0)
    source = h.subscribe(SOURCE)
    h.subscribe(DESTINATION)
    handoff_id = h.start()
    to_transfer_completed(h, handoff_id)
    h.registry.report_outcome(handoff_id, 3, APPLIED)  # activated; ReleaseSource issued
    h.drain(SOURCE)
    h.drain(DESTINATION)
    h.registry.delivery.unsubscribe(source)
    h.advance(10.0)
    assert h.registry.get(handoff_id).core.completion is Completion.SUCCESS
    assert ActionKind.CANCEL_DESTINATION not in kinds(h.drain(DESTINATION))
    assert h.value("handoff_engines_lost_total", cause="unreachable") == 1


def test_a_decode_that_never_subscribed_owes_nothing_and_nothing_is_abandoned() -> None:
    h = Harness(cleanup_timeout_s=300.0)
    h.subscribe(SOURCE)
    handoff_id = h.start()
    h.drain(SOURCE)
    h.registry.report_outcome(handoff_id, 0, SUBMITTED)
    h.registry.report_fact(handoff_id, SourceHeld(TIMING))  # ReserveDestination, never written
    answer = h.registry.report_fact(handoff_id, Canceled())
    assert kinds(list(answer.actions)) == [ActionKind.CANCEL_SOURCE, ActionKind.CANCEL_DESTINATION]
    (cancel,) = h.drain(SOURCE)
    h.registry.report_outcome(handoff_id, cancel.action.id, APPLIED)
    assert h.registry.get(handoff_id).core.completion is Completion.CANCELED
    h.subscribe(DESTINATION)  # when it finally comes, only the notice waits for it
    assert kinds(h.drain(DESTINATION)) == [ActionKind.COMPLETE]
    h.advance(301.0)
    assert h.value("handoff_abandoned_total") == 0
    assert h.value("handoff_outcomes_total", kind="noop") == 1


def test_a_lost_side_is_not_redelivered_to() -> None:
    h = Harness(delivery_timeout_s=10.0)
    h.subscribe(SOURCE)
    destination = h.subscribe(DESTINATION)
    handoff_id = h.start()
    h.registry.report_outcome(handoff_id, 0, SUBMITTED)
    h.registry.report_fact(handoff_id, SourceHeld(TIMING))
    h.drain(DESTINATION)  # ReserveDestination written, then the decode goes
    h.registry.delivery.unsubscribe(destination)
    h.advance(10.0)
    assert h.phase(handoff_id) is not Phase.ACTIVE
    subscribe(h, DESTINATION)  # back under the same (legacy) name
    assert ActionKind.RESERVE_DESTINATION not in kinds(h.drain(DESTINATION))


# --- StartHandoff retries and abandoned handoffs ----------------------------------------


def test_a_retried_start_answers_the_handoff_as_it_is() -> None:
    h = Harness()
    handoff_id = h.start()
    h.registry.report_outcome(handoff_id, 0, SUBMITTED)
    retry = h.registry.start(StartRequest(handoff_id, Order.SOURCE_FIRST, SOURCE, DESTINATION, 5.0))
    assert retry.already_started
    assert retry.actions == ()
    assert h.value("handoff_started_total") == 1
    entry = h.registry.get(handoff_id)
    assert isinstance(entry, Entry)
    assert not entry.core.is_outstanding(0)  # nothing was issued again


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"order": Order.DESTINATION_FIRST}, "order"),
        ({"fallback_transfer_delay_ms": 6.0}, "fallback_transfer_delay_ms"),
        ({"timeout_s": 10.0}, "timeout_s"),
    ],
)
def test_a_start_with_other_parameters_names_the_field(
    change: dict[str, object], field: str
) -> None:
    h = Harness()
    handoff_id = h.start()
    fields: dict[str, object] = {
        "handoff_id": handoff_id,
        "order": Order.SOURCE_FIRST,
        "source_engine_id": SOURCE,
        "destination_engine_id": DESTINATION,
        "fallback_transfer_delay_ms": 5.0,
    }
    with pytest.raises(AlreadyExists, match=f"another {field} "):
        h.registry.start(StartRequest(**(fields | change)))  # type: ignore[arg-type]


def test_an_abandoned_handoff_is_retained_with_what_was_outstanding() -> None:
    h = Harness(cleanup_timeout_s=60.0, retention_s=600.0)
    h.subscribe(SOURCE)
    handoff_id = h.start()
    h.drain(SOURCE)
    h.registry.report_fact(handoff_id, Canceled())
    h.advance(60.0)
    entry = h.registry.get(handoff_id)
    assert entry.abandoned_at is not None
    assert [a.kind for a in entry.core.outstanding] == [
        ActionKind.SUBMIT_PREFILL,
        ActionKind.CANCEL_SOURCE,
    ]
    assert h.registry.active_count == 0
    assert h.value("handoff_handoffs", phase="cleaning_up") == 0
    retry = h.registry.start(StartRequest(handoff_id, Order.SOURCE_FIRST, SOURCE, DESTINATION, 5.0))
    assert retry.already_started
    h.advance(600.0)
    assert handoff_id not in h.registry.handoffs


def test_streamed_complete_carries_the_completion() -> None:
    h = Harness()
    h.subscribe(SOURCE)
    handoff_id = h.start()
    h.succeed(handoff_id)
    complete = h.drain(SOURCE)[-1]
    assert complete.action.kind is ActionKind.COMPLETE
    assert complete.action.completion is Completion.SUCCESS


# --- timers --------------------------------------------------------------------------


def test_a_redelivery_chain_never_forks() -> None:
    h = Harness(cleanup_redelivery_s=1.0, cleanup_timeout_s=1000.0)
    h.subscribe(SOURCE)
    handoff_id = h.start()
    h.drain(SOURCE)
    h.registry.report_fact(handoff_id, Canceled())
    h.drain(SOURCE)
    entry = h.registry.get(handoff_id)
    # The same round scheduled twice (as a duplicated firing would): one chain.
    assert isinstance(entry, Entry)
    duplicate = (entry.cleanup_epoch, 0)
    h.registry._schedule(h.clock.now + 1.0, TimerKind.REDELIVER, handoff_id, duplicate)
    for _ in range(8):
        h.advance(1.0)
        h.drain(SOURCE)
    # Rounds at 1, 3 (1 + 2) and 7 (3 + 4) s: three, not six.
    assert h.value("handoff_redeliveries_total", kind="cancel_source") == 3


def test_a_failing_timer_is_counted_and_the_others_still_fire(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    h = Harness(default_timeout_s=5.0)
    broken, healthy = h.start(), h.start()
    original = h.registry._server_fact

    def server_fact(entry: object, fact: object, reason: object) -> None:
        if getattr(entry, "handoff_id", None) == broken:
            raise RuntimeError("boom")
        original(entry, fact, reason)  # type: ignore[arg-type]

    monkeypatch.setattr(h.registry, "_server_fact", server_fact)
    with caplog.at_level(logging.ERROR, logger="handoff.registry"):
        h.advance(5.0)
    assert h.phase(healthy) is not Phase.ACTIVE
    assert h.value("handoff_timer_errors_total") == 1
    (record,) = [r for r in caplog.records if "timer failed" in r.getMessage()]
    assert getattr(record, "handoff_id") == broken  # noqa: B009


def test_new_handoff_for_a_long_dead_engine_is_lost_in_the_same_call() -> None:
    h = Harness(delivery_timeout_s=10.0)
    h.subscribe(SOURCE)
    h.registry.delivery.unsubscribe(h.subscribe(DESTINATION))
    h.start()
    h.advance(10.0)
    handoff_id = str(uuid.uuid4())
    h.registry.start(StartRequest(handoff_id, Order.SOURCE_FIRST, SOURCE, DESTINATION, 5.0))
    assert h.phase(handoff_id) is Phase.COMPLETE
    assert h.value("handoff_engines_lost_total", cause="unreachable") == 1  # counted once
