"""Every limit on a real server: message size, streams, engines, queues, keepalive, age."""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from handoff_proto.v1 import coordinator_pb2 as pb
from handoff_proto.v1 import coordinator_pb2_grpc as pb_grpc
from handoff_server.domain.registry import Registry
from handoff_server.ops.config import Settings
from handoff_server.ops.metrics import Metrics
from handoff_server.service import arrival, servicer
from handoff_server.service.app import Server
from handoff_server.service.servicer import MAX_REPORTS_PER_MESSAGE
from tests.support.fuzz import REFUSAL_NUMBERS
from tests.support.rpc import StreamRecorder
from tests.support.security import Stub
from tests.support.servers import StartServer, streams_until

TIMEOUT_S = 10.0
PROBES = 20  # round trips through the server while a peer waits on flow control


def channel_to(server: Server, *options: tuple[str, int]) -> grpc.aio.Channel:
    return grpc.aio.insecure_channel(f"127.0.0.1:{server.port}", options=options)


def start_request(source: str = "src", destination: str = "dst") -> pb.StartHandoffRequest:
    return pb.StartHandoffRequest(
        handoff_id=str(uuid.uuid4()),
        engine_type=pb.ENGINE_TYPE_VLLM,
        source_engine_id=source,
        destination_engine_id=destination,
    )


async def code_of(call: object) -> grpc.StatusCode:
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await call  # type: ignore[misc]
    return caught.value.code()


async def absent(stub: Stub) -> grpc.StatusCode:
    """The code for reading a random handoff: NOT_FOUND whenever the call got through."""
    return await code_of(stub.GetHandoff(pb.GetHandoffRequest(handoff_id=str(uuid.uuid4()))))


async def watching(channel: grpc.aio.Channel) -> grpc.aio.UnaryStreamCall[Any, Any]:
    """A Health/Watch stream, open once its first answer arrived: a call that
    stays in flight and belongs to no engine."""
    call: grpc.aio.UnaryStreamCall[Any, Any] = health_pb2_grpc.HealthStub(channel).Watch(
        health_pb2.HealthCheckRequest()
    )
    first = await call.read()
    assert isinstance(first, health_pb2.HealthCheckResponse)
    return call


async def test_a_message_over_the_size_limit_is_refused_and_changes_nothing(
    start_server: StartServer,
) -> None:
    server = await start_server(max_message_bytes=1024)
    async with asyncio.timeout(TIMEOUT_S), channel_to(server) as channel:
        stub: Stub = pb_grpc.HandoffCoordinatorStub(channel)
        big = start_request()
        big.handoff_id = "x" * 2000
        assert await code_of(stub.StartHandoff(big)) is grpc.StatusCode.RESOURCE_EXHAUSTED
        under = start_request()
        under.handoff_id = "x" * 900  # under the limit, so the servicer sees it
        assert await code_of(stub.StartHandoff(under)) is grpc.StatusCode.INVALID_ARGUMENT
        # On a stream, too: the oversized report ends the stream.
        connect = stub.Connect(
            iter(
                [
                    pb.ConnectRequest(hello=pb.ConnectHello(engine_id="e")),
                    pb.ConnectRequest(fact=pb.ReportFactRequest(handoff_id="y" * 2000)),
                ]
            )
        )
        assert await connect.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
        await stub.StartHandoff(start_request())  # still serving
    assert len(server.registry.handoffs) == 1


