"""Completed handoffs are retained packed: expiry, eviction, reopening, memory."""

from __future__ import annotations

import gc
import tracemalloc
import uuid
from collections.abc import Callable

import pytest

from handoff_server.domain.entries import Entry, StartRequest
from handoff_server.domain.model import (
    Canceled,
    Completion,
    EndCause,
    EngineLost,
    NotFound,
    Order,
    Phase,
    Role,
)
from handoff_server.domain.retained import Retained
from handoff_server.service import convert
from tests.support.registry import APPLIED, DESTINATION, SOURCE, SUBMITTED, Harness


def test_retained_handoffs_share_their_engine_names() -> None:
    h = Harness()
    # As if parsed from two requests: equal names, distinct objects.
    source = "".join(["prefill-", "a"])
    ids = []
    for _ in range(2):
        handoff_id = str(uuid.uuid4())
        h.registry.start(
            StartRequest(handoff_id, Order.SOURCE_FIRST, source[:], "".join(DESTINATION), 5.0)
        )
        h.succeed(handoff_id)
        ids.append(handoff_id)
    first, second = (h.registry.get(i) for i in ids)
    assert isinstance(first, Retained)
    assert isinstance(second, Retained)
    assert first.source_engine_id is second.source_engine_id
    assert first.destination_engine_id is second.destination_engine_id


def reopen(h: Harness, handoff_id: str) -> None:
    """A terminal fact after success, then the destination's cancel acknowledged."""
    (cancel,) = h.registry.report_fact(handoff_id, Canceled()).actions
    h.registry.report_outcome(handoff_id, cancel.action.id, APPLIED)
    assert h.registry.get(handoff_id).core.completion is Completion.CANCELED


def test_a_reopened_handoff_is_retained_from_its_second_completion() -> None:
    h = Harness(retention_s=600.0)
    handoff_id = h.start()
    h.succeed(handoff_id)
    h.clock.advance(100.0)
    (cancel,) = h.registry.report_fact(handoff_id, Canceled()).actions
    assert isinstance(h.registry.get(handoff_id), Entry)
    assert h.registry.active_count == 1
    h.clock.advance(100.0)
    h.registry.report_outcome(handoff_id, cancel.action.id, APPLIED)
    assert isinstance(h.registry.get(handoff_id), Retained)
    assert h.registry.active_count == 0
    # The record of its first completion is still queued; it must not expire
    # the handoff 600 s after the first completion, only after the second.
    h.advance(400.0)
    assert h.phase(handoff_id) is Phase.COMPLETE
    h.advance(199.0)
    assert h.phase(handoff_id) is Phase.COMPLETE
    h.advance(1.0)
    with pytest.raises(NotFound):
        h.registry.get(handoff_id)
    assert not h.registry.handoffs


def test_a_lost_decode_reopens_and_completes_a_retained_handoff_in_one_call() -> None:
    h = Harness(retention_s=600.0)
    handoff_id = h.start()
    h.succeed(handoff_id)
    h.clock.advance(100.0)
    (complete,) = h.registry.report_fact(handoff_id, EngineLost(Role.DESTINATION)).actions
    assert complete.action.completion is Completion.CANCELED
    record = h.registry.get(handoff_id)
    assert isinstance(record, Retained)  # a new record, from the second completion
    assert record.core.completion is Completion.CANCELED
    assert record.completed_at == h.clock()
    assert h.registry.active_count == 0
    assert h.value("handoff_reopened_total") == 1
    assert h.value("handoff_completed_total", result="canceled") == 1
    assert h.value("handoff_handoffs", phase="complete") == 1
    assert h.value("handoff_facts_total", kind="engine_lost", origin="engine") == 1
    h.advance(599.0)
    assert h.phase(handoff_id) is Phase.COMPLETE  # retained from the second completion
    h.advance(1.0)
    with pytest.raises(NotFound):
        h.registry.get(handoff_id)


def test_eviction_skips_reopened_handoffs_and_takes_the_oldest_retained() -> None:
    h = Harness(max_retained=2)
    first, second, third = (h.start() for _ in range(3))
    h.succeed(first)
    h.succeed(second)
    (cancel,) = h.registry.report_fact(first, Canceled()).actions  # reopened: not retained
    h.succeed(third)
    assert [h.phase(i) for i in (second, third)] == [Phase.COMPLETE] * 2
    h.registry.report_outcome(first, cancel.action.id, APPLIED)  # a third retained one
    with pytest.raises(NotFound):
        h.registry.get(second)  # the oldest retained, though first completed before it
    assert [h.phase(i) for i in (first, third)] == [Phase.COMPLETE] * 2
    assert h.value("handoff_handoffs", phase="complete") == 2
    assert h.registry.active_count == 0


def test_retained_handoffs_expire_oldest_first_at_their_own_time() -> None:
    h = Harness(retention_s=10.0)
    ids = []
    for _ in range(3):
        ids.append(h.start())
        h.succeed(ids[-1])
        h.clock.advance(3.0)
    first_completed = h.clock.now - 9.0
    assert h.registry.next_wakeup() == first_completed + 10.0
    h.advance(1.0)  # 10 s after the first completed
    assert [i in h.registry.handoffs for i in ids] == [False, True, True]
    assert h.registry.next_wakeup() == first_completed + 13.0
    h.advance(5.9)
    assert [i in h.registry.handoffs for i in ids] == [False, False, True]
    h.advance(0.1)
    assert not h.registry.handoffs
    assert h.value("handoff_handoffs", phase="complete") == 0


