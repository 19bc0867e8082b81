"""The registry's time and failure rules, driven by a fake clock: no sleeping."""

from __future__ import annotations

import itertools
import logging
import uuid

import pytest

from handoff_server.domain.core import Handoff
from handoff_server.domain.entries import StartRequest
from handoff_server.domain.model import (
    ActionKind,
    AlreadyExists,
    Canceled,
    Completion,
    DestinationReserved,
    Internal,
    NotFound,
    Order,
    Outcome,
    OutcomeKind,
    Phase,
    ResourceExhausted,
    Role,
    SourceHeld,
    Unavailable,
)
from tests.support.registry import (
    APPLIED,
    DESTINATION,
    SOURCE,
    SUBMITTED,
    TIMING,
    Harness,
    kinds,
)


def test_deadline_expiry_times_out_the_handoff() -> None:
    h = Harness(default_timeout_s=5.0)
    h.subscribe(SOURCE)
    handoff_id = h.start()
    assert kinds(h.drain(SOURCE)) == [ActionKind.SUBMIT_PREFILL]
    h.advance(4.9)
    assert h.phase(handoff_id) is Phase.ACTIVE
    h.advance(0.2)
    assert h.phase(handoff_id) is Phase.CLEANING_UP
    assert kinds(h.drain(SOURCE)) == [ActionKind.CANCEL_SOURCE]
    assert h.value("handoff_timed_out_total") == 1
    assert h.value("handoff_facts_total", kind="timed_out", origin="server") == 1


def test_per_request_timeout_overrides_the_default() -> None:
    h = Harness(default_timeout_s=300.0)
    handoff_id = h.start(timeout_s=2.0)
    h.advance(1.9)
    assert h.phase(handoff_id) is Phase.ACTIVE
    h.advance(0.1)
    assert h.value("handoff_timed_out_total") == 1


def test_scheduled_transfer_extends_the_deadline() -> None:
    h = Harness(default_timeout_s=10.0)
    handoff_id = h.start()
    r = h.registry
    r.report_outcome(handoff_id, 0, Outcome(OutcomeKind.SUBMITTED))
    r.report_fact(handoff_id, SourceHeld(TIMING))
    r.report_outcome(handoff_id, 1, Outcome(OutcomeKind.ACCEPTED))
    started = r.get(handoff_id).deadline
    r.report_fact(handoff_id, DestinationReserved(1000))  # StartTransfer, 1000 ms
    assert r.get(handoff_id).deadline == pytest.approx(started + 1.0)
    h.advance(10.5)
    assert h.phase(handoff_id) is Phase.ACTIVE
    h.advance(0.6)
    assert h.phase(handoff_id) is Phase.CLEANING_UP


def test_engine_that_never_subscribes_is_lost_and_the_other_side_freed() -> None:
    h = Harness(delivery_timeout_s=10.0)
    h.subscribe(SOURCE)
    handoff_id = h.start()
    h.registry.report_outcome(handoff_id, 0, Outcome(OutcomeKind.SUBMITTED))
    h.registry.report_fact(handoff_id, SourceHeld(TIMING))  # ReserveDestination to nobody
    h.advance(9.9)
    assert h.phase(handoff_id) is Phase.ACTIVE
    h.advance(0.2)
    assert h.phase(handoff_id) is Phase.CLEANING_UP
    assert ActionKind.CANCEL_SOURCE in kinds(h.drain(SOURCE))
    assert h.value("handoff_engines_lost_total", cause="unreachable") == 1
    assert h.value("handoff_facts_total", kind="engine_lost", origin="server") == 1


