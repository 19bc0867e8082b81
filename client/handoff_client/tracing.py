"""OpenTelemetry in the SDK, when the ``otel`` extra is installed; nothing otherwise.

``start_handoff`` passes the caller's current trace context to the
coordinator (W3C ``traceparent`` / ``tracestate`` in the call's metadata),
and a sidecar runs each handler in a span that is a child of the
coordinator's span for that action, so whatever the engine traces inside the
handler joins the request's trace. Spans go to the process's global
TracerProvider (the engine's own); without one they are not recorded, but
the trace context still reaches the handler's code.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from handoff_client.model import Action

try:
    from opentelemetry import propagate, trace
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
except ImportError:  # an engine image without the otel extra: tracing is off
    AVAILABLE = False
else:
    AVAILABLE = True
    _W3C = TraceContextTextMapPropagator()


def current_context_metadata() -> tuple[tuple[str, str], ...]:
    """The current trace context as gRPC metadata; empty without OpenTelemetry."""
    if not AVAILABLE:
        return ()
    carrier: dict[str, str] = {}
    propagate.inject(carrier)
    return tuple((key.lower(), value) for key, value in carrier.items())


@contextlib.contextmanager
def handler_span(action: Action) -> Iterator[None]:
    """Run an action's handler in a child span of the coordinator's action span.

    A no-op without OpenTelemetry, or when the coordinator does not trace
    (the action carries no traceparent).
    """
    if not AVAILABLE or not action.traceparent:
        yield
        return
    parent = _W3C.extract({"traceparent": action.traceparent, "tracestate": action.tracestate})
    tracer = trace.get_tracer("handoff_client")
    with tracer.start_as_current_span(
        f"handoff.{action.kind.name.lower()} handler",
        context=parent,
        kind=trace.SpanKind.CONSUMER,
        attributes={
            "handoff.id": action.handoff_id,
            "handoff.action.id": action.id,
            "handoff.action.kind": action.kind.name.lower(),
            "handoff.action.attempt": action.attempt,
            "handoff.engine_id": action.engine_id,
        },
    ):
        yield