async def test_queued_actions_per_engine_are_capped_over_grpc(start_server: StartServer) -> None:
    server = await start_server(max_queued_actions_per_engine=3, delivery_timeout_s=60.0)
    async with asyncio.timeout(TIMEOUT_S), channel_to(server) as channel:
        stub: Stub = pb_grpc.HandoffCoordinatorStub(channel)
        # Nobody reads src's actions: each handoff queues a SubmitPrefill for it.
        started = [(await stub.StartHandoff(start_request())).handoff.handoff_id for _ in range(3)]
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await stub.StartHandoff(start_request())
        assert refused.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "engine src has 3 undelivered actions" in (refused.value.details() or "")
        assert len(server.registry.handoffs) == 3  # the refused one left no trace
        await stub.StartHandoff(start_request("other-src", "other-dst"))  # others unaffected
        # Once src's sidecar takes its actions, it can be given more.
        source = StreamRecorder(stub, "src")
        for handoff_id in started:
            await source.wait_for(handoff_id, 0)
        await stub.StartHandoff(start_request())
        await source.close()
    assert len(server.registry.handoffs) == 5


async def test_engines_with_a_live_stream_are_capped(start_server: StartServer) -> None:
    server = await start_server(max_engines=2)
    streams = server.engine_streams
    async with asyncio.timeout(TIMEOUT_S), channel_to(server) as channel:
        stub: Stub = pb_grpc.HandoffCoordinatorStub(channel)
        first = StreamRecorder(stub, "e1")
        await first.subscribed()
        second = stub.Connect(hello_then_wait("e2"))
        await second.initial_metadata()
        assert set(streams.live) == {"e1", "e2"}
        # A third engine is refused, on either kind of stream.
        refused = stub.StreamActions(pb.StreamActionsRequest(engine_id="e3"))
        assert await refused.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "max_engines" in await refused.details()
        refused_connect = stub.Connect(hello_then_wait("e3"))
        assert await refused_connect.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
        # An engine already counted may always reconnect: the new stream
        # replaces the old one, which ends.
        again = StreamRecorder(stub, "e1")
        await again.subscribed()
        assert await first.stream_ended() is grpc.StatusCode.OK
        # When an engine goes away, its place is free.
        second.cancel()
        await streams_until(server, lambda live: "e2" not in live)
        third = StreamRecorder(stub, "e3")
        await third.subscribed()
        assert set(streams.live) == {"e1", "e3"}
        await again.close()
        await third.close()
        await streams_until(server, lambda live: not live)


async def hello_then_wait(engine_id: str) -> AsyncIterator[pb.ConnectRequest]:
    yield pb.ConnectRequest(hello=pb.ConnectHello(engine_id=engine_id))
    await asyncio.Event().wait()  # keeps the stream open until it is canceled


async def hello_after(send: asyncio.Event, engine_id: str) -> AsyncIterator[pb.ConnectRequest]:
    await send.wait()
    async for request in hello_then_wait(engine_id):
        yield request


async def reflecting(channel: grpc.aio.Channel) -> grpc.aio.StreamStreamCall[Any, Any]:
    """A reflection stream, open once its first answer arrived: a call of the
    service's that stays in flight and belongs to no engine."""

    async def requests() -> AsyncIterator[reflection_pb2.ServerReflectionRequest]:
        yield reflection_pb2.ServerReflectionRequest(list_services="")
        await asyncio.Event().wait()  # held open until canceled

    call: grpc.aio.StreamStreamCall[Any, Any] = reflection_pb2_grpc.ServerReflectionStub(
        channel
    ).ServerReflectionInfo(requests())
    first = await call.read()
    assert isinstance(first, reflection_pb2.ServerReflectionResponse)
    assert first.HasField("list_services_response")
    return call


