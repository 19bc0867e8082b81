"""Engines a handoff names before they ever connected: what a later engine under
that id hears, and what a start naming one does (counted, logged, or refused)."""

from __future__ import annotations

import asyncio
import logging

import grpc
import pytest

from handoff_proto.v1 import coordinator_pb2 as pb
from handoff_proto.v1 import coordinator_pb2_grpc as pb_grpc
from handoff_server.domain.model import ActionKind, Completion
from tests.support.registry import DESTINATION as DECODE
from tests.support.registry import Harness, kinds
from tests.support.rpc import DESTINATION, SOURCE, StreamRecorder, start_request
from tests.support.servers import StartServer

TIMEOUT_S = 10.0


def test_a_complete_for_an_engine_lost_before_it_connected_reaches_no_later_engine() -> None:
    """A new decode under the id once got the COMPLETE of a handoff that ended
    before it connected, and the README program took it as its own."""
    h = Harness(delivery_timeout_s=1.0)
    stray = h.start()
    h.advance(1.0)  # neither engine ever connected: both are lost
    assert h.registry.get(stray).core.completion is Completion.CANCELED
    h.subscribe(DECODE)
    assert kinds(h.drain(DECODE)) == []


def test_a_complete_still_reaches_an_engine_that_connected_and_went_away() -> None:
    h = Harness(delivery_timeout_s=1.0)
    stream = h.subscribe(DECODE)
    handoff_id = h.start()
    h.registry.delivery.unsubscribe(stream)
    h.advance(1.0)
    assert h.registry.get(handoff_id).core.completion is Completion.CANCELED
    h.subscribe(DECODE)
    assert ActionKind.COMPLETE in kinds(h.drain(DECODE))


def unknown_starts(server: object) -> float:
    sample = server.metrics.registry.get_sample_value(  # type: ignore[attr-defined]
        "handoff_unknown_engine_starts_total"
    )
    return 0.0 if sample is None else float(sample)


async def test_a_start_naming_engines_never_seen_is_counted_and_logged_once(
    start_server: StartServer, caplog: pytest.LogCaptureFixture
) -> None:
    server = await start_server()
    async with (
        asyncio.timeout(TIMEOUT_S),
        grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel,
    ):
        stub = pb_grpc.HandoffCoordinatorStub(channel)
        with caplog.at_level(logging.WARNING, logger="handoff.newcomers"):
            await stub.StartHandoff(start_request())
            await stub.StartHandoff(start_request())
        assert unknown_starts(server) == 2
        logged = [r.getMessage() for r in caplog.records if r.name == "handoff.newcomers"]
        assert len(logged) == 2  # once per engine id
        assert any(SOURCE in line for line in logged)
        assert all("--require-known-engines" in line for line in logged)
        streams = [StreamRecorder(stub, SOURCE), StreamRecorder(stub, DESTINATION)]
        await asyncio.gather(*(s.subscribed() for s in streams))
        await stub.StartHandoff(start_request())
        assert unknown_starts(server) == 2  # both known now
        for stream in streams:
            await stream.close()


async def test_require_known_engines_refuses_naming_the_engine_and_the_flag(
    start_server: StartServer,
) -> None:
    server = await start_server(require_known_engines=True)
    async with (
        asyncio.timeout(TIMEOUT_S),
        grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel,
    ):
        stub = pb_grpc.HandoffCoordinatorStub(channel)
        source = StreamRecorder(stub, SOURCE)
        await source.subscribed()
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await stub.StartHandoff(start_request())
        assert caught.value.code() is grpc.StatusCode.FAILED_PRECONDITION
        details = caught.value.details() or ""
        assert f"engine {DESTINATION} has not subscribed" in details
        assert SOURCE + " " not in details.split("engine ")[1]  # the known one is not named
        assert "--require-known-engines" in details
        destination = StreamRecorder(stub, DESTINATION)
        await destination.subscribed()
        answer = await stub.StartHandoff(start_request())
        assert answer.handoff.phase == pb.PHASE_ACTIVE
        for stream in (source, destination):
            await stream.close()
