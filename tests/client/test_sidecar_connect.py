"""ConnectTransport against a real server: typed refusals, a stream cut mid-report, replacement.

The stream is cut by a TCP relay between the sidecar's channel and the
server (a real network fault, nothing mocked): it can stall the engine's
bytes, so a report is in flight and stays unacknowledged, then cut every
connection through it.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import pytest

from handoff_client import (
    ActionKind,
    Completion,
    ConnectTransport,
    EngineSidecar,
    EngineType,
    HandoffClient,
    LifecycleEventKind,
    Outcome,
    OutcomeKind,
    SourceHeld,
    TimingMode,
    TransferCompleted,
    TransferTiming,
    new_incarnation,
)
from handoff_client.connect import MAX_BUFFERED_ACTIONS
from handoff_client.errors import (
    DeadlineExceededError,
    FailedPreconditionError,
    HandoffRpcError,
    InvalidArgumentError,
    NotFoundError,
)
from handoff_client.model import Action
from handoff_client.sidecar import Facts
from handoff_client.transport import TRANSPORT_KINDS, TransportKind, make_transport
from handoff_proto.v1 import coordinator_pb2 as pb
from handoff_server.service.app import Server
from handoff_server.service.servicer import Servicer
from tests.support.servers import FAST_RECONNECT, StartServer
from tests.support.sidecar import (
    DESTINATION,
    SOURCE,
    TIMEOUT_S,
    ScriptedEngine,
    WatchedTransport,
    running,
    start,
)

HELD = SourceHeld(TransferTiming(TimingMode.FULL_PROMPT, 512, 131072, 50.0))


@pytest.fixture
async def client(lean_server: Server) -> AsyncIterator[HandoffClient]:
    async with HandoffClient(f"127.0.0.1:{lean_server.port}", timeout_s=TIMEOUT_S) as client:
        yield client


async def refusals(
    client: HandoffClient, kind: TransportKind
) -> list[tuple[type[HandoffRpcError], str]]:
    """Three refused reports on a fresh handoff through one transport: each
    exception's class and details, with the handoff ids made neutral."""
    transport = make_transport(client, kind)
    subscribed = asyncio.Event()
    actions = transport.subscribe(SOURCE, subscribed.set, incarnation="", session_id="")
    first = asyncio.create_task(anext(actions))
    try:
        await subscribed.wait()
        handoff_id = await start(client)
        submit = await first  # SubmitPrefill, for this engine
        unknown = str(uuid.uuid4())
        caught: list[tuple[type[HandoffRpcError], str]] = []
        for report in (
            transport.report_outcome(handoff_id, submit.id, Outcome(OutcomeKind.APPLIED)),
            transport.report_fact(handoff_id, HELD),  # before SUBMITTED: out of order
            transport.report_fact(unknown, TransferCompleted()),
        ):
            with pytest.raises(HandoffRpcError) as refused:
                await report
            details = refused.value.details.replace(handoff_id, "ID").replace(unknown, "ID")
            caught.append((type(refused.value), details))
        # The stream outlives its refusals: the right answer is accepted on it.
        await transport.report_outcome(handoff_id, submit.id, Outcome(OutcomeKind.SUBMITTED))
        await transport.report_fact(handoff_id, HELD)
        return caught
    finally:
        await actions.aclose()


async def test_a_refused_report_raises_what_the_unary_call_raises(client: HandoffClient) -> None:
    async with asyncio.timeout(TIMEOUT_S):
        by_kind = {kind: await refusals(client, kind) for kind in TRANSPORT_KINDS}
    connect = by_kind["connect"]
    assert [cls for cls, _ in connect] == [
        InvalidArgumentError,
        FailedPreconditionError,
        NotFoundError,
    ]
    assert connect[0][1] == (
        "handoff ID, action 0, outcome OUTCOME_KIND_APPLIED: invalid handoff action outcome Applied"
    )
    assert connect == by_kind["unary"]  # same classes, same messages


async def test_a_refused_fact_reaches_the_engine_typed_and_is_not_retried(
    client: HandoffClient,
) -> None:
    engine = ScriptedEngine()
    async with running(client, SOURCE, engine) as sidecar, asyncio.timeout(TIMEOUT_S):
        with pytest.raises(NotFoundError, match="no such handoff"):
            await sidecar.facts.failed(str(uuid.uuid4()), "decode OOM")
    assert sidecar.stats.report_retries == 0


