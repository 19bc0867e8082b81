"""The bidirectional Connect stream: hello first, one ack per report, clean endings."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator

import grpc
import pytest

from handoff_proto.v1 import coordinator_pb2 as pb
from handoff_proto.v1 import coordinator_pb2_grpc as pb_grpc
from handoff_server.service.app import Server
from handoff_server.service.servicer import Owed, Servicer
from tests.support.rpc import (
    ACCEPTED,
    APPLIED,
    HELD,
    RESERVED,
    SOURCE,
    SUBMITTED,
    ConnectEngine,
    Stub,
    start_request,
)
from tests.support.servers import StartServer


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


class RawConnect:
    """A Connect call driven message by message, to see exactly how the server packs."""

    def __init__(self, stub: Stub, hello: pb.ConnectHello) -> None:
        self.outbox: asyncio.Queue[pb.ConnectRequest | None] = asyncio.Queue()
        self.outbox.put_nowait(pb.ConnectRequest(hello=hello))
        self.call = stub.Connect(self._requests())

    async def _requests(self) -> AsyncIterator[pb.ConnectRequest]:
        while (request := await self.outbox.get()) is not None:
            yield request

    async def send(self, request: pb.ConnectRequest) -> pb.ConnectResponse:
        """Send one message; the next message the server writes."""
        await self.outbox.put(request)
        response = await self.call.read()
        assert isinstance(response, pb.ConnectResponse)
        return response

    async def close(self) -> None:
        await self.outbox.put(None)
        # The server ends its side once every report is acknowledged.
        assert not isinstance(await self.call.read(), pb.ConnectResponse)
        assert await self.call.code() is grpc.StatusCode.OK


async def started(
    stub: Stub, *, batch: bool = False, lean_acks: bool = False
) -> tuple[RawConnect, str, pb.ConnectResponse]:
    """An engine on Connect that is both ends of a new handoff, and the first message it got."""
    hello = pb.ConnectHello(engine_id=SOURCE, batch=batch, lean_acks=lean_acks)
    engine = RawConnect(stub, hello)
    await engine.call.initial_metadata()
    handoff_id = str(uuid.uuid4())
    await stub.StartHandoff(start_request(handoff_id, destination_engine_id=SOURCE))
    first = await engine.call.read()
    assert isinstance(first, pb.ConnectResponse)
    return engine, handoff_id, first


async def test_reports_in_one_message_are_answered_in_one_packed_message(stub: Stub) -> None:
    """Three reports in one message, the second rejected: three acks in report
    order, and the action the third caused, all in the one message written next."""
    async with asyncio.timeout(10):
        engine, handoff_id, first = await started(stub, batch=True)
        assert first.WhichOneof("kind") is None
        assert not first.acks
        assert [a.kind for a in first.actions] == [pb.ACTION_KIND_SUBMIT_PREFILL]

        message = pb.ConnectRequest()
        message.reports.add(
            request_id=7,
            outcome=pb.ReportOutcomeRequest(handoff_id=handoff_id, action_id=0, outcome=SUBMITTED),
        )
        message.reports.add(
            request_id=8,
            outcome=pb.ReportOutcomeRequest(handoff_id=handoff_id, action_id=5, outcome=APPLIED),
        )
        message.reports.add(
            request_id=9, fact=pb.ReportFactRequest(handoff_id=handoff_id, fact=HELD)
        )
        packed = await engine.send(message)

        assert packed.WhichOneof("kind") is None
        assert [(a.request_id, a.code) for a in packed.acks] == [
            (7, 0),
            (8, grpc.StatusCode.NOT_FOUND.value[0]),
            (9, 0),
        ]
        assert f"handoff {handoff_id}, action 5, outcome OUTCOME_KIND_APPLIED" in (
            packed.acks[1].message
        )
        # Full acks: the hello did not ask for lean ones.
        assert packed.acks[2].handoff.phase == pb.PHASE_ACTIVE
        assert [a.kind for a in packed.acks[2].actions] == [pb.ACTION_KIND_RESERVE_DESTINATION]
        assert [(a.id, a.kind) for a in packed.actions] == [(1, pb.ACTION_KIND_RESERVE_DESTINATION)]
        await engine.close()


def report(
    request_id: int, item: pb.ReportFactRequest | pb.ReportOutcomeRequest
) -> pb.ConnectRequest:
    if isinstance(item, pb.ReportFactRequest):
        return pb.ConnectRequest(request_id=request_id, fact=item)
    return pb.ConnectRequest(request_id=request_id, outcome=item)


async def test_a_stream_lingers_only_while_the_loop_is_behind(
    start_server: StartServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A stream lingers once the event loop is behind (its wake-up came more
    than half of ``stream_linger_ms`` after the work that set it): then the
    acks of two reports sent a message apart leave in one message. Before
    that, each ack leaves at once. Here one report's handling holds the loop
    after it woke the stream, as a loop busy with other streams would."""
    handle = Servicer._report

    def holding_the_loop(
        self: Servicer, request: pb.ConnectRequest | pb.ConnectReport, owed: Owed
    ) -> None:
        handle(self, request, owed)
        if request.request_id == 8:
            time.sleep(0.6)

    monkeypatch.setattr(Servicer, "_report", holding_the_loop)
    server = await start_server(stream_linger_ms=1000)
    async with (
        grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel,
        asyncio.timeout(20),
    ):
        stub = pb_grpc.HandoffCoordinatorStub(channel)
        engine, handoff_id, _ = await started(stub, batch=True)
        submitted = pb.ReportOutcomeRequest(handoff_id=handoff_id, action_id=0, outcome=SUBMITTED)
        assert [a.request_id for a in (await engine.send(report(7, submitted))).acks] == [7]
        # Its ReserveDestination wakes the stream, then the loop is held.
        held = await engine.send(report(8, pb.ReportFactRequest(handoff_id=handoff_id, fact=HELD)))
        assert [a.request_id for a in held.acks] == [8]
        assert [a.kind for a in held.actions] == [pb.ACTION_KIND_RESERVE_DESTINATION]

        before = await stub.GetHandoff(pb.GetHandoffRequest(handoff_id=handoff_id))
        accepted = pb.ReportOutcomeRequest(handoff_id=handoff_id, action_id=1, outcome=ACCEPTED)
        await engine.outbox.put(report(9, accepted))
        while (
            await stub.GetHandoff(pb.GetHandoffRequest(handoff_id=handoff_id))
        ).handoff == before.handoff:
            pass  # each poll is a round trip: report 9 is handled between two of them
        reserved = pb.ReportFactRequest(handoff_id=handoff_id, fact=RESERVED)
        packed = await engine.send(report(10, reserved))
        assert [a.request_id for a in packed.acks] == [9, 10]
        await engine.close()


