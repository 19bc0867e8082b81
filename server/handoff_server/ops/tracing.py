"""Traces: one span per handoff, a child span per action, facts as span events.

The registry reports what happens to a handoff through the small observer
interface below, unconditionally; :class:`Tracing` turns those reports into
OpenTelemetry spans, timed by the registry's own clock. With tracing off the
registry holds :data:`OFF`, whose every report does nothing, and
OpenTelemetry is never imported.

A handoff's trace state lives on its registry entry (``Entry.trace``), so it
goes where the handoff goes (retained, reopened, forgotten) and nothing here
is keyed by handoff id. A handoff reopened after SUCCESS gets a second span,
``handoff.reopened``, a child of the first (which had already ended).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, Literal

from handoff_server.domain.model import (
    Action,
    Completion,
    EngineLost,
    Fact,
    Outcome,
    OutcomeKind,
    Phase,
    TimedOut,
)

if TYPE_CHECKING:
    from opentelemetry.context import Context
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.trace import Span, SpanContext
    from opentelemetry.trace import Tracer as OtelTracer

    from handoff_server.domain.delivery import Dispatch
    from handoff_server.domain.entries import Entry
    from handoff_server.domain.retained import Retained

log = logging.getLogger("handoff.tracing")

NS = 1_000_000_000
Attempts = Callable[[], int]  # how often an action was written, asked only when traced


class HandoffTrace:
    """One handoff's spans: the open handoff span and its open action spans."""

    __slots__ = ("span", "context", "parent", "tracestate", "actions")

    def __init__(self, span: Span, parent: Context, tracestate: str) -> None:
        self.span: Span | None = span  # None once ended (complete or abandoned)
        self.context: SpanContext = span.get_span_context()  # kept after the span ends
        # The context its action spans start in, made once; dropped with the
        # span when it ends (it holds the span, and retained handoffs are many).
        self.parent: Context | None = parent
        self.tracestate = tracestate
        self.actions: dict[int, Span] = {}


class NoTracing:
    """Tracing off: every report does nothing."""

    __slots__ = ()
    on: Literal[False] = False

    @property
    def replaying(self) -> bool:
        return False

    @replaying.setter
    def replaying(self, value: bool) -> None:
        pass

    def started(self, entry: Entry, traceparent: str, tracestate: str, now: float) -> None:
        pass

    def issued(self, entry: Entry, action: Action, engines: tuple[str, ...], now: float) -> None:
        return None

    def redelivered(self, entry: Entry | Retained, dispatch: Dispatch) -> None:
        pass

    def outcome(
        self, entry: Entry, action_id: int, outcome: Outcome, attempts: Attempts, now: float
    ) -> None:
        pass

    def called(
        self,
        entry: Entry,
        fact: tuple[Fact, str] | None,
        phase_before: Phase,
        completion_before: Completion | None,
        now: float,
    ) -> None:
        pass

    def completed(self, entry: Entry, completion: Completion, now: float) -> None:
        pass

    def abandoned(self, entry: Entry, now: float) -> None:
        pass

    def exemplar(self, entry: Entry) -> None:
        return None

    def shutdown(self) -> None:
        pass


OFF = NoTracing()


