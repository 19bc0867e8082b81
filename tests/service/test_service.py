"""The service end to end over real gRPC on loopback: delivery, time, limits, errors."""

from __future__ import annotations

import asyncio
import sys
import uuid
from collections.abc import AsyncIterator

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from handoff_proto.v1 import coordinator_pb2 as pb
from handoff_proto.v1 import coordinator_pb2_grpc as pb_grpc
from handoff_server.domain.core import Handoff, SourceStage
from handoff_server.service.app import Server
from tests.support.rpc import (
    APPLIED,
    CANCELED,
    HELD,
    SOURCE,
    SUBMITTED,
    StreamRecorder,
    Stub,
    fact,
    outcome,
    recorders,
    start_request,
    succeed,
)
from tests.support.servers import StartServer


@pytest.fixture
async def stub(server: Server) -> AsyncIterator[Stub]:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        yield pb_grpc.HandoffCoordinatorStub(channel)


async def rejection(call: object) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await call  # type: ignore[misc]
    return caught.value


async def test_stream_drop_redelivers_outstanding_actions(stub: Stub) -> None:
    async with asyncio.timeout(10):
        first = StreamRecorder(stub, SOURCE)
        await first.subscribed()
        handoff_id = (await stub.StartHandoff(start_request())).handoff.handoff_id
        assert (await first.wait_for(handoff_id, 0)).attempt == 1
        await first.close()  # the sidecar's connection drops
        second = StreamRecorder(stub, SOURCE)
        again = await second.wait_for(handoff_id, 0)
        assert (again.kind, again.attempt) == (pb.ACTION_KIND_SUBMIT_PREFILL, 2)
        await second.close()


async def test_new_subscription_replaces_the_old_one_which_ends_cleanly(stub: Stub) -> None:
    async with asyncio.timeout(10):
        old = StreamRecorder(stub, SOURCE)
        await old.subscribed()
        new = StreamRecorder(stub, SOURCE)
        await new.subscribed()
        assert await old.stream_ended() is grpc.StatusCode.OK
        handoff_id = (await stub.StartHandoff(start_request())).handoff.handoff_id
        assert (await new.wait_for(handoff_id, 0)).kind == pb.ACTION_KIND_SUBMIT_PREFILL
        assert not old.received
        await new.close()


async def test_engine_that_never_subscribes_is_lost_within_delivery_timeout(
    start_server: StartServer,
) -> None:
    server = await start_server(delivery_timeout_s=0.5)
    async with (
        asyncio.timeout(10),
        grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel,
    ):
        stub = pb_grpc.HandoffCoordinatorStub(channel)
        async with recorders(stub, SOURCE) as (source,):
            started = asyncio.get_running_loop().time()
            handoff_id = (await stub.StartHandoff(start_request())).handoff.handoff_id
            await outcome(stub, handoff_id, 0, SUBMITTED)
            await fact(stub, handoff_id, HELD)  # ReserveDestination: nobody listens
            cancel = await source.wait_for(handoff_id, 2)
            assert cancel.kind == pb.ACTION_KIND_CANCEL_SOURCE
            assert asyncio.get_running_loop().time() - started < 2.0
            state = await stub.GetHandoff(pb.GetHandoffRequest(handoff_id=handoff_id))
            assert state.handoff.phase == pb.PHASE_CLEANING_UP


async def test_deadline_expiry_cancels_through_the_streams(stub: Stub) -> None:
    async with asyncio.timeout(10), recorders(stub, SOURCE) as (source,):
        request = start_request(timeout_s=0.3)
        handoff_id = (await stub.StartHandoff(request)).handoff.handoff_id
        await outcome(stub, handoff_id, 0, SUBMITTED)
        cancel = await source.wait_for(handoff_id, 1)
        assert cancel.kind == pb.ACTION_KIND_CANCEL_SOURCE
        done = await outcome(stub, handoff_id, 1, APPLIED)
        assert done.handoff.completion == pb.COMPLETION_CANCELED
        assert [a.kind for a in done.actions] == [pb.ACTION_KIND_COMPLETE]


async def test_a_retried_start_answers_the_handoff_and_a_conflict_names_the_field(
    stub: Stub,
) -> None:
    handoff_id = str(uuid.uuid4())
    first = await stub.StartHandoff(start_request(handoff_id))
    assert not first.already_started
    retry = await stub.StartHandoff(start_request(handoff_id))
    assert retry.already_started
    assert list(retry.actions) == []
    assert retry.handoff.outstanding_actions[0].kind == pb.ACTION_KIND_SUBMIT_PREFILL
    error = await rejection(stub.StartHandoff(start_request(handoff_id, source_engine_id="x")))
    assert error.code() is grpc.StatusCode.ALREADY_EXISTS
    assert handoff_id in (error.details() or "")
    assert "source_engine_id" in (error.details() or "")
    await succeed(stub, handoff_id)
    retained = await stub.StartHandoff(start_request(handoff_id))
    assert retained.already_started
    assert retained.handoff.completion == pb.COMPLETION_SUCCESS
    late = await outcome(stub, handoff_id, 4, APPLIED)  # a late duplicate
    assert list(late.actions) == []
    reopened = await fact(stub, handoff_id, CANCELED)  # a cancel during decode
    assert [a.kind for a in reopened.actions] == [pb.ACTION_KIND_CANCEL_DESTINATION]