async def test_calls_in_flight_server_wide_are_capped(start_server: StartServer) -> None:
    server = await start_server(max_concurrent_rpcs=3, max_engines=2)
    async with asyncio.timeout(TIMEOUT_S), channel_to(server) as channel:
        stub: Stub = pb_grpc.HandoffCoordinatorStub(channel)
        held = [await reflecting(channel) for _ in range(3)]
        refused = stub.StartHandoff(start_request())
        assert await code_of(refused) is grpc.StatusCode.RESOURCE_EXHAUSTED
        assert await refused.details() == (
            "3 calls already in flight, the limit (max_concurrent_rpcs)"
        )
        # A Connect refused so is refused once its hello is read: a refusal
        # racing the client's write of it could reach the client as INTERNAL.
        send = asyncio.Event()
        late = stub.Connect(hello_after(send, "e1"))
        code = asyncio.ensure_future(late.code())
        ended, _ = await asyncio.wait([code], timeout=arrival.REFUSAL_READ_S / 4)
        assert not ended, "refused before its hello came"
        send.set()
        assert await code is grpc.StatusCode.RESOURCE_EXHAUSTED
        assert server.registry.handoffs == {}
        # Health has a budget of its own: the service's load never fails a probe.
        health = health_pb2_grpc.HealthStub(channel)
        answer = await health.Check(health_pb2.HealthCheckRequest())
        assert answer.status == health_pb2.HealthCheckResponse.SERVING
        held.pop().cancel()
        # The server frees the slot once it has seen the cancellation, which
        # no event announces: retry, as a client would after RESOURCE_EXHAUSTED.
        while True:
            try:
                await stub.StartHandoff(start_request())
                break
            except grpc.aio.AioRpcError as error:
                if error.code() is not grpc.StatusCode.RESOURCE_EXHAUSTED:
                    raise
            await asyncio.sleep(0.01)
        for call in held:
            call.cancel()
    assert len(server.registry.handoffs) == 1


async def test_calls_per_identity_are_capped_and_an_engine_s_streams_count_once(
    start_server: StartServer, tmp_path: Path
) -> None:
    tokens = tmp_path / "tokens"
    tokens.write_text("busy busy-token-0123456789 engines=e*\nother other-token-012345678\n")
    server = await start_server(token_file=str(tokens), max_calls_per_identity=2)
    busy = (("authorization", "Bearer busy-token-0123456789"),)
    other = (("authorization", "Bearer other-token-012345678"),)
    async with asyncio.timeout(TIMEOUT_S), channel_to(server) as channel:
        stub: Stub = pb_grpc.HandoffCoordinatorStub(channel)
        first = stub.StreamActions(pb.StreamActionsRequest(engine_id="e1"), metadata=busy)
        await first.initial_metadata()
        second = stub.Connect(hello_then_wait("e2"), metadata=busy)
        await second.initial_metadata()
        refused = stub.GetHandoff(pb.GetHandoffRequest(handoff_id=str(uuid.uuid4())), metadata=busy)
        assert await code_of(refused) is grpc.StatusCode.RESOURCE_EXHAUSTED
        assert await refused.details() == (
            "token busy has 2 calls in flight, the limit per identity (max_calls_per_identity)"
        )
        # Another identity is not affected.
        lookup = stub.GetHandoff(pb.GetHandoffRequest(handoff_id=str(uuid.uuid4())), metadata=other)
        assert await code_of(lookup) is grpc.StatusCode.NOT_FOUND
        # A stream replacing the same engine's stream is admitted, and the
        # two (while they overlap) count once.
        again = stub.StreamActions(pb.StreamActionsRequest(engine_id="e1"), metadata=busy)
        await again.initial_metadata()
        assert [action async for action in first] == []  # replaced: it ended, OK
        usage = server.quotas.usage("token busy")
        assert usage is not None
        assert usage.held() == 2
        again.cancel()
        second.cancel()
        await streams_until(server, lambda live: not live)
    # Nothing held; what it is kept for at most is its allowance of calls,
    # until that refills (forgetting it sooner would hand out a new burst).
    usage = server.quotas.usage("token busy")
    assert usage is None or (usage.held() == 0 and not usage.arriving and not usage.active)