def test_a_dead_engine_fails_its_handoffs_even_when_it_owes_no_action() -> None:
    # SGLang order: the prefill acknowledged SubmitPrefill, then died while
    # running it. It owes a fact, not an outcome; its decode must still be freed.
    h = Harness(delivery_timeout_s=10.0)
    h.subscribe(DESTINATION)
    source = h.subscribe(SOURCE)
    handoff_id = str(uuid.uuid4())
    h.registry.start(StartRequest(handoff_id, Order.DESTINATION_FIRST, SOURCE, DESTINATION, 5.0))
    h.registry.report_outcome(handoff_id, 0, Outcome(OutcomeKind.ACCEPTED))
    h.registry.report_fact(handoff_id, DestinationReserved(1000))
    h.registry.report_outcome(handoff_id, 1, Outcome(OutcomeKind.SUBMITTED))
    h.registry.delivery.unsubscribe(source)
    h.advance(9.9)
    assert h.phase(handoff_id) is Phase.ACTIVE
    h.advance(0.2)
    assert h.phase(handoff_id) is Phase.CLEANING_UP
    assert kinds(h.drain(DESTINATION))[-1] is ActionKind.CANCEL_DESTINATION


def test_work_for_an_engine_gone_longer_than_delivery_timeout_fails_at_once() -> None:
    h = Harness(delivery_timeout_s=10.0, retention_s=600.0)
    h.subscribe(SOURCE)
    h.registry.delivery.unsubscribe(h.subscribe(DESTINATION))
    first = h.start()
    h.advance(10.0)
    assert h.phase(first) is not Phase.ACTIVE  # nothing owed yet, lost all the same
    h.advance(300.0)  # long after its last handoff, the dead engine is still remembered
    second = h.start()
    assert h.phase(second) is not Phase.ACTIVE  # in the same call, no waiting
    h.subscribe(DESTINATION)  # it came back
    third = h.start()
    assert h.phase(third) is Phase.ACTIVE


def test_offline_engines_are_forgotten_once_nothing_hangs_on_them() -> None:
    h = Harness(delivery_timeout_s=10.0, retention_s=60.0, cleanup_timeout_s=5.0)
    h.registry.delivery.unsubscribe(h.subscribe("decode-idle"))
    assert "decode-idle" not in h.registry.delivery  # nothing hung on it
    h.registry.delivery.unsubscribe(h.subscribe(DESTINATION))
    h.start()  # the destination never comes back: lost
    h.advance(10.0)
    assert h.registry.active_count == 0
    assert DESTINATION in h.registry.delivery  # remembered as dead
    h.advance(60.0)
    assert DESTINATION not in h.registry.delivery


def test_resubscribing_redelivers_unacknowledged_actions_with_attempt_counts() -> None:
    h = Harness()
    first = h.subscribe(SOURCE)
    handoff_id = h.start()
    (sent,) = h.drain(SOURCE)
    assert sent.attempt == 1
    second = h.subscribe(SOURCE)
    assert first.closed
    assert h.registry.delivery.take(first) is None  # the replaced stream ends
    (again,) = h.drain(SOURCE)
    assert (again.action.id, again.attempt) == (sent.action.id, 2)
    h.registry.report_outcome(handoff_id, 0, Outcome(OutcomeKind.SUBMITTED))
    h.registry.delivery.unsubscribe(second)
    h.subscribe(SOURCE)
    assert h.drain(SOURCE) == []  # acknowledged actions are never re-sent
    assert h.value("handoff_redeliveries_total", kind="submit_prefill") == 1


def test_actions_queue_for_an_engine_that_has_not_subscribed_yet() -> None:
    h = Harness()
    h.start()
    h.subscribe(SOURCE)
    assert kinds(h.drain(SOURCE)) == [ActionKind.SUBMIT_PREFILL]


def test_complete_goes_to_both_engines() -> None:
    h = Harness()
    h.subscribe(SOURCE)
    h.subscribe(DESTINATION)
    handoff_id = h.start()
    h.succeed(handoff_id)
    assert kinds(h.drain(SOURCE))[-1] is ActionKind.COMPLETE
    assert kinds(h.drain(DESTINATION))[-1] is ActionKind.COMPLETE


def test_transfer_goes_to_the_configured_executor() -> None:
    h = Harness()
    h.subscribe(DESTINATION)
    handoff_id = h.start(transfer_executor=Role.DESTINATION)
    h.registry.report_outcome(handoff_id, 0, Outcome(OutcomeKind.SUBMITTED))
    h.registry.report_fact(handoff_id, SourceHeld(TIMING))
    h.registry.report_outcome(handoff_id, 1, Outcome(OutcomeKind.ACCEPTED))
    h.registry.report_fact(handoff_id, DestinationReserved(1000))
    # ReserveDestination was acknowledged before the stream wrote it: never sent.
    assert kinds(h.drain(DESTINATION)) == [ActionKind.START_TRANSFER]


