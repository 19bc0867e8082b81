"""The coordinator's spans, on a fake-clock registry and the SDK's in-memory exporter.

One span per handoff (parent: the caller's context), a child per action from
issue to outcome, facts as events on the handoff span, a second span for a
reopened handoff; timed by the registry's clock.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import pytest
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode

from handoff_server.domain.delivery import Dispatch
from handoff_server.domain.entries import StartRequest
from handoff_server.domain.model import (
    ActionKind,
    Canceled,
    DestinationReserved,
    EngineLost,
    Fact,
    Failed,
    Order,
    Outcome,
    OutcomeKind,
    Role,
    SourceHeld,
    TransferCompleted,
)
from handoff_server.domain.registry import Registry
from handoff_server.domain.retained import Retained
from handoff_server.durability.journal import Journal
from handoff_server.durability.records import JournalRecorder
from handoff_server.durability.recovery import ReplayClock, recover
from handoff_server.ops.tracing import HandoffTrace, Tracing
from tests.support.registry import DESTINATION, SOURCE, TIMING, Harness

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
CALLER_SPAN = "00f067aa0ba902b7"
CALLER = f"00-{TRACE_ID}-{CALLER_SPAN}-01"
EXPECTED = {
    ActionKind.SUBMIT_PREFILL: OutcomeKind.SUBMITTED,
    ActionKind.RESERVE_DESTINATION: OutcomeKind.ACCEPTED,
    ActionKind.START_TRANSFER: OutcomeKind.SCHEDULED,
    ActionKind.ACTIVATE_DESTINATION: OutcomeKind.APPLIED,
    ActionKind.RELEASE_SOURCE: OutcomeKind.APPLIED,
    ActionKind.CANCEL_SOURCE: OutcomeKind.APPLIED,
    ActionKind.CANCEL_DESTINATION: OutcomeKind.APPLIED,
}
FACTS: dict[Order, list[Fact]] = {
    Order.SOURCE_FIRST: [SourceHeld(TIMING), DestinationReserved(1000), TransferCompleted()],
    Order.DESTINATION_FIRST: [DestinationReserved(1000), SourceHeld(TIMING), TransferCompleted()],
}
EVENT = {
    SourceHeld: "source_held",
    DestinationReserved: "destination_reserved",
    TransferCompleted: "transfer_completed",
}


class Traced(Harness):
    """The registry harness with tracing on, into an in-memory exporter."""

    def __init__(self, **overrides: object) -> None:
        super().__init__(**overrides)
        self.exporter = InMemorySpanExporter()
        provider = TracerProvider()
        provider.add_span_processor(SimpleSpanProcessor(self.exporter))
        self.tracer = Tracing(provider)
        self.registry = Registry(
            self.registry.settings, self.metrics, self.clock, tracer=self.tracer
        )

    def begin(self, order: Order = Order.SOURCE_FIRST, traceparent: str = CALLER) -> str:
        self.handoff_id = "7d444840-9dc0-11d1-b245-5ffdce74fad2"
        result = self.registry.start(
            StartRequest(
                self.handoff_id,
                order,
                SOURCE,
                DESTINATION,
                5.0,
                trace_context=(("traceparent", traceparent),),
            )
        )
        self.pending = list(result.actions)
        return self.handoff_id

    def fact(self, fact: Fact) -> None:
        self.clock.advance(0.1)
        self.pending += self.registry.report_fact(self.handoff_id, fact).actions

    def run_to_success(self, order: Order = Order.SOURCE_FIRST) -> None:
        """After begin: every action acknowledged and every fact of a success reported."""
        self.ack_all()
        for fact in FACTS[order]:
            self.fact(fact)
            self.ack_all()

    def ack_all(self) -> None:
        """Every issued action gets its expected outcome, 0.1 s apart, until none is left."""
        while self.pending:
            dispatch = self.pending.pop(0)
            if dispatch.action.kind is ActionKind.COMPLETE:
                continue
            self.clock.advance(0.1)
            outcome = Outcome(EXPECTED[dispatch.action.kind])
            result = self.registry.report_outcome(self.handoff_id, dispatch.action.id, outcome)
            self.pending += result.actions

    def spans(self) -> dict[str, ReadableSpan]:
        """Finished spans by name; each name once."""
        finished = self.exporter.get_finished_spans()
        by_name = {span.name: span for span in finished}
        assert len(by_name) == len(finished), [s.name for s in finished]
        return by_name


def _hex(value: int, width: int) -> str:
    return format(value, f"0{width}x")


def _parent_id(span: ReadableSpan) -> str | None:
    return None if span.parent is None else _hex(span.parent.span_id, 16)


def _span_id(span: ReadableSpan) -> str:
    assert span.context is not None
    return _hex(span.context.span_id, 16)


def _trace_id(span: ReadableSpan) -> str:
    assert span.context is not None
    return _hex(span.context.trace_id, 32)


def _action_names(kinds: Sequence[ActionKind]) -> list[str]:
    return [f"handoff.{kind.value}" for kind in kinds]


@pytest.mark.parametrize("order", list(Order))
def test_a_success_is_one_handoff_span_with_a_child_per_action_in_issue_order(
    order: Order,
) -> None:
    h = Traced()
    started_at = h.clock.now
    h.begin(order)
    h.run_to_success(order)
    spans = h.spans()
    handoff = spans.pop("handoff")
    assert _trace_id(handoff) == TRACE_ID
    assert _parent_id(handoff) == CALLER_SPAN
    assert handoff.parent is not None
    assert handoff.parent.is_remote
    assert handoff.attributes == {
        "handoff.id": h.handoff_id,
        "handoff.order": order.value,
        "handoff.source_engine_id": SOURCE,
        "handoff.destination_engine_id": DESTINATION,
        "handoff.completion": "success",
    }
    assert handoff.status.status_code is StatusCode.UNSET
    assert handoff.start_time == int(started_at * 1e9)
    assert handoff.end_time == int(h.clock.now * 1e9)
    assert [(e.name, dict(e.attributes or {})) for e in handoff.events] == [
        (EVENT[type(f)], {"handoff.fact.origin": "engine"}) for f in FACTS[order]
    ]
    first = (
        ActionKind.SUBMIT_PREFILL if order is Order.SOURCE_FIRST else ActionKind.RESERVE_DESTINATION
    )
    actions = sorted(spans.values(), key=lambda s: s.start_time or 0)
    assert [s.name for s in actions][:1] == _action_names([first])
    assert sorted(s.name for s in actions) == sorted(
        _action_names(
            [
                ActionKind.SUBMIT_PREFILL,
                ActionKind.RESERVE_DESTINATION,
                ActionKind.START_TRANSFER,
                ActionKind.ACTIVATE_DESTINATION,
                ActionKind.RELEASE_SOURCE,
                ActionKind.COMPLETE,
            ]
        )
    )
    assert handoff.start_time is not None
    assert handoff.end_time is not None
    previous_start = handoff.start_time
    for span in actions:
        assert _trace_id(span) == TRACE_ID
        assert _parent_id(span) == _span_id(handoff)
        assert span.start_time is not None
        assert span.end_time is not None
        # Issued in order, each within the handoff; an outcome ends it.
        assert previous_start <= span.start_time <= span.end_time <= handoff.end_time
        previous_start = span.start_time
        assert span.attributes is not None
        if span.name == "handoff.complete":
            assert span.attributes["handoff.completion"] == "success"
            assert span.start_time == span.end_time == handoff.end_time
        else:
            kind = ActionKind(str(span.attributes["handoff.action.kind"]))
            assert span.attributes["handoff.outcome"] == EXPECTED[kind].value
            assert span.attributes["handoff.action.attempts"] == 0  # answered by RPC
            assert span.end_time > span.start_time


def test_fact_events_name_the_fact_and_its_origin() -> None:
    h = Traced()
    h.begin()
    h.ack_all()
    h.fact(SourceHeld(TIMING))
    h.clock.advance(1.0)
    h.fact(Canceled())
    h.ack_all()
    handoff = h.spans()["handoff"]
    assert [(e.name, dict(e.attributes or {})) for e in handoff.events] == [
        ("source_held", {"handoff.fact.origin": "engine"}),
        ("canceled", {"handoff.fact.origin": "engine"}),
    ]
    held, canceled = handoff.events
    assert held.timestamp < canceled.timestamp


def test_a_cancel_mid_transfer_cleans_up_both_sides_under_the_handoff_span() -> None:
    h = Traced()
    h.begin()
    h.ack_all()
    h.fact(SourceHeld(TIMING))
    h.ack_all()
    h.fact(DestinationReserved(1000))
    h.ack_all()  # StartTransfer scheduled: the KV is moving
    h.fact(Canceled())
    h.ack_all()
    spans = h.spans()
    handoff = spans["handoff"]
    assert handoff.attributes is not None
    assert handoff.attributes["handoff.completion"] == "canceled"
    assert handoff.status.status_code is StatusCode.ERROR
    assert [e.name for e in handoff.events][-1] == "canceled"
    canceled_at = handoff.events[-1].timestamp
    for name in ("handoff.cancel_source", "handoff.cancel_destination"):
        span = spans[name]
        assert _parent_id(span) == _span_id(handoff)
        assert span.start_time == canceled_at  # issued by the Canceled fact
        assert span.attributes is not None
        assert span.attributes["handoff.outcome"] == "applied"
    transfer = spans["handoff.start_transfer"]
    assert transfer.end_time is not None
    assert transfer.end_time < canceled_at
    complete = spans["handoff.complete"]
    assert complete.attributes is not None
    assert complete.attributes["handoff.completion"] == "canceled"


def test_a_reopened_success_gets_a_second_span_under_the_first() -> None:
    h = Traced()
    h.begin()
    h.run_to_success()
    h.clock.advance(2.0)
    h.fact(Failed())  # correction 1: reopens cleanup
    h.ack_all()
    finished = h.exporter.get_finished_spans()
    handoff = next(s for s in finished if s.name == "handoff")
    reopened = next(s for s in finished if s.name == "handoff.reopened")
    assert handoff.attributes is not None
    assert reopened.attributes is not None
    assert handoff.attributes["handoff.completion"] == "success"
    assert _parent_id(reopened) == _span_id(handoff)
    assert _trace_id(reopened) == TRACE_ID
    assert reopened.attributes["handoff.reopened"] is True
    assert reopened.attributes["handoff.completion"] == "canceled"
    assert handoff.end_time is not None
    assert reopened.start_time is not None
    assert handoff.end_time < reopened.start_time
    assert [e.name for e in reopened.events] == ["failed"]
    under_reopened = [s.name for s in finished if _parent_id(s) == _span_id(reopened)]
    assert under_reopened == ["handoff.cancel_destination", "handoff.complete"]
    completes = [s for s in finished if s.name == "handoff.complete"]
    assert [_parent_id(s) for s in completes] == [_span_id(handoff), _span_id(reopened)]


def test_a_lost_engine_ends_its_unanswered_action_with_the_handoff() -> None:
    h = Traced()
    h.begin()
    h.ack_all()
    h.fact(SourceHeld(TIMING))
    reserve = h.pending.pop()  # ReserveDestination: the decode dies before answering
    assert reserve.action.kind is ActionKind.RESERVE_DESTINATION
    h.fact(EngineLost(Role.DESTINATION))
    h.ack_all()
    spans = h.spans()
    handoff = spans["handoff"]
    assert handoff.attributes is not None
    assert handoff.attributes["handoff.completion"] == "canceled"
    lost = handoff.events[-1]
    assert lost.name == "engine_lost"
    assert dict(lost.attributes or {}) == {
        "handoff.fact.origin": "engine",
        "handoff.fact.role": "destination",
    }
    unanswered = spans["handoff.reserve_destination"]
    assert unanswered.attributes is not None
    assert unanswered.attributes["handoff.outcome"] == "none (complete)"
    assert unanswered.end_time == handoff.end_time
    cancel = spans["handoff.cancel_source"]
    assert cancel.start_time == lost.timestamp
    assert "handoff.cancel_destination" not in spans  # a lost engine owes nothing


def test_server_facts_and_redeliveries_are_in_the_trace() -> None:
    h = Traced(cleanup_redelivery_s=1.0, cleanup_timeout_s=10.0)
    h.subscribe(SOURCE)
    h.begin(traceparent="")
    h.drain(SOURCE)  # SubmitPrefill written once, never answered
    h.subscribe(SOURCE)  # the engine reconnects: redelivered
    h.drain(SOURCE)
    h.clock.advance(0.5)
    h.registry.report_outcome(h.handoff_id, 0, Outcome(OutcomeKind.SUBMITTED))
    h.advance(400.0)  # past the 300 s deadline: the server reports TimedOut
    h.drain(SOURCE)  # CancelSource written, never answered
    h.advance(10.0)  # redelivered, then abandoned
    spans = h.spans()
    handoff = spans["handoff"]
    assert handoff.parent is None  # no caller context: a trace of its own
    assert handoff.attributes is not None
    assert handoff.attributes["handoff.timed_out"] is True
    assert handoff.attributes["handoff.abandoned"] is True
    assert handoff.status.status_code is StatusCode.ERROR
    assert [(e.name, dict(e.attributes or {})) for e in handoff.events] == [
        ("timed_out", {"handoff.fact.origin": "server"})
    ]
    submit = spans["handoff.submit_prefill"]
    assert submit.attributes is not None
    assert submit.attributes["handoff.action.attempts"] == 2
    assert [(e.name, dict(e.attributes or {})) for e in submit.events] == [
        ("redelivery", {"handoff.engine_id": SOURCE, "handoff.action.attempt": 2})
    ]
    cancel = spans["handoff.cancel_source"]
    assert cancel.attributes is not None
    assert cancel.attributes["handoff.outcome"] == "none (abandoned)"
    assert [e.name for e in cancel.events][:1] == ["redelivery"]


def test_actions_carry_their_span_and_the_callers_tracestate() -> None:
    h = Traced()
    h.handoff_id = "0b0e7c62-0f6f-4d0b-9c87-1f6b3a0c2d11"
    result = h.registry.start(
        StartRequest(
            h.handoff_id,
            Order.SOURCE_FIRST,
            SOURCE,
            DESTINATION,
            5.0,
            trace_context=(("traceparent", CALLER), ("tracestate", "vendor=abc")),
        )
    )
    (submit,) = result.actions
    h.subscribe(SOURCE)
    (written,) = h.drain(SOURCE)
    assert submit.trace is not None
    assert written.trace == submit.trace
    traceparent, tracestate = submit.trace
    version, trace_id, span_id, flags = traceparent.split("-")
    assert (version, trace_id, flags) == ("00", TRACE_ID, "01")
    assert tracestate == "vendor=abc"
    h.registry.report_outcome(h.handoff_id, 0, Outcome(OutcomeKind.SUBMITTED))
    assert _span_id(h.spans()["handoff.submit_prefill"]) == span_id


def test_sampling_follows_the_callers_decision() -> None:
    h = Traced()
    h.begin(traceparent=f"00-{TRACE_ID}-{CALLER_SPAN}-00")  # not sampled upstream
    (submit,) = h.pending
    h.run_to_success()
    assert h.exporter.get_finished_spans() == ()
    assert isinstance(submit, Dispatch)
    assert submit.trace is not None
    assert submit.trace[0].startswith(f"00-{TRACE_ID}-")
    assert submit.trace[0].endswith("-00")


def test_latency_and_duration_histograms_carry_the_trace_id_as_exemplar() -> None:
    h = Traced()
    h.begin()
    h.run_to_success()
    exemplars = {
        sample.name: sample.exemplar.labels
        for metric in h.metrics.registry.collect()
        for sample in metric.samples
        if sample.exemplar is not None
    }
    assert exemplars["handoff_duration_seconds_bucket"] == {"trace_id": TRACE_ID}
    assert any(
        name.startswith("handoff_action_latency") and labels == {"trace_id": TRACE_ID}
        for name, labels in exemplars.items()
    )


def test_tracing_off_registry_sets_no_trace_on_actions() -> None:
    h = Harness()
    (submit,) = h.registry.start(
        StartRequest(
            "3f0a2b1c-1111-4222-8333-944455556666",
            Order.SOURCE_FIRST,
            SOURCE,
            DESTINATION,
            5.0,
            trace_context=(("traceparent", CALLER),),
        )
    ).actions
    assert submit.trace is None
    assert not h.registry.tracer.on


def test_a_malformed_traceparent_starts_a_trace_of_its_own() -> None:
    h = Traced()
    h.begin(traceparent="00-not-a-trace-01")
    h.run_to_success()
    handoff = h.spans()["handoff"]
    assert handoff.parent is None
    assert _trace_id(handoff) != TRACE_ID


def test_a_retained_handoff_keeps_its_trace_context_and_no_span() -> None:
    h = Traced()
    h.begin()
    h.run_to_success()
    retained = h.registry.get(h.handoff_id)
    assert isinstance(retained, Retained)
    trace = retained.trace
    assert isinstance(trace, HandoffTrace)
    # Up to max_retained of these: the ended span and its context are let go.
    assert (trace.span, trace.parent, trace.actions) == (None, None, {})
    assert format(trace.context.span_id, "016x") == _span_id(h.spans()["handoff"])


def test_a_recovered_handoff_keeps_its_callers_trace(tmp_path: Path) -> None:
    """The journal keeps the caller's trace context: replay starts the handoff's
    span under it again, exports nothing the crashed process had exported, and
    the actions redelivered after recovery carry the caller's trace."""
    h = Traced()
    journal = Journal.open(tmp_path)
    h.registry.recorder = JournalRecorder(journal)
    handoff_id = h.begin()
    h.ack_all()  # SubmitPrefill's span ends, exported by this process
    h.fact(SourceHeld(TIMING))  # ReserveDestination issued, never acknowledged
    assert [span.name for span in h.exporter.get_finished_spans()] == ["handoff.submit_prefill"]
    journal.commit_now()
    journal.close_now()  # a crash: only the file survives

    after = Traced()
    replay_clock = ReplayClock(after.clock)
    after.registry = Registry(
        after.registry.settings, after.metrics, replay_clock, tracer=after.tracer
    )
    second = Journal.open(tmp_path)
    try:
        assert recover(second, after.registry, replay_clock).total == 1
        assert after.exporter.get_finished_spans() == ()  # nothing exported twice
        trace = after.registry.get(handoff_id).trace
        assert isinstance(trace, HandoffTrace)
        assert _hex(trace.context.trace_id, 32) == TRACE_ID
        subscription = after.registry.subscribe(DESTINATION, lambda: None)
        (reserve,) = after.registry.delivery.take(subscription) or []
        assert reserve.action.kind is ActionKind.RESERVE_DESTINATION
        assert reserve.trace is not None
        assert reserve.trace[0].split("-")[1] == TRACE_ID
        after.registry.report_outcome(handoff_id, reserve.action.id, Outcome(OutcomeKind.ACCEPTED))
        (span,) = after.exporter.get_finished_spans()
        assert span.name == "handoff.reserve_destination"
        assert _trace_id(span) == TRACE_ID
        assert span.attributes is not None
        assert span.attributes["handoff.outcome"] == "accepted"
    finally:
        second.close_now()