async def test_a_connect_stream_without_its_hello_is_ended(start_server: StartServer) -> None:
    server = await start_server(request_within_s=0.2)
    async with asyncio.timeout(TIMEOUT_S), channel_to(server) as channel:
        stub: Stub = pb_grpc.HandoffCoordinatorStub(channel)

        async def nothing() -> AsyncIterator[pb.ConnectRequest]:
            await asyncio.Event().wait()
            yield pb.ConnectRequest()  # pragma: no cover (never reached)

        silent = stub.Connect(nothing())
        assert await silent.code() is grpc.StatusCode.DEADLINE_EXCEEDED
        assert await silent.details() == "Connect: no request within 0.2 s (request_within_s)"


async def test_health_calls_have_their_own_budget_apart_from_the_service(
    start_server: StartServer,
) -> None:
    server = await start_server(max_health_watches=2, max_health_checks=1, health_port=0)
    async with (
        asyncio.timeout(TIMEOUT_S),
        channel_to(server) as channel,
        grpc.aio.insecure_channel(f"127.0.0.1:{server.health_port}") as health_channel,
    ):
        stub: Stub = pb_grpc.HandoffCoordinatorStub(channel)
        for port_channel in (channel, health_channel):
            held = [await watching(port_channel) for _ in range(2)]
            health = health_pb2_grpc.HealthStub(port_channel)
            refused = health.Watch(health_pb2.HealthCheckRequest())
            assert await refused.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
            assert await refused.details() == (
                "2 health watches already in flight, the limit (max_health_watches)"
            )
            # Watchers take neither a probe's place nor the service's.
            answer = await health.Check(health_pb2.HealthCheckRequest())
            assert answer.status == health_pb2.HealthCheckResponse.SERVING
            await stub.StartHandoff(start_request())
            for call in held:
                call.cancel()
    assert len(server.registry.handoffs) == 2


async def test_a_health_call_without_its_request_is_ended(start_server: StartServer) -> None:
    server = await start_server(health_request_within_s=0.2, max_health_checks=1, health_port=0)
    for port in (server.port, server.health_port):
        async with (
            asyncio.timeout(TIMEOUT_S),
            grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel,
        ):
            # Headers, then nothing: the shape of a unary call whose request never comes.
            silent = channel.stream_unary(
                "/grpc.health.v1.Health/Check",
                request_serializer=health_pb2.HealthCheckRequest.SerializeToString,
                response_deserializer=health_pb2.HealthCheckResponse.FromString,
            )(hold_open())
            assert await silent.code() is grpc.StatusCode.DEADLINE_EXCEEDED
            assert await silent.details() == (
                "health: no request within 0.2 s (health_request_within_s)"
            )
            # Its slot is free again: the one check allowed is answered.
            health = health_pb2_grpc.HealthStub(channel)
            answer = await health.Check(health_pb2.HealthCheckRequest())
            assert answer.status == health_pb2.HealthCheckResponse.SERVING


async def hold_open() -> AsyncIterator[health_pb2.HealthCheckRequest]:
    await asyncio.Event().wait()  # sends nothing until the call is canceled
    yield health_pb2.HealthCheckRequest()  # pragma: no cover (never reached)


async def test_streams_per_connection_are_capped_and_the_rest_wait(
    start_server: StartServer,
) -> None:
    server = await start_server(max_concurrent_streams=2)
    # Channels to one target share a connection unless told otherwise.
    own_connection = ("grpc.use_local_subchannel_pool", 1)
    async with (
        asyncio.timeout(TIMEOUT_S),
        channel_to(server, own_connection) as busy,
        channel_to(server, own_connection) as idle,
    ):
        held = [await watching(busy) for _ in range(2)]
        stub: Stub = pb_grpc.HandoffCoordinatorStub(busy)
        # A third call on the same connection waits for a free stream, while
        # another connection is served: the server answers the other
        # connection's calls, and its own count proves it saw none of the third's.
        waiting = asyncio.ensure_future(absent(stub))
        other = pb_grpc.HandoffCoordinatorStub(idle)
        for _ in range(PROBES):
            assert await absent(other) is grpc.StatusCode.NOT_FOUND
        assert not waiting.done()
        assert not_found(server) == PROBES
        held.pop().cancel()
        assert await waiting is grpc.StatusCode.NOT_FOUND
        assert not_found(server) == PROBES + 1
        held[0].cancel()