class Tracing:
    """Tracing on: spans through ``provider`` (an SDK TracerProvider)."""

    on: Literal[True] = True

    def __init__(self, provider: TracerProvider) -> None:
        from opentelemetry import trace
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        self._trace = trace
        self._propagator = TraceContextTextMapPropagator()
        self._tracer: OtelTracer = provider.get_tracer("handoff_server")
        self.provider = provider
        # Set by recovery while the journal replays: spans that end then were
        # exported by the process that lived them, and are not ended again.
        self.replaying = False

    # --- the observer interface the registry reports to ----------------------

    def started(self, entry: Entry, traceparent: str, tracestate: str, now: float) -> None:
        """StartHandoff was accepted; the caller's W3C trace context, if any, is the parent."""
        carrier = {"traceparent": traceparent, "tracestate": tracestate} if traceparent else {}
        span = self._tracer.start_span(
            "handoff",
            context=self._propagator.extract(carrier),
            kind=self._trace.SpanKind.SERVER,
            start_time=_ns(now),
            attributes={
                "handoff.id": entry.handoff_id,
                "handoff.order": entry.core.order.value,
                "handoff.source_engine_id": entry.source_engine_id,
                "handoff.destination_engine_id": entry.destination_engine_id,
            },
        )
        entry.trace = HandoffTrace(span, self._trace.set_span_in_context(span), tracestate)

    def issued(
        self, entry: Entry, action: Action, engines: tuple[str, ...], now: float
    ) -> tuple[str, str]:
        """An action was issued: its span starts; returns its traceparent and tracestate."""
        trace = _trace_of(entry)
        attributes: dict[str, Any] = {
            "handoff.id": entry.handoff_id,
            "handoff.action.id": action.id,
            "handoff.action.kind": action.kind.value,
            "handoff.engine_ids": ",".join(engines),
        }
        if action.delay_ms is not None:
            attributes["handoff.action.delay_ms"] = action.delay_ms
        if action.completion is not None:
            attributes["handoff.completion"] = action.completion.value
        span = self._tracer.start_span(
            f"handoff.{action.kind.value}",
            context=trace.parent
            or self._trace.set_span_in_context(self._trace.NonRecordingSpan(trace.context)),
            start_time=_ns(now),
            attributes=attributes,
        )
        if action.completion is not None:
            # Complete is a notice: no outcome will end its span.
            self._finish(span, now)
        else:
            trace.actions[action.id] = span
        # W3C traceparent, formatted here: the propagator would build a context first.
        context = span.get_span_context()
        traceparent = f"00-{context.trace_id:032x}-{context.span_id:016x}-{context.trace_flags:02x}"
        return traceparent, trace.tracestate

    def redelivered(self, entry: Entry | Retained, dispatch: Dispatch) -> None:
        """An unacknowledged action goes out again to ``dispatch.engine_id``."""
        trace = entry.trace
        span = trace.actions.get(dispatch.action.id) if isinstance(trace, HandoffTrace) else None
        if span is not None:
            span.add_event(
                "redelivery",
                {
                    "handoff.engine_id": dispatch.engine_id,
                    "handoff.action.attempt": dispatch.attempt + 1,
                },
            )

    def outcome(
        self, entry: Entry, action_id: int, outcome: Outcome, attempts: Attempts, now: float
    ) -> None:
        """The outcome that acknowledges an action: its span ends."""
        span = _trace_of(entry).actions.pop(action_id, None)
        if span is None:
            return
        span.set_attribute("handoff.outcome", outcome.kind.value)
        span.set_attribute("handoff.action.attempts", attempts())
        if outcome.kind is OutcomeKind.FAILED:
            span.set_status(self._trace.StatusCode.ERROR, outcome.reason or "failed")
        self._finish(span, now)

    def called(
        self,
        entry: Entry,
        fact: tuple[Fact, str] | None,
        phase_before: Phase,
        completion_before: Completion | None,
        now: float,
    ) -> None:
        """A call was accepted; before its actions are routed (they are the new span's)."""
        core = entry.core
        if phase_before is Phase.COMPLETE and (
            core.phase is not phase_before or core.completion is not completion_before
        ):
            self.reopened(entry, now)
        if fact is not None:
            self.fact(entry, *fact, now)

    def fact(self, entry: Entry, fact: Fact, origin: str, now: float) -> None:
        """An accepted fact: an event on the handoff's span (``origin``: engine or server)."""
        trace = _trace_of(entry)
        if trace.span is None:
            return
        attributes: dict[str, Any] = {"handoff.fact.origin": origin}
        if isinstance(fact, EngineLost):
            attributes["handoff.fact.role"] = fact.role.value
        trace.span.add_event(fact.kind, attributes, timestamp=_ns(now))
        if isinstance(fact, TimedOut):
            trace.span.set_attribute("handoff.timed_out", True)

    def reopened(self, entry: Entry, now: float) -> None:
        """A completed handoff reopened: a new span, a child of its first one."""
        trace = _trace_of(entry)
        parent = self._trace.set_span_in_context(self._trace.NonRecordingSpan(trace.context))
        span = self._tracer.start_span(
            "handoff.reopened",
            context=parent,
            kind=self._trace.SpanKind.INTERNAL,
            start_time=_ns(now),
            attributes={"handoff.id": entry.handoff_id, "handoff.reopened": True},
        )
        entry.trace = HandoffTrace(span, self._trace.set_span_in_context(span), trace.tracestate)

    def completed(self, entry: Entry, completion: Completion, now: float) -> None:
        """The handoff completed: its span ends (actions still open end with it)."""
        trace = _trace_of(entry)
        if trace.span is None:
            return
        trace.span.set_attribute("handoff.completion", completion.value)
        if completion is Completion.CANCELED:
            trace.span.set_status(self._trace.StatusCode.ERROR, "canceled")
        self._end(trace, now, "complete")

    def abandoned(self, entry: Entry, now: float) -> None:
        """Abandoned while cleaning up: the span ends with what was left."""
        trace = _trace_of(entry)
        if trace.span is None:
            return
        trace.span.set_attribute("handoff.abandoned", True)
        trace.span.set_status(self._trace.StatusCode.ERROR, "abandoned while cleaning up")
        self._end(trace, now, "abandoned")

    def exemplar(self, entry: Entry) -> dict[str, str] | None:
        """The handoff's trace id, for a histogram observation's exemplar."""
        trace = entry.trace
        if not isinstance(trace, HandoffTrace) or not trace.context.trace_flags.sampled:
            return None
        return {"trace_id": format(trace.context.trace_id, "032x")}

    def _end(self, trace: HandoffTrace, now: float, why: str) -> None:
        assert trace.span is not None
        for span in trace.actions.values():
            # The core forgot them: no outcome will come (a lost engine's, say).
            span.set_attribute("handoff.outcome", f"none ({why})")
            self._finish(span, now)
        trace.actions.clear()
        self._finish(trace.span, now)
        trace.span = trace.parent = None

    def _finish(self, span: Span, now: float) -> None:
        # A span left unended is never exported: replayed history is not exported twice.
        if not self.replaying:
            span.end(end_time=_ns(now))

    def shutdown(self) -> None:
        """Export what is buffered and stop (the server's last step)."""
        self.provider.shutdown()


