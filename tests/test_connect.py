"""The bidirectional Connect stream: hello first, one ack per report, clean endings."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator

import grpc
import pytest

from handoff.v1 import coordinator_pb2 as pb
from handoff.v1 import coordinator_pb2_grpc as pb_grpc
from handoff_server.app import Server
from tests.grpc_support import SOURCE, ConnectEngine
from tests.test_service import APPLIED, HELD, SUBMITTED, Stub, start_request


@pytest.fixture
async def stub(server: Server) -> AsyncIterator[Stub]:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        yield pb_grpc.HandoffCoordinatorStub(channel)


async def test_reports_are_acknowledged_and_actions_arrive(stub: Stub) -> None:
    async with asyncio.timeout(10):
        engine = ConnectEngine(stub, SOURCE)
        await engine.subscribed()
        handoff_id = (await stub.StartHandoff(start_request())).handoff.handoff_id
        submit = await engine.wait_for(handoff_id, 0)
        assert (submit.kind, submit.attempt) == (pb.ACTION_KIND_SUBMIT_PREFILL, 1)
        ack = await engine.report(
            pb.ReportOutcomeRequest(handoff_id=handoff_id, action_id=0, outcome=SUBMITTED)
        )
        assert (ack.code, list(ack.actions)) == (0, [])
        assert ack.handoff.phase == pb.PHASE_ACTIVE
        ack = await engine.report(pb.ReportFactRequest(handoff_id=handoff_id, fact=HELD))
        assert [a.kind for a in ack.actions] == [pb.ACTION_KIND_RESERVE_DESTINATION]
        rejected = await engine.report(
            pb.ReportOutcomeRequest(handoff_id=handoff_id, action_id=1, outcome=APPLIED)
        )
        assert rejected.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
        assert "invalid handoff action outcome Applied" in rejected.message
        await engine.close()


async def test_a_stream_without_hello_is_refused(stub: Stub) -> None:
    async def requests() -> AsyncIterator[pb.ConnectRequest]:
        yield pb.ConnectRequest(request_id=1, fact=pb.ReportFactRequest())

    call = stub.Connect(requests())
    async with asyncio.timeout(10):
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await call.read()
    assert caught.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert "hello" in (caught.value.details() or "")


async def test_a_second_hello_is_rejected_in_its_ack(stub: Stub) -> None:
    async with asyncio.timeout(10):
        engine = ConnectEngine(stub, SOURCE)
        await engine.subscribed()
        engine._next_request += 1
        acknowledged: asyncio.Future[pb.ConnectAck] = asyncio.get_running_loop().create_future()
        engine._acks[engine._next_request] = acknowledged
        await engine._outbox.put(
            pb.ConnectRequest(
                request_id=engine._next_request, hello=pb.ConnectHello(engine_id=SOURCE)
            )
        )
        ack = await acknowledged
        assert ack.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
        await engine.close()


async def test_redelivery_on_reconnect_and_replacement(stub: Stub) -> None:
    async with asyncio.timeout(10):
        first = ConnectEngine(stub, SOURCE)
        await first.subscribed()
        handoff_id = str(uuid.uuid4())
        await stub.StartHandoff(start_request(handoff_id))
        assert (await first.wait_for(handoff_id, 0)).attempt == 1
        second = ConnectEngine(stub, SOURCE)  # replaces the first
        assert (await second.wait_for(handoff_id, 0)).attempt == 2
        await first._task  # the replaced stream ended by itself
        assert await first._call.code() is grpc.StatusCode.OK
        await second.close()
        assert await second._call.code() is grpc.StatusCode.OK  # half-close ends cleanly
