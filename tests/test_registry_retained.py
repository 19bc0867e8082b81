"""Completed handoffs are retained packed, and answer every call as they did in full."""

from __future__ import annotations

import gc
import tracemalloc
import uuid

import pytest

from handoff.v1 import coordinator_pb2 as pb
from handoff_server import convert
from handoff_server.conformance import Answer, StartStep, Vector, mismatch
from handoff_server.model import (
    Canceled,
    Completion,
    HandoffError,
    NotFound,
    Order,
    Phase,
)
from handoff_server.registry import CallResult, Entry, Retained, StartRequest
from tests.support import all_vectors
from tests.test_registry import APPLIED, DESTINATION, SOURCE, Harness


def replay(h: Harness, vector: Vector) -> str | None:
    """One vector through the registry. Once the handoff completes, what GetHandoff
    shows must stay what the full entry showed when it completed."""
    handoff_id = vector.handoff_id
    shown_at_completion: pb.Handoff | None = None
    for index, step in enumerate(vector.steps):
        h.clock.advance(0.001)
        result: CallResult | None = None
        try:
            if isinstance(step, StartStep):
                result = h.registry.start(
                    StartRequest(
                        handoff_id, step.order, SOURCE, DESTINATION, step.fallback_transfer_delay_ms
                    )
                )
            elif hasattr(step, "fact"):
                result = h.registry.report_fact(handoff_id, step.fact)
            else:
                result = h.registry.report_outcome(handoff_id, step.action_id, step.outcome)
            error: HandoffError | None = None
        except HandoffError as rejected:
            error = rejected
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
        if known.core.phase is not Phase.COMPLETE:
            assert isinstance(known, Entry)
            shown_at_completion = None
        else:
            assert isinstance(known, Retained)
            if shown_at_completion is None:
                # The call that completed it answered from the full entry.
                assert result is not None
                shown_at_completion = convert.handoff(result.entry)
            if convert.handoff(known) != shown_at_completion:
                reason = "the retained handoff shows something else than it did in full"
            if result is not None and convert.handoff(result.entry) != shown_at_completion:
                reason = "a call on the retained handoff answered something else"
        if reason is not None:
            return f"{vector.name} step {index}: {reason}"
    return None


def test_every_vector_answers_the_same_once_its_handoff_is_retained() -> None:
    h = Harness(max_retained=10_000)
    h.subscribe(SOURCE)
    h.subscribe(DESTINATION)
    failures = [f for v in all_vectors() if (f := replay(h, v)) is not None]
    assert failures == []
    retained = [e for e in h.registry.handoffs.values() if isinstance(e, Retained)]
    assert len(retained) > 1000
    assert h.registry.active_count == len(h.registry.handoffs) - len(retained)


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
    assert h.registry.get(handoff_id) is record
    assert convert.handoff(record) == before
    assert record.routed.get(4) is None  # what security.authorize_report reads


def test_a_retained_handoff_costs_a_fraction_of_a_live_one() -> None:
    h = Harness(max_retained=10_000, retention_s=86_400.0, default_timeout_s=86_400.0)
    streams = [h.subscribe(SOURCE), h.subscribe(DESTINATION)]

    def succeed(handoff_id: str) -> None:
        h.start(handoff_id)
        h.succeed(handoff_id)
        for stream in streams:
            h.registry.take(stream)  # written and dropped, as a live stream would

    for _ in range(200):  # first-use allocations: channels, metric children, endings
        succeed(str(uuid.uuid4()))
    count = 2000
    ids = [str(uuid.uuid4()) for _ in range(count)]  # the caller's, not the registry's
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for handoff_id in ids:
            succeed(handoff_id)
        gc.collect()
        each = (tracemalloc.get_traced_memory()[0] - before) / count
    finally:
        tracemalloc.stop()
    # The record, its packed core, its timestamps and the registry's two
    # references to it (about 290 bytes); in full it was about 1,350.
    assert each < 400