def test_unacknowledged_cleanup_is_redelivered_with_backoff_then_abandoned(
    caplog: pytest.LogCaptureFixture,
) -> None:
    h = Harness(cleanup_redelivery_s=1.0, cleanup_timeout_s=60.0)
    h.subscribe(SOURCE)
    handoff_id = h.start()
    assert kinds(h.drain(SOURCE)) == [ActionKind.SUBMIT_PREFILL]
    h.registry.report_fact(handoff_id, Canceled())
    assert kinds(h.drain(SOURCE)) == [ActionKind.CANCEL_SOURCE]
    resent_at = []
    for _ in range(40):
        h.advance(0.5)
        batch = h.drain(SOURCE)
        if batch:
            assert kinds(batch) == [ActionKind.CANCEL_SOURCE]
            resent_at.append(h.clock.now)
    gaps = [round(b - a, 1) for a, b in itertools.pairwise(resent_at)]
    assert gaps[:3] == [2.0, 4.0, 8.0]  # 1 s, then doubling
    with caplog.at_level(logging.ERROR, logger="handoff.registry"):
        h.advance(60.0)
    assert h.registry.get(handoff_id).abandoned_at is not None  # retained, to say so
    with pytest.raises(NotFound, match="abandoned"):
        h.registry.report_outcome(handoff_id, 1, APPLIED)
    assert h.value("handoff_abandoned_total") == 1
    assert h.registry.active_count == 0
    (record,) = [r for r in caplog.records if "abandoning" in r.getMessage()]
    assert "cancel_source#1 to prefill-a" in record.getMessage()
    assert getattr(record, "handoff_id") == handoff_id  # noqa: B009


def test_a_burst_of_abandonments_is_one_line_then_one_summary(
    caplog: pytest.LogCaptureFixture,
) -> None:
    h = Harness(cleanup_redelivery_s=100.0, cleanup_timeout_s=60.0)
    handoff_ids = [h.start() for _ in range(50)]
    for handoff_id in handoff_ids:
        h.registry.report_outcome(handoff_id, 0, SUBMITTED)  # the prefill holds something
        h.registry.report_fact(handoff_id, Canceled())  # nobody acknowledges the cancels
    with caplog.at_level(logging.ERROR, logger="handoff.registry"):
        h.advance(60.0)  # all fifty abandoned at once
        assert h.value("handoff_abandoned_total") == 50
        (first,) = [r.getMessage() for r in caplog.records]
        assert first.startswith("abandoning handoff still cleaning up after 60 s")
        # The summary is owed a second later, and the timer loop wakes for it.
        assert h.registry.next_wakeup() == h.clock.now + 1.0
        h.advance(1.0)
    assert [r.getMessage() for r in caplog.records] == [
        first,
        f"49 more handoffs abandoned in the 1 s after the first "
        f"({handoff_ids[1]}, {handoff_ids[2]}, {handoff_ids[3]}, ...)",
    ]
    assert all(r.levelno == logging.ERROR for r in caplog.records)


def test_a_cancellation_is_logged_with_its_reason_and_a_success_only_at_debug(
    caplog: pytest.LogCaptureFixture,
) -> None:
    h = Harness()
    succeeded, canceled = h.start(), h.start()
    with caplog.at_level(logging.INFO, logger="handoff.registry"):
        h.succeed(succeeded)
        h.registry.report_fact(canceled, Canceled(), detail="client went away")
        h.registry.report_outcome(canceled, 0, SUBMITTED)  # the prefill's cancel is
        h.registry.report_outcome(canceled, 1, APPLIED)  # acknowledged: complete
    assert h.registry.get(succeeded).core.completion is Completion.SUCCESS
    assert h.registry.get(canceled).core.completion is Completion.CANCELED
    (record,) = caplog.records
    assert record.levelno == logging.INFO
    assert record.getMessage() == (
        "handoff complete: canceled (frontend_canceled: 'client went away')"
    )
    assert getattr(record, "handoff_id") == canceled  # noqa: B009
    caplog.clear()
    with caplog.at_level(logging.DEBUG, logger="handoff.registry"):
        h.succeed(h.start())
    assert [r.getMessage() for r in caplog.records if "complete" in r.getMessage()] == [
        "handoff complete: success"
    ]