def not_found(server: Server) -> float:
    """How many GetHandoff calls the server answered NOT_FOUND."""
    labels = {"rpc": "GetHandoff", "code": "NOT_FOUND"}
    count = server.metrics.registry.get_sample_value("handoff_rejections_total", labels)
    return count or 0.0


class BlackholeProxy:
    """A TCP relay to the server that can go silent without closing anything:
    from the server's side, its peer has died (a pulled cable, a frozen node)."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.silent = False
        self.server_hung_up = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self._writers: list[asyncio.StreamWriter] = []
        self._listener: asyncio.Server | None = None
        self.port = 0

    async def __aenter__(self) -> BlackholeProxy:
        self._listener = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        self.port = self._listener.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        assert self._listener is not None
        self._listener.close()
        for task in self._tasks:
            task.cancel()
        for writer in self._writers:
            writer.close()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self._listener.wait_closed()

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        upstream_reader, upstream_writer = await asyncio.open_connection(
            "127.0.0.1", self.target_port
        )
        self._writers += [writer, upstream_writer]
        self._tasks += [
            asyncio.create_task(self._pump(reader, upstream_writer, from_server=False)),
            asyncio.create_task(self._pump(upstream_reader, writer, from_server=True)),
        ]

    async def _pump(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, from_server: bool
    ) -> None:
        while data := await reader.read(65536):
            if not self.silent:  # silent: swallow everything, answer nothing
                writer.write(data)
                await writer.drain()
        if from_server:
            self.server_hung_up.set()


async def test_keepalive_detects_a_dead_engine_and_ends_its_stream(
    start_server: StartServer,
) -> None:
    server = await start_server(keepalive_time_s=0.2, keepalive_timeout_s=0.3)
    async with (
        asyncio.timeout(TIMEOUT_S),
        BlackholeProxy(server.port) as proxy,
        grpc.aio.insecure_channel(f"127.0.0.1:{proxy.port}") as channel,
    ):
        engine = StreamRecorder(pb_grpc.HandoffCoordinatorStub(channel), "quiet-engine")
        await engine.subscribed()
        assert "quiet-engine" in server.engine_streams.live
        proxy.silent = True  # the engine's host dies; no FIN, no RST
        # Unanswered keepalive pings make the server close the connection ...
        await proxy.server_hung_up.wait()
        # ... and end the engine's subscription, so its handoffs are failed
        # after delivery_timeout instead of waiting for a dead peer forever.
        await streams_until(server, lambda live: "quiet-engine" not in live)
        gauge = server.metrics.registry.get_sample_value("handoff_engine_streams")
        assert gauge == 0
        with contextlib.suppress(asyncio.CancelledError):
            await engine.close()


async def test_connections_are_closed_at_their_maximum_age(start_server: StartServer) -> None:
    server = await start_server(max_connection_age_s=0.3, max_connection_age_grace_s=0.3)
    async with asyncio.timeout(TIMEOUT_S), channel_to(server) as channel:
        stub: Stub = pb_grpc.HandoffCoordinatorStub(channel)
        engine = stub.StreamActions(pb.StreamActionsRequest(engine_id="long-lived"))
        await engine.initial_metadata()
        # After max age plus grace the stream is cut; an engine then resubscribes.
        assert await engine.code() is grpc.StatusCode.UNAVAILABLE
        assert await engine.details() == "max connection age"
        await streams_until(server, lambda live: not live)
        # The channel itself carries on over a new connection.
        assert await absent(stub) is grpc.StatusCode.NOT_FOUND


@pytest.mark.parametrize("batch", [False, True], ids=["one-per-message", "batched"])
async def test_reports_on_connect_are_not_read_faster_than_their_acks(
    start_server: StartServer, batch: bool
) -> None:
    """A peer that sends reports and never reads the acknowledgements is
    slowed down, instead of the server queueing acknowledgements without bound.

    Batched, a written message may carry up to the whole window of acks, so
    one more window's worth can be read before the peer's flow control stops it.
    """
    server = await start_server()
    per_message = 10 if batch else 1
    bound = (3 if batch else 2) * MAX_REPORTS_PER_MESSAGE
    total = 2000

    def processed() -> float:
        labels = {"rpc": "Connect", "code": "NOT_FOUND"}
        return server.metrics.registry.get_sample_value("handoff_rejections_total", labels) or 0

    # A small, fixed receive window: the peer's own transport buffers little.
    options = (("grpc.http2.bdp_probe", 0), ("grpc.http2.lookahead_bytes", 1024))
    async with asyncio.timeout(TIMEOUT_S), channel_to(server, *options) as channel:
        stub: Stub = pb_grpc.HandoffCoordinatorStub(channel)
        unknown = str(uuid.uuid4())
        report = pb.ReportFactRequest(handoff_id=unknown, fact=pb.Fact(timed_out=pb.TimedOut()))

        async def requests() -> AsyncIterator[pb.ConnectRequest]:
            yield pb.ConnectRequest(hello=pb.ConnectHello(engine_id="greedy", batch=batch))
            for first in range(1, total + 1, per_message):
                message = pb.ConnectRequest()
                for number in range(first, first + per_message):
                    message.reports.add(request_id=number, fact=report)
                yield message

        call = stub.Connect(requests())
        await call.initial_metadata()
        while processed() < MAX_REPORTS_PER_MESSAGE:  # noqa: ASYNC110 (a metric has no event)
            await asyncio.sleep(0.01)
        # Not a sleep, which proves nothing on a slow machine: the server answers
        # calls on another connection meanwhile, so it had every chance to read on.
        async with channel_to(server) as other:
            probe: Stub = pb_grpc.HandoffCoordinatorStub(other)
            for _ in range(PROBES):
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await probe.GetHandoff(pb.GetHandoffRequest(handoff_id=unknown))
                assert refused.value.code() is grpc.StatusCode.NOT_FOUND
        assert processed() < bound, "reports were read without backpressure"
        # Reading the acknowledgements lets the rest through.
        acks = [
            ack async for response in call for ack in (response.acks if batch else [response.ack])
        ]
        assert [ack.request_id for ack in acks] == list(range(1, total + 1))
        assert {ack.code for ack in acks} == {grpc.StatusCode.NOT_FOUND.value[0]}
        assert processed() == total


def test_limits_that_cannot_work_are_refused() -> None:
    with pytest.raises(ValueError, match="max_message_bytes must be >= 1"):
        Settings(max_message_bytes=0)
    with pytest.raises(ValueError, match="larger than max_engines"):
        Settings(max_concurrent_rpcs=10, max_engines=10)
    with pytest.raises(ValueError, match="keepalive_time_s and keepalive_timeout_s must be > 0"):
        Settings(keepalive_time_s=0)


MESSAGE_LIMIT = 65536  # the default max_message_bytes


def report_messages() -> st.SearchStrategy[pb.ConnectRequest]:
    """Connect messages of many small reports or fewer large ones, many at or
    near the default message size limit."""
    counts = st.one_of(
        st.integers(0, 2 * MAX_REPORTS_PER_MESSAGE),
        st.integers(MAX_REPORTS_PER_MESSAGE - 2, MAX_REPORTS_PER_MESSAGE + 2),
        st.integers(20_000, 32_767),
    )

    def build(count: int, id_length: int, kinds: list[str]) -> pb.ConnectRequest:
        message = pb.ConnectRequest()
        for index in range(count):
            report = message.reports.add(request_id=index)
            kind = kinds[index % len(kinds)]
            if kind == "fact":
                report.fact.handoff_id = "f" * id_length
                report.fact.fact.canceled.SetInParent()
            elif kind == "outcome":
                report.outcome.handoff_id = str(uuid.UUID(int=index))
                report.outcome.action_id = index
            # "empty": a report with neither, refused in its ack
        return message

    kinds = st.lists(st.sampled_from(["fact", "outcome", "empty"]), min_size=1, max_size=3)
    return st.builds(build, counts, st.integers(0, 600), kinds)


@settings(
    max_examples=30,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(message=report_messages())
async def test_connect_messages_at_the_size_limit_are_refused_or_answered_within_the_caps(
    lean_server: Server, message: pb.ConnectRequest
) -> None:
    reports = len(message.reports)
    async with asyncio.timeout(TIMEOUT_S), channel_to(lean_server) as channel:
        stub: Stub = pb_grpc.HandoffCoordinatorStub(channel)

        async def requests() -> AsyncIterator[pb.ConnectRequest]:
            yield pb.ConnectRequest(hello=pb.ConnectHello(engine_id="fuzzed", batch=True))
            yield message

        call = stub.Connect(requests())
        acks = [ack async for response in _until_end(call) for ack in response.acks]
        code = await call.code()
    if message.ByteSize() > MESSAGE_LIMIT:
        assert code is grpc.StatusCode.RESOURCE_EXHAUSTED
        assert acks == []
    elif reports > MAX_REPORTS_PER_MESSAGE:
        assert code is grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "max_reports_per_message" in (await call.details() or "")
        assert acks == []  # refused before any report was handled
    else:
        assert code is grpc.StatusCode.OK
        # A message with no report at all is acknowledged (as refused) too.
        assert [ack.request_id for ack in acks] == (list(range(reports)) or [0])
        assert {ack.code for ack in acks} <= REFUSAL_NUMBERS | {0}
    assert lean_server.registry.handoffs == {}


async def _until_end(
    call: grpc.aio.StreamStreamCall[pb.ConnectRequest, pb.ConnectResponse],
) -> AsyncIterator[pb.ConnectResponse]:
    """The call's responses until it ends, whatever its status."""
    while True:
        try:
            response = await call.read()
        except grpc.aio.AioRpcError:
            return
        if not isinstance(response, pb.ConnectResponse):
            return  # grpc.aio.EOF: the call ended well
        yield response