def test_late_calls_leave_a_retained_handoff_packed_and_unchanged() -> None:
    h = Harness()
    handoff_id = h.start()
    h.succeed(handoff_id)
    record = h.registry.get(handoff_id)
    assert isinstance(record, Retained)
    before = convert.handoff(record)
    h.clock.advance(5.0)
    assert h.registry.report_outcome(handoff_id, 4, APPLIED).actions == ()
    assert h.registry.report_outcome(handoff_id, 99, APPLIED).actions == ()
    after = h.registry.get(handoff_id)
    assert isinstance(after, Retained)  # still retained, not reopened
    assert after.record() == record.record()
    assert convert.handoff(after) == before
    assert record.routed.get(4) is None  # what security.authorize_report reads


def test_a_retained_handoff_costs_a_fraction_of_a_live_one() -> None:
    h = Harness(max_retained=10_000, retention_s=86_400.0, default_timeout_s=86_400.0)
    streams = [h.subscribe(SOURCE), h.subscribe(DESTINATION)]

    def succeed(handoff_id: str) -> None:
        h.start(handoff_id)
        h.succeed(handoff_id)
        for stream in streams:
            h.registry.delivery.take(stream)  # written and dropped, as a live stream would

    for _ in range(200):  # first-use allocations: channels, metric children, endings
        succeed(str(uuid.uuid4()))
    count = 2000
    each = traced_per_handoff(count, succeed)
    # The record, its packed core, its timestamps and the registry's two
    # references to it (about 290 bytes on CPython 3.11); an active handoff,
    # measured alike, about 5 times that. Bytes differ between interpreters,
    # the proportion does not.
    live = traced_per_handoff(count, h.start)
    assert each < live / 3, (each, live)


def test_the_cyclic_collector_does_not_walk_retained_handoffs() -> None:
    """A full collection walks every object the collector tracks, holding the
    event loop meanwhile: a retained handoff must add none, or a server at
    max_retained stalls tens of ms per full collection (bench/RESULTS.md)."""
    h = Harness(max_retained=10_000, retention_s=86_400.0, default_timeout_s=86_400.0)
    streams = [h.subscribe(SOURCE), h.subscribe(DESTINATION)]

    def succeed(count: int) -> None:
        for _ in range(count):
            handoff_id = h.start()
            h.succeed(handoff_id)
            for stream in streams:
                h.registry.delivery.take(stream)  # written and dropped
        # A canceled one keeps its own reason beside the usual success.
        canceled.append(h.start())
        (cancel,) = h.registry.report_fact(canceled[-1], Canceled(), detail="client gone").actions
        h.registry.report_outcome(canceled[-1], cancel.action.id, APPLIED)
        gc.collect()

    canceled: list[str] = []
    succeed(200)  # first-use allocations: channels, metric children, endings
    before = len(gc.get_objects())
    succeed(2000)
    assert h.registry.retention.count == 2202
    assert len(gc.get_objects()) - before < 200  # was two per handoff: 4,000
    # Read back, a retained handoff is the one that completed, reasons and all.
    retained = h.registry.get(canceled[-1])
    assert isinstance(retained, Retained)
    assert retained.core.completion is Completion.CANCELED
    assert [(r.cause, r.detail) for r in retained.reasons] == [
        (EndCause.FRONTEND_CANCELED, "client gone")
    ]


def traced_per_handoff(count: int, make: Callable[[str], object]) -> float:
    ids = [str(uuid.uuid4()) for _ in range(count)]  # the caller's, not the registry's
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for handoff_id in ids:
            make(handoff_id)
        gc.collect()
        return (tracemalloc.get_traced_memory()[0] - before) / count
    finally:
        tracemalloc.stop()


def test_a_reused_id_is_not_abandoned_by_its_predecessors_cleanup_timer() -> None:
    h = Harness(max_retained=1, cleanup_timeout_s=300.0)
    handoff_id = h.start()
    h.registry.report_outcome(handoff_id, 0, SUBMITTED)  # the source has something to cancel
    (cancel,) = h.registry.report_fact(handoff_id, Canceled()).actions  # abandon timer at 300 s
    h.registry.report_outcome(handoff_id, cancel.action.id, APPLIED)
    h.succeed(h.start())  # evicts the first handoff: its id is free again
    h.advance(1.0)
    h.start(handoff_id)
    h.registry.report_outcome(handoff_id, 0, SUBMITTED)
    h.advance(249.0)
    (cancel,) = h.registry.report_fact(handoff_id, Canceled()).actions  # its own timer at 550 s
    h.advance(100.0)  # past the predecessor's 300 s
    assert h.registry.get(handoff_id).abandoned_at is None
    h.advance(200.0)
    assert h.registry.get(handoff_id).abandoned_at is not None  # after its own cleanup timeout
