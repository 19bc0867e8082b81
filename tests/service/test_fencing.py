"""Incarnations and fencing over real gRPC on loopback: twins and older incarnations
are refused with a reason the sidecar can act on, a restart loses the right handoffs."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from typing import Any, TypeAlias

import grpc
import pytest

from handoff_proto.v1 import coordinator_pb2 as pb
from handoff_proto.v1 import coordinator_pb2_grpc as pb_grpc
from handoff_server.service.app import Server
from tests.support.rpc import DESTINATION, SOURCE, ConnectEngine, StreamRecorder

Stub: TypeAlias = "pb_grpc.HandoffCoordinatorAsyncStub"
OLD, NEW = "1764547200000-0a1b", "1764547260000-2c3d"


@pytest.fixture
async def stub(server: Server) -> AsyncIterator[Stub]:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        yield pb_grpc.HandoffCoordinatorStub(channel)


def start(source: str = SOURCE) -> pb.StartHandoffRequest:
    return pb.StartHandoffRequest(
        handoff_id=str(uuid.uuid4()),
        engine_type=pb.ENGINE_TYPE_VLLM,
        source_engine_id=source,
        destination_engine_id=DESTINATION,
        fallback_transfer_delay_ms=5.0,
    )


async def refusal(engine: StreamRecorder | ConnectEngine) -> tuple[str, str]:
    """How a refused subscription ended: its handoff-fence values and its message."""
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await engine.stream_ended()
    error = refused.value
    assert error.code() is grpc.StatusCode.FAILED_PRECONDITION
    metadata: Any = error.trailing_metadata() or ()  # grpc's stubs type it loosely
    fences = [value for key, value in metadata if key == "handoff-fence"]
    return str(fences), error.details() or ""


async def test_a_twin_sidecar_is_refused_while_the_first_is_live(stub: Stub) -> None:
    async with asyncio.timeout(10):
        first = StreamRecorder(stub, SOURCE, OLD, "aaaaaaaa-first-session")
        await first.subscribed()
        twin = StreamRecorder(stub, SOURCE, OLD, "bbbbbbbb-second-session")
        fence, message = await refusal(twin)
        assert fence == "['session-conflict']"
        assert SOURCE in message
        assert "aaaaaaaa" in message
        assert "bbbbbbbb" in message
        assert "first-session" not in message  # sessions are shown truncated
        handoff_id = (await stub.StartHandoff(start())).handoff.handoff_id
        assert (await first.wait_for(handoff_id, 0)).attempt == 1  # the first kept its stream
        await first.close()


async def test_an_older_incarnation_is_refused_on_connect(stub: Stub) -> None:
    async with asyncio.timeout(10):
        newer = ConnectEngine(stub, SOURCE, incarnation=NEW, session_id="s-new")
        await newer.subscribed()
        older = ConnectEngine(stub, SOURCE, incarnation=OLD, session_id="s-old")
        fence, message = await refusal(older)
        assert fence == "['older-incarnation']"
        assert OLD in message
        assert NEW in message
        assert SOURCE in message
        await newer.close()


async def test_a_new_incarnation_loses_the_handoffs_its_old_one_had(stub: Stub) -> None:
    async with asyncio.timeout(10):
        old = StreamRecorder(stub, SOURCE, OLD, "s1")
        other = StreamRecorder(stub, "prefill-other", OLD, "o1")
        for engine in (old, other):
            await engine.subscribed()
        reached = (await stub.StartHandoff(start())).handoff.handoff_id
        untouched = (await stub.StartHandoff(start("prefill-other"))).handoff.handoff_id
        await old.wait_for(reached, 0)
        await other.wait_for(untouched, 0)
        new = StreamRecorder(stub, SOURCE, NEW, "s2")
        notice = await new.wait_for(reached, 1)  # Complete, at once: the prefill is gone
        assert notice.kind == pb.ACTION_KIND_COMPLETE
        assert notice.completion == pb.COMPLETION_CANCELED
        lost = await stub.GetHandoff(pb.GetHandoffRequest(handoff_id=reached))
        assert pb.LIFECYCLE_EVENT_KIND_SOURCE_LOST in [e.kind for e in lost.handoff.lifecycle]
        kept = await stub.GetHandoff(pb.GetHandoffRequest(handoff_id=untouched))
        assert kept.handoff.phase == pb.PHASE_ACTIVE
        assert not new.received[(reached, 0)]  # SubmitPrefill is not redelivered to it
        for engine in (old, other, new):
            await engine.close()


async def test_the_same_session_reconnects_and_gets_its_actions_again(stub: Stub) -> None:
    async with asyncio.timeout(10):
        first = StreamRecorder(stub, SOURCE, OLD, "s1")
        await first.subscribed()
        handoff_id = (await stub.StartHandoff(start())).handoff.handoff_id
        await first.wait_for(handoff_id, 0)
        again = StreamRecorder(stub, SOURCE, OLD, "s1")
        assert (await again.wait_for(handoff_id, 0)).attempt == 2
        assert await first.stream_ended() is grpc.StatusCode.OK
        await again.close()