async def test_a_report_with_no_stream_gives_up_at_the_client_deadline(
    lean_server: Server,
) -> None:
    async with HandoffClient(f"127.0.0.1:{lean_server.port}", timeout_s=0.2) as client:
        transport = ConnectTransport(client)  # never subscribed: no stream to report on
        async with asyncio.timeout(TIMEOUT_S):
            with pytest.raises(DeadlineExceededError):
                await transport.report_fact(str(uuid.uuid4()), TransferCompleted())


async def test_an_ack_behind_more_actions_than_the_buffer_holds_still_arrives(
    client: HandoffClient,
) -> None:
    transport = ConnectTransport(client)
    subscribed = asyncio.Event()
    async with (
        contextlib.aclosing(
            transport.subscribe(SOURCE, subscribed.set, incarnation="", session_id="")
        ) as actions,
        asyncio.timeout(TIMEOUT_S),
    ):
        first = asyncio.create_task(anext(actions))  # the stream opens when read
        await subscribed.wait()
        # More SubmitPrefills than the reader buffers, one taken by the engine:
        # the reader parks, and the ack of the report below comes after them all.
        count = MAX_BUFFERED_ACTIONS + 44
        handoff_ids = await asyncio.gather(*(start(client) for _ in range(count)))
        await first
        await transport.report_outcome(handoff_ids[-1], 0, Outcome(OutcomeKind.SUBMITTED))
    handoff = await client.get_handoff(handoff_ids[-1])
    assert handoff.outstanding_actions == ()


@dataclass
class _Link:
    client: tuple[asyncio.StreamReader, asyncio.StreamWriter]
    server: tuple[asyncio.StreamReader, asyncio.StreamWriter]
    pumps: list[asyncio.Task[None]]


