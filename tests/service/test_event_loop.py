"""`handoff serve --event-loop uvloop` serves the API and drains like the default loop."""

from __future__ import annotations

import asyncio
import signal
import uuid

import grpc

from bench.procs import ServerProcess
from handoff_proto.v1 import coordinator_pb2 as pb
from handoff_proto.v1 import coordinator_pb2_grpc as pb_grpc


async def start_and_read(target: str) -> pb.Handoff:
    async with grpc.aio.insecure_channel(target) as channel:
        stub = pb_grpc.HandoffCoordinatorStub(channel)
        handoff_id = str(uuid.uuid4())
        await stub.StartHandoff(
            pb.StartHandoffRequest(
                handoff_id=handoff_id,
                order=pb.HANDOFF_ORDER_SOURCE_FIRST,
                source_engine_id="prefill-0",
                destination_engine_id="decode-0",
            )
        )
        return (await stub.GetHandoff(pb.GetHandoffRequest(handoff_id=handoff_id))).handoff


def test_uvloop_server_serves_and_exits_cleanly() -> None:
    with ServerProcess.service("--event-loop", "uvloop", name="uvloop") as server:
        handoff = asyncio.run(asyncio.wait_for(start_and_read(server.target), 20))
        assert handoff.phase == pb.PHASE_ACTIVE
        assert [a.kind for a in handoff.outstanding_actions] == [pb.ACTION_KIND_SUBMIT_PREFILL]
        server.process.send_signal(signal.SIGTERM)
        assert server.process.wait(30) == 0