Tracer = NoTracing | Tracing


def from_settings(endpoint: str, environ: Mapping[str, str] = os.environ) -> Tracer:
    """Tracing as configured: off unless an OTLP endpoint is given.

    ``endpoint`` is ``--otlp-endpoint``; OTEL_EXPORTER_OTLP_ENDPOINT or
    OTEL_EXPORTER_OTLP_TRACES_ENDPOINT also turns it on. Every other OTEL_*
    variable (headers, certificates, OTEL_TRACES_SAMPLER, OTEL_SERVICE_NAME,
    OTEL_RESOURCE_ATTRIBUTES, OTEL_BSP_*) is the OpenTelemetry SDK's own.
    """
    endpoint = endpoint or environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "")
    endpoint = endpoint or environ.get("OTEL_EXPORTER_OTLP_ENDPOINT", "")
    if not endpoint:
        return OFF
    try:
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
    except ImportError:
        # Only the environment asked (--otlp-endpoint is checked in config).
        log.warning(
            "OTEL_EXPORTER_OTLP_ENDPOINT is set but OpenTelemetry is not installed; "
            "tracing off (pip install 'kv-handoff[server,otel]')"
        )
        return OFF
    # The SDK's default sampler follows the parent's decision (ParentBased,
    # always on for a handoff started without a trace); OTEL_TRACES_SAMPLER
    # changes it.
    resource = Resource.create(
        {"service.name": environ.get("OTEL_SERVICE_NAME", "handoff-coordinator")}
    )
    provider = TracerProvider(resource=resource)
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint)))
    return Tracing(provider)


def _trace_of(entry: Entry) -> HandoffTrace:
    trace = entry.trace
    assert isinstance(trace, HandoffTrace), "a traced registry traces every handoff it starts"
    return trace


def _ns(seconds: float) -> int:
    return int(seconds * NS)
