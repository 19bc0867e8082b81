"""One trace from the caller through a real coordinator to both engines' handlers.

A real server on loopback and real sidecars (both transports). The caller,
the coordinator and the sidecars share one in-memory exporter: the SDK's
spans go to OpenTelemetry's global provider, the coordinator's to a Tracing
on the same provider.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanContext

from handoff_client import (
    Action,
    ActionKind,
    Facts,
    HandoffClient,
    Outcome,
    OutcomeKind,
    TransportKind,
)
from handoff_client.transport import TRANSPORT_KINDS
from handoff_server.ops import tracing
from handoff_server.ops.config import Settings
from handoff_server.service.app import Server
from tests.support.servers import LOOPBACK
from tests.support.sidecar import DESTINATION, SOURCE, TIMEOUT_S, ScriptedEngine, running, start


class Ended(SpanProcessor):
    """Wakes a waiting test each time a span ends (spans end on the event loop here)."""

    def __init__(self) -> None:
        self.event = asyncio.Event()

    def on_end(self, span: ReadableSpan) -> None:
        self.event.set()


EXPORTER = InMemorySpanExporter()
ENDED = Ended()
PROVIDER = TracerProvider()
PROVIDER.add_span_processor(SimpleSpanProcessor(EXPORTER))
PROVIDER.add_span_processor(ENDED)
# The global provider can be set once per process; the sidecars' spans go there.
trace.set_tracer_provider(PROVIDER)


@pytest.fixture(params=TRANSPORT_KINDS)
def kind(request: pytest.FixtureRequest) -> TransportKind:
    kind: TransportKind = request.param
    return kind


@pytest.fixture
async def client() -> AsyncIterator[HandoffClient]:
    EXPORTER.clear()
    server = Server(Settings(**(LOOPBACK | {"metrics_port": -1})), tracer=tracing.Tracing(PROVIDER))
    await server.start()
    try:
        async with HandoffClient(f"127.0.0.1:{server.port}", timeout_s=TIMEOUT_S) as client:
            yield client
    finally:
        await server.stop()


async def _spans_until(count: int) -> tuple[ReadableSpan, ...]:
    """The finished spans once there are ``count``: handlers end theirs as they return."""
    async with asyncio.timeout(TIMEOUT_S):
        while len(spans := EXPORTER.get_finished_spans()) < count:
            ENDED.event.clear()
            await ENDED.event.wait()
    return spans


def _context(span: ReadableSpan) -> SpanContext:
    context = span.get_span_context()
    assert isinstance(context, SpanContext)
    return context


async def test_the_callers_trace_id_reaches_every_handler_span(
    client: HandoffClient, kind: TransportKind
) -> None:
    prefill, decode = ScriptedEngine(), ScriptedEngine()
    seen_in_handler: list[SpanContext] = []

    async def activate(action: Action, facts: Facts) -> Outcome:
        # What an engine's own instrumentation would see inside its handler.
        seen_in_handler.append(trace.get_current_span().get_span_context())
        return Outcome(OutcomeKind.APPLIED)

    decode.overrides[ActionKind.ACTIVATE_DESTINATION] = activate
    router = trace.get_tracer("router")
    async with (
        running(client, SOURCE, prefill, transport=kind),
        running(client, DESTINATION, decode, transport=kind),
    ):
        async with asyncio.timeout(TIMEOUT_S):
            with router.start_as_current_span("router.request") as request_span:
                handoff_id = await start(client)
            await decode.notices[handoff_id].get()
            await prefill.notices[handoff_id].get()
    # router, handoff, 6 actions (Complete's one), 5 handlers plus 2 Complete notices
    spans = await _spans_until(1 + 1 + 6 + 7)
    trace_id = request_span.get_span_context().trace_id
    assert {_context(s).trace_id for s in spans} == {trace_id}
    by_id = {_context(s).span_id: s for s in spans}
    (handoff,) = [s for s in spans if s.name == "handoff"]
    assert handoff.parent is not None
    assert handoff.parent.span_id == request_span.get_span_context().span_id
    handlers = [s for s in spans if s.name.endswith(" handler")]
    assert sorted(s.name for s in handlers) == sorted(
        [
            "handoff.submit_prefill handler",
            "handoff.reserve_destination handler",
            "handoff.start_transfer handler",
            "handoff.activate_destination handler",
            "handoff.release_source handler",
            "handoff.complete handler",
            "handoff.complete handler",
        ]
    )
    for handler in handlers:
        assert handler.parent is not None
        action_span = by_id[handler.parent.span_id]
        assert action_span.name == handler.name.removesuffix(" handler")
        assert action_span.parent is not None
        assert action_span.parent.span_id == _context(handoff).span_id
        assert handler.attributes is not None
        assert handler.attributes["handoff.id"] == handoff_id
        assert handler.kind is trace.SpanKind.CONSUMER
    (activate_handler,) = [s for s in handlers if s.name == "handoff.activate_destination handler"]
    assert seen_in_handler == [_context(activate_handler)]