def test_retention_answers_late_reports_and_blocks_id_reuse_until_it_expires() -> None:
    h = Harness(retention_s=600.0)
    handoff_id = h.start()
    h.succeed(handoff_id)
    assert h.registry.report_outcome(handoff_id, 4, APPLIED).actions == ()  # late duplicate
    with pytest.raises(AlreadyExists, match="another destination_engine_id"):
        h.registry.start(StartRequest(handoff_id, Order.SOURCE_FIRST, SOURCE, "other", 5.0))
    h.advance(599.0)
    assert h.phase(handoff_id) is Phase.COMPLETE
    h.advance(1.0)
    with pytest.raises(NotFound):
        h.registry.get(handoff_id)
    h.start(handoff_id)  # the id is free again


def test_retention_is_bounded_oldest_first() -> None:
    h = Harness(max_retained=2)
    ids = [h.start() for _ in range(3)]
    for handoff_id in ids:
        h.succeed(handoff_id)
    with pytest.raises(NotFound):
        h.registry.get(ids[0])
    assert [h.phase(i) for i in ids[1:]] == [Phase.COMPLETE, Phase.COMPLETE]


def test_terminal_fact_after_success_reopens_and_leaves_retention_until_done() -> None:
    h = Harness()
    h.subscribe(DESTINATION)
    handoff_id = h.start()
    h.succeed(handoff_id)
    h.drain(DESTINATION)
    answer = h.registry.report_fact(handoff_id, Canceled())
    assert kinds(list(answer.actions)) == [ActionKind.CANCEL_DESTINATION]
    assert h.registry.active_count == 1
    assert h.value("handoff_reopened_total") == 1
    (cancel,) = h.drain(DESTINATION)
    h.registry.report_outcome(handoff_id, cancel.action.id, APPLIED)
    assert h.registry.get(handoff_id).core.completion is Completion.CANCELED
    assert h.value("handoff_completed_total", result="success") == 1
    assert h.value("handoff_completed_total", result="canceled") == 1


def test_admission_limit() -> None:
    h = Harness(max_active_handoffs=2)
    first = h.start()
    h.start()
    with pytest.raises(ResourceExhausted, match="limit is 2"):
        h.start()
    h.succeed(first)
    h.start()  # a completed handoff no longer counts


def test_per_engine_queue_limit() -> None:
    h = Harness(max_queued_actions_per_engine=2)
    h.start()
    h.start()
    with pytest.raises(ResourceExhausted, match="engine prefill-a has 2 undelivered actions"):
        h.start()
    h.subscribe(SOURCE)
    h.drain(SOURCE)
    h.start()


def test_draining_refuses_new_handoffs() -> None:
    h = Harness()
    h.registry.draining = True
    with pytest.raises(Unavailable):
        h.start()


def test_unexpected_failure_restores_the_handoff(monkeypatch: pytest.MonkeyPatch) -> None:
    h = Harness()
    handoff_id = h.start()
    before = h.registry.get(handoff_id).core.snapshot()

    def half_done(self: Handoff, fact: object) -> None:
        self._phase = Phase.CLEANING_UP  # a bug that mutates, then crashes
        raise RuntimeError("boom")

    monkeypatch.setattr(Handoff, "apply_fact", half_done)
    with pytest.raises(Internal):
        h.registry.report_fact(handoff_id, Canceled())
    monkeypatch.undo()
    assert h.registry.get(handoff_id).core.snapshot() == before


def test_timers_of_finished_handoffs_do_not_accumulate() -> None:
    h = Harness(retention_s=1.0)
    for _ in range(3000):
        h.succeed(h.start())
        h.advance(0.01)
    h.advance(2.0)
    assert len(h.registry.handoffs) == 0
    assert len(h.registry._timers) < 2 * 1024 + 10
