"""`--otlp-endpoint`: spans exported over real OTLP/gRPC arrive at a collector intact.

The collector is a gRPC server in the test process implementing the
OpenTelemetry Collector's TraceService (from opentelemetry-proto).
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator

import grpc
import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2 as collector_pb
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc as collector_grpc
from opentelemetry.proto.trace.v1 import trace_pb2

from handoff_client import HandoffClient
from handoff_proto.v1 import coordinator_pb2 as pb
from handoff_proto.v1 import coordinator_pb2_grpc as pb_grpc
from handoff_server.ops.config import Settings
from handoff_server.service.app import Server
from tests.support.servers import LOOPBACK
from tests.support.sidecar import DESTINATION, SOURCE, TIMEOUT_S, ScriptedEngine, running

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
CALLER_SPAN = "00f067aa0ba902b7"


class Collector(collector_grpc.TraceServiceServicer):
    def __init__(self) -> None:
        self.spans: list[trace_pb2.Span] = []
        self.service_names: set[str] = set()

    async def Export(
        self,
        request: collector_pb.ExportTraceServiceRequest,
        context: grpc.aio.ServicerContext[
            collector_pb.ExportTraceServiceRequest, collector_pb.ExportTraceServiceResponse
        ],
    ) -> collector_pb.ExportTraceServiceResponse:
        for resource_spans in request.resource_spans:
            for attribute in resource_spans.resource.attributes:
                if attribute.key == "service.name":
                    self.service_names.add(attribute.value.string_value)
            for scope_spans in resource_spans.scope_spans:
                self.spans.extend(scope_spans.spans)
        return collector_pb.ExportTraceServiceResponse()


@pytest.fixture
async def collector() -> AsyncIterator[tuple[Collector, int]]:
    servicer = Collector()
    server = grpc.aio.server()
    collector_grpc.add_TraceServiceServicer_to_server(servicer, server)  # type: ignore[no-untyped-call]
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        yield servicer, port
    finally:
        await server.stop(grace=None)


async def test_spans_arrive_at_an_otlp_collector_intact(
    collector: tuple[Collector, int], monkeypatch: pytest.MonkeyPatch
) -> None:
    received, port = collector
    monkeypatch.setenv("OTEL_SERVICE_NAME", "handoff-under-test")
    settings = Settings(
        **(LOOPBACK | {"metrics_port": -1}), otlp_endpoint=f"http://127.0.0.1:{port}"
    )
    server = Server(settings)
    assert server.tracer.on
    await server.start()
    handoff_id = str(uuid.uuid4())
    try:
        target = f"127.0.0.1:{server.port}"
        prefill, decode = ScriptedEngine(), ScriptedEngine()
        async with (
            HandoffClient(target, timeout_s=TIMEOUT_S) as client,
            grpc.aio.insecure_channel(target) as channel,
            running(client, SOURCE, prefill),
            running(client, DESTINATION, decode),
        ):
            async with asyncio.timeout(TIMEOUT_S):
                await pb_grpc.HandoffCoordinatorStub(channel).StartHandoff(
                    pb.StartHandoffRequest(
                        handoff_id=handoff_id,
                        order=pb.HANDOFF_ORDER_SOURCE_FIRST,
                        source_engine_id=SOURCE,
                        destination_engine_id=DESTINATION,
                    ),
                    metadata=(("traceparent", f"00-{TRACE_ID}-{CALLER_SPAN}-01"),),
                )
                await decode.notices[handoff_id].get()
    finally:
        await server.stop()  # flushes the batch processor to the collector
    assert received.service_names == {"handoff-under-test"}
    by_name = {span.name: span for span in received.spans}
    assert sorted(by_name) == [
        "handoff",
        "handoff.activate_destination",
        "handoff.complete",
        "handoff.release_source",
        "handoff.reserve_destination",
        "handoff.start_transfer",
        "handoff.submit_prefill",
    ]
    assert {span.trace_id.hex() for span in received.spans} == {TRACE_ID}
    handoff = by_name["handoff"]
    assert handoff.parent_span_id.hex() == CALLER_SPAN
    assert handoff.kind == trace_pb2.Span.SPAN_KIND_SERVER
    attributes = {a.key: a.value.string_value for a in handoff.attributes}
    assert attributes["handoff.id"] == handoff_id
    assert attributes["handoff.completion"] == "success"
    assert [event.name for event in handoff.events] == [
        "source_held",
        "destination_reserved",
        "transfer_completed",
    ]
    for name, span in by_name.items():
        if name != "handoff":
            assert span.parent_span_id == handoff.span_id
            assert handoff.start_time_unix_nano <= span.start_time_unix_nano
            assert span.end_time_unix_nano <= handoff.end_time_unix_nano
    submit = by_name["handoff.submit_prefill"]
    outcome = {a.key: a.value for a in submit.attributes}
    assert outcome["handoff.outcome"].string_value == "submitted"
    assert outcome["handoff.action.attempts"].int_value == 1