class Relay:
    """A TCP relay to the server that a test can stall (the engine's bytes are
    dropped, so nothing it sends arrives) and then cut (every connection
    through it is reset); connections made after a cut are relayed normally."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.stalled = False
        self._links: list[_Link] = []
        self._listener: asyncio.Server | None = None
        self.port = 0

    async def __aenter__(self) -> Relay:
        self._listener = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        self.port = self._listener.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        assert self._listener is not None
        self._listener.close()
        self.cut()
        await asyncio.gather(*(p for link in self._links for p in link.pumps))
        await self._listener.wait_closed()

    def stall(self) -> None:
        self.stalled = True

    def cut(self) -> None:
        for link in self._links:
            for _, writer in (link.client, link.server):
                writer.transport.abort()
        self.stalled = False

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        upstream = await asyncio.open_connection("127.0.0.1", self.target_port)
        link = _Link((reader, writer), upstream, [])
        link.pumps += [
            asyncio.create_task(self._pump(reader, upstream[1], from_engine=True)),
            asyncio.create_task(self._pump(upstream[0], writer, from_engine=False)),
        ]
        self._links.append(link)

    async def _pump(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, from_engine: bool
    ) -> None:
        try:
            while data := await reader.read(65536):
                if from_engine and self.stalled:
                    continue
                writer.write(data)
                await writer.drain()
        except ConnectionError:
            pass  # cut
        finally:
            writer.transport.abort()


async def test_a_cut_stream_resends_what_was_unacknowledged_and_answers_from_the_cache(
    lean_server: Server,
) -> None:
    target = f"127.0.0.1:{lean_server.port}"
    prefill, decode = ScriptedEngine(), ScriptedEngine()
    async with (
        Relay(lean_server.port) as relay,
        HandoffClient(target, timeout_s=TIMEOUT_S) as client,
        HandoffClient(
            f"127.0.0.1:{relay.port}", timeout_s=TIMEOUT_S, channel_options=FAST_RECONNECT
        ) as relayed,
    ):

        async def accept_into_the_void(action: Action, facts: Facts) -> Outcome:
            relay.stall()  # from here on, nothing the decode engine sends arrives
            return await decode.reserved(action, facts)  # ACCEPTED, DestinationReserved later

        decode.overrides[ActionKind.RESERVE_DESTINATION] = accept_into_the_void
        connect = ConnectTransport(relayed)
        watched = WatchedTransport(connect)
        async with (
            running(client, SOURCE, prefill),
            running(watched, DESTINATION, decode) as d,
            asyncio.timeout(TIMEOUT_S / 2),  # below the reports' deadline: no late rescue
        ):
            handoff_id = await start(client)
            await watched.outcome_sent.wait()
            assert connect.unacknowledged == 1  # ACCEPTED is on the wire, unanswered
            relay.cut()
            # The sidecar reconnects; ReserveDestination comes again (attempt 2)
            # and is answered from the cache, and the outbox sends ACCEPTED again,
            # then DestinationReserved, on the new stream.
            await decode.notices[handoff_id].get()
            handoff = await client.get_handoff(handoff_id)
    assert handoff.completion is Completion.SUCCESS
    assert LifecycleEventKind.DESTINATION_RESERVED in [e.kind for e in handoff.lifecycle]
    assert decode.count(ActionKind.RESERVE_DESTINATION) == 1  # the handler ran once
    assert d.stats.answered_from_cache == 1
    assert d.stats.report_retries >= 1  # ACCEPTED failed with the stream, and was sent again
    assert d.stats.reports_rejected == 0
    assert d.stats.reconnects >= 1


async def test_a_sidecar_restarted_beside_its_engine_resumes_its_actions(
    client: HandoffClient,
) -> None:
    # The engine outlives its sidecar: the new sidecar names the engine's
    # incarnation, so the server resends what was outstanding instead of
    # declaring the engine lost (a new incarnation: tests/client/test_sidecar_fencing.py).
    prefill, first, second = ScriptedEngine(), ScriptedEngine(), ScriptedEngine()
    hung = asyncio.Event()

    async def never_answers(action: Action, facts: Facts) -> Outcome:
        hung.set()
        await asyncio.Event().wait()
        raise AssertionError("unreachable")

    first.overrides[ActionKind.RESERVE_DESTINATION] = never_answers
    old = EngineSidecar(client, DESTINATION, first, incarnation=new_incarnation())
    async with running(client, SOURCE, prefill), asyncio.timeout(TIMEOUT_S):
        old.start()
        await old.wait_subscribed()
        handoff_id = await start(client)
        await hung.wait()  # the first sidecar took ReserveDestination and hangs
        await old.stop(grace_s=0)  # ... and its process dies
        async with running(client, DESTINATION, second, incarnation=old.incarnation) as new:
            await second.notices[handoff_id].get()
            handoff = await client.get_handoff(handoff_id)
    assert handoff.completion is Completion.SUCCESS
    assert LifecycleEventKind.DESTINATION_LOST not in [e.kind for e in handoff.lifecycle]
    (reserve,) = [a for a in second.calls if a.kind is ActionKind.RESERVE_DESTINATION]
    assert reserve.attempt == 2  # redelivered to the restarted sidecar
    assert first.count(ActionKind.RESERVE_DESTINATION) == 1
    assert new.session_id != old.session_id


@pytest.fixture
async def recorded(
    start_lean_server: StartServer, monkeypatch: pytest.MonkeyPatch
) -> tuple[Server, list[pb.ConnectRequest]]:
    """A real server that keeps every Connect message it reads."""
    read: list[pb.ConnectRequest] = []
    connect = Servicer.Connect

    def recording(
        self: Servicer, requests: AsyncIterator[pb.ConnectRequest], context: Any
    ) -> AsyncIterator[pb.ConnectResponse]:
        async def kept() -> AsyncIterator[pb.ConnectRequest]:
            async for request in requests:
                read.append(request)
                yield request

        return connect(self, kept(), context)

    monkeypatch.setattr(Servicer, "Connect", recording)  # bound when the server starts
    return await start_lean_server(), read


@pytest.mark.parametrize("stack", [EngineType.VLLM, EngineType.SGLANG])
async def test_an_outcome_and_the_fact_after_it_leave_in_one_message(
    recorded: tuple[Server, list[pb.ConnectRequest]], stack: EngineType
) -> None:
    # The sidecar sends a fact behind its action's outcome before the
    # outcome's ack (the stream keeps them in order): a handoff's eight
    # reports take five messages, not eight, and none is refused.
    server, read = recorded
    source, destination = ScriptedEngine(), ScriptedEngine()
    async with (
        HandoffClient(f"127.0.0.1:{server.port}", timeout_s=TIMEOUT_S) as client,
        running(client, SOURCE, source) as s,
        running(client, DESTINATION, destination) as d,
        asyncio.timeout(TIMEOUT_S),
    ):
        handoff_id = await start(client, stack)
        await source.notices[handoff_id].get()
        await destination.notices[handoff_id].get()
        handoff = await client.get_handoff(handoff_id)
    assert handoff.completion is Completion.SUCCESS
    messages = [
        [report.WhichOneof("kind") for report in message.reports]
        for message in read
        if any(report.fact.handoff_id or report.outcome.handoff_id for report in message.reports)
    ]
    assert sorted(messages) == sorted(
        [["outcome", "fact"]] * 3 + [["outcome"]] * 2
    )  # SubmitPrefill, ReserveDestination and StartTransfer each with their fact
    assert s.stats.reports_rejected == d.stats.reports_rejected == 0