async def test_get_handoff_says_what_an_abandoned_handoff_left_outstanding(
    start_server: StartServer,
) -> None:
    server = await start_server(cleanup_timeout_s=0.3)
    async with (
        asyncio.timeout(10),
        grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel,
    ):
        stub = pb_grpc.HandoffCoordinatorStub(channel)
        async with recorders(stub, SOURCE) as (source,):
            handoff_id = (await stub.StartHandoff(start_request())).handoff.handoff_id
            await source.wait_for(handoff_id, 0)
            await fact(stub, handoff_id, CANCELED)
            await source.wait_for(handoff_id, 1)  # CancelSource, never answered
            assert await server.wait_idle(5.0)  # abandoned: nothing unfinished any more
        state = await stub.GetHandoff(pb.GetHandoffRequest(handoff_id=handoff_id))
        assert state.handoff.abandoned
        assert state.handoff.phase == pb.PHASE_CLEANING_UP
        assert [a.kind for a in state.handoff.outstanding_actions] == [
            pb.ACTION_KIND_SUBMIT_PREFILL,
            pb.ACTION_KIND_CANCEL_SOURCE,
        ]


async def test_admission_limit(start_server: StartServer) -> None:
    server = await start_server(max_active_handoffs=1)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        stub = pb_grpc.HandoffCoordinatorStub(channel)
        await stub.StartHandoff(start_request())
        error = await rejection(stub.StartHandoff(start_request()))
        assert error.code() is grpc.StatusCode.RESOURCE_EXHAUSTED


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"handoff_id": "not-a-uuid"}, "handoff_id"),
        ({"source_engine_id": ""}, "source_engine_id"),
        ({"destination_engine_id": "bad id!"}, "destination_engine_id"),
        ({"source_engine_id": "x" * 129}, "source_engine_id"),
        ({"engine_type": pb.ENGINE_TYPE_UNSPECIFIED}, "order or engine_type"),
        ({"order": pb.HANDOFF_ORDER_DESTINATION_FIRST}, "contradicts engine_type"),
        ({"fallback_transfer_delay_ms": float("nan")}, "fallback_transfer_delay_ms"),
        ({"fallback_transfer_delay_ms": -1.0}, "fallback_transfer_delay_ms"),
        ({"timeout_s": float("inf")}, "timeout_s"),
        ({"timeout_s": 1e12}, "at most 86400"),
        ({"transfer_executor": pb.ROLE_BOTH}, "transfer_executor"),
    ],
)
async def test_bad_start_requests_name_the_field_and_change_nothing(
    server: Server, stub: Stub, change: dict[str, object], field: str
) -> None:
    error = await rejection(stub.StartHandoff(start_request(**change)))
    assert error.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert field in (error.details() or "")
    assert server.registry.handoffs == {}


async def test_bad_reports_name_the_field_and_change_nothing(server: Server, stub: Stub) -> None:
    handoff_id = (await stub.StartHandoff(start_request())).handoff.handoff_id
    before = server.registry.get(handoff_id).core.snapshot()
    cases: list[tuple[object, str]] = [
        (fact(stub, handoff_id, pb.Fact()), "fact is required"),
        (fact(stub, handoff_id, pb.Fact(source_held=pb.SourceHeld())), "transfer_timing"),
        (
            fact(stub, handoff_id, pb.Fact(engine_lost=pb.EngineLost(role=pb.ROLE_BOTH))),
            "fact.engine_lost.role must be ROLE_SOURCE or ROLE_DESTINATION",
        ),
        (
            outcome(stub, handoff_id, 0, pb.Outcome(kind=pb.OUTCOME_KIND_FAILED)),
            "outcome.reason is required",
        ),
        (
            outcome(
                stub, handoff_id, 0, pb.Outcome(kind=pb.OUTCOME_KIND_FAILED, reason="x" * 1025)
            ),
            "at most 1024 bytes",
        ),
        (outcome(stub, handoff_id, 0, pb.Outcome()), "outcome.kind is required"),
        (fact(stub, "nope", CANCELED), "handoff_id must be a UUID"),
    ]
    for call, words in cases:
        error = await rejection(call)
        assert error.code() is grpc.StatusCode.INVALID_ARGUMENT
        assert words in (error.details() or "")
    assert server.registry.get(handoff_id).core.snapshot() == before
    bad_stream = stub.StreamActions(pb.StreamActionsRequest(engine_id="no spaces"))
    assert (await rejection(bad_stream.read())).code() is grpc.StatusCode.INVALID_ARGUMENT