async def test_lean_acks_carry_only_the_answer(stub: Stub) -> None:
    async with asyncio.timeout(10):
        engine, handoff_id, submit = await started(stub, lean_acks=True)
        assert submit.action.kind == pb.ACTION_KIND_SUBMIT_PREFILL
        accepted = await engine.send(
            pb.ConnectRequest(
                request_id=1,
                outcome=pb.ReportOutcomeRequest(
                    handoff_id=handoff_id, action_id=0, outcome=SUBMITTED
                ),
            )
        )
        assert accepted.ack == pb.ConnectAck(request_id=1)
        rejected = await engine.send(
            pb.ConnectRequest(
                request_id=2,
                outcome=pb.ReportOutcomeRequest(
                    handoff_id=handoff_id, action_id=9, outcome=APPLIED
                ),
            )
        )
        assert rejected.ack.code == grpc.StatusCode.NOT_FOUND.value[0]
        assert "unknown handoff action 9" in rejected.ack.message
        assert not rejected.ack.HasField("handoff")
        assert not rejected.ack.actions
        await engine.close()


async def test_a_message_may_carry_a_report_in_kind_and_more_in_reports(stub: Stub) -> None:
    """Acks in the order the reports appear: the one in kind first. Without
    batch, each ack is a message of its own."""
    async with asyncio.timeout(10):
        engine = RawConnect(stub, pb.ConnectHello(engine_id=SOURCE))
        await engine.call.initial_metadata()
        unknown = str(uuid.uuid4())
        message = pb.ConnectRequest(
            request_id=1, fact=pb.ReportFactRequest(handoff_id=unknown, fact=HELD)
        )
        message.reports.add(request_id=2, fact=pb.ReportFactRequest(handoff_id="not-a-uuid"))
        first = await engine.send(message)
        second = await engine.call.read()
        assert isinstance(second, pb.ConnectResponse)
        assert [(r.ack.request_id, r.ack.code) for r in (first, second)] == [
            (1, grpc.StatusCode.NOT_FOUND.value[0]),
            (2, grpc.StatusCode.INVALID_ARGUMENT.value[0]),
        ]
        empty = await engine.send(pb.ConnectRequest(request_id=3))
        invalid = grpc.StatusCode.INVALID_ARGUMENT.value[0]
        assert (empty.ack.request_id, empty.ack.code) == (3, invalid)
        assert "must carry a fact or an outcome" in empty.ack.message
        await engine.close()


async def test_a_hello_carrying_reports_is_refused(stub: Stub) -> None:
    hello = pb.ConnectRequest(hello=pb.ConnectHello(engine_id=SOURCE))
    hello.reports.add(request_id=1, fact=pb.ReportFactRequest(handoff_id=str(uuid.uuid4())))
    call = stub.Connect(iter([hello]))
    async with asyncio.timeout(10):
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await call.read()
    assert caught.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert "the hello comes alone" in (caught.value.details() or "")