async def test_acks_queued_for_a_connect_stream_are_bounded_in_bytes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The reader stops handling a stream's reports once the acks waiting to
    be written weigh more than the bound, and goes on once they are taken."""
    monkeypatch.setattr(servicer, "MAX_OWED_BYTES", 1000)
    registry = Registry(Settings(), Metrics(), time.monotonic)
    service = servicer.Servicer(registry, Metrics())
    message = pb.ConnectRequest()
    for number in range(MAX_REPORTS_PER_MESSAGE):
        report = message.reports.add(request_id=number)
        report.fact.handoff_id = str(uuid.uuid4())  # unknown: each ack carries an error
        report.fact.fact.timed_out.SetInParent()

    async def requests() -> AsyncIterator[pb.ConnectRequest]:
        yield message

    owed = servicer.Owed(batch=True, lean_acks=False)
    ready = servicer.Ready(servicer.Unjournaled())
    async with asyncio.timeout(TIMEOUT_S):
        reader = asyncio.create_task(service._read_reports("e", requests(), owed, ready))
        await ready.wait()  # set when the bound is reached, the writer being wanted
        assert not reader.done()
        (queued,) = owed.responses([])
        one_ack = len(queued.acks[0].message)
        assert 1000 < sum(len(ack.message) for ack in queued.acks) <= 1000 + one_ack
        written = len(queued.acks)
        while not reader.done():
            ready.clear()
            await ready.wait()
            written += sum(len(m.acks) for m in owed.responses([]))
        await reader
    assert written == MAX_REPORTS_PER_MESSAGE