async def test_errors_name_the_handoff_the_action_and_the_reason(stub: Stub) -> None:
    unknown = str(uuid.uuid4())
    error = await rejection(fact(stub, unknown, CANCELED))
    assert error.code() is grpc.StatusCode.NOT_FOUND
    assert unknown in (error.details() or "")
    handoff_id = (await stub.StartHandoff(start_request())).handoff.handoff_id
    error = await rejection(outcome(stub, handoff_id, 0, APPLIED))
    assert error.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert error.details() == (
        f"handoff {handoff_id}, action 0, outcome OUTCOME_KIND_APPLIED: "
        "invalid handoff action outcome Applied"
    )
    error = await rejection(outcome(stub, handoff_id, 7, SUBMITTED))
    assert error.code() is grpc.StatusCode.NOT_FOUND


async def test_unexpected_exception_returns_internal_and_changes_nothing(
    server: Server, stub: Stub, monkeypatch: pytest.MonkeyPatch
) -> None:
    handoff_id = (await stub.StartHandoff(start_request())).handoff.handoff_id
    before = server.registry.get(handoff_id).core.snapshot()

    def crash(self: Handoff, *args: object) -> None:
        self.source.stage = SourceStage.HELD  # a bug that mutates a record, then crashes
        raise ZeroDivisionError

    monkeypatch.setattr(Handoff, "apply_outcome", crash)
    error = await rejection(outcome(stub, handoff_id, 0, SUBMITTED))
    assert error.code() is grpc.StatusCode.INTERNAL
    assert handoff_id in (error.details() or "")
    monkeypatch.undo()
    assert server.registry.get(handoff_id).core.snapshot() == before


async def test_health_and_reflection_are_served(server: Server) -> None:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        health = health_pb2_grpc.HealthStub(channel)
        for service in ("", "handoff.v1.HandoffCoordinator"):
            answer = await health.Check(health_pb2.HealthCheckRequest(service=service))
            assert answer.status == health_pb2.HealthCheckResponse.SERVING
        reflection = reflection_pb2_grpc.ServerReflectionStub(channel)
        request = reflection_pb2.ServerReflectionRequest(list_services="")
        async for response in reflection.ServerReflectionInfo(iter([request])):
            names = {s.name for s in response.list_services_response.service}
            assert "handoff.v1.HandoffCoordinator" in names
            break


async def test_shutdown_drains_active_handoffs_then_exits(start_server: StartServer) -> None:
    server = await start_server(drain_grace_s=10.0)
    async with (
        asyncio.timeout(15),
        grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel,
    ):
        stub = pb_grpc.HandoffCoordinatorStub(channel)
        health = health_pb2_grpc.HealthStub(channel)
        handoff_id = (await stub.StartHandoff(start_request())).handoff.handoff_id
        stopping = asyncio.create_task(server.stop())
        await asyncio.sleep(0)  # let stop() flip health and admission
        answer = await health.Check(health_pb2.HealthCheckRequest(service=""))
        assert answer.status == health_pb2.HealthCheckResponse.NOT_SERVING
        error = await rejection(stub.StartHandoff(start_request()))
        assert error.code() is grpc.StatusCode.UNAVAILABLE
        assert not stopping.done()
        await succeed(stub, handoff_id)  # the in-flight handoff still completes
        await stopping
    assert server.registry.active_count == 0


async def test_shutdown_cancels_what_does_not_finish_in_the_grace(
    start_server: StartServer,
) -> None:
    server = await start_server(drain_grace_s=0.3)
    async with (
        asyncio.timeout(15),
        grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel,
    ):
        stub = pb_grpc.HandoffCoordinatorStub(channel)
        async with recorders(stub, SOURCE) as (source,):
            handoff_id = (await stub.StartHandoff(start_request())).handoff.handoff_id
            stopping = asyncio.create_task(server.stop())
            cancel = await source.wait_for(handoff_id, 1)
            assert cancel.kind == pb.ACTION_KIND_CANCEL_SOURCE
            await outcome(stub, handoff_id, 1, pb.Outcome(kind=pb.OUTCOME_KIND_NOOP))
            await stopping
    assert server.registry.get(handoff_id).core.completion is not None


async def test_inspect_prints_a_handoff(server: Server, stub: Stub) -> None:
    handoff_id = (await stub.StartHandoff(start_request())).handoff.handoff_id
    await outcome(stub, handoff_id, 0, SUBMITTED)
    await fact(stub, handoff_id, HELD)
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "handoff_server.commands.cli",
        "inspect",
        handoff_id,
        "--target",
        f"127.0.0.1:{server.port}",
        stdout=asyncio.subprocess.PIPE,
    )
    async with asyncio.timeout(30):
        out, _ = await process.communicate()
    text = out.decode()
    assert process.returncode == 0
    assert f"handoff      {handoff_id}" in text
    assert "phase        active" in text
    assert "source_held" in text
    assert "#1 reserve_destination -> decode-0" in text
