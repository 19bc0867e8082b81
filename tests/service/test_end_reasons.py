"""Why a handoff ended, over real gRPC on loopback: GetHandoff's end_reasons,
the SDK's reading of them, ``handoff inspect`` and the cancellation counter."""

from __future__ import annotations

import asyncio

import grpc

from handoff_client.convert import handoff_from_pb
from handoff_client.model import EndCause, LostCause
from handoff_proto.v1 import coordinator_pb2 as pb
from handoff_proto.v1 import coordinator_pb2_grpc as pb_grpc
from handoff_server.commands.inspect_cmd import render
from handoff_server.service.app import Server
from tests.support.rpc import (
    CANCELED,
    HELD,
    SOURCE,
    SUBMITTED,
    Stub,
    fact,
    outcome,
    recorders,
    start_request,
    succeed,
)
from tests.support.servers import StartServer


async def reasons(stub: Stub, handoff_id: str) -> list[pb.EndReason]:
    state = await stub.GetHandoff(pb.GetHandoffRequest(handoff_id=handoff_id))
    return list(state.handoff.end_reasons)


async def test_each_cause_is_told_apart(server: Server) -> None:
    async with (
        asyncio.timeout(10),
        grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel,
    ):
        stub: Stub = pb_grpc.HandoffCoordinatorStub(channel)
        canceled = (await stub.StartHandoff(start_request())).handoff.handoff_id
        await fact(stub, canceled, CANCELED)
        (reason,) = await reasons(stub, canceled)
        assert (reason.cause, reason.detail) == (pb.END_CAUSE_FRONTEND_CANCELED, "client went away")

        failed = (await stub.StartHandoff(start_request())).handoff.handoff_id
        no_blocks = pb.Outcome(kind=pb.OUTCOME_KIND_FAILED, reason="out of KV blocks")
        await outcome(stub, failed, 0, no_blocks)
        (reason,) = await reasons(stub, failed)
        assert (reason.cause, reason.action, reason.engine_id, reason.detail) == (
            pb.END_CAUSE_ACTION_FAILED,
            pb.ACTION_KIND_SUBMIT_PREFILL,
            SOURCE,
            "out of KV blocks",
        )

        lost = (await stub.StartHandoff(start_request())).handoff.handoff_id
        await fact(stub, lost, pb.Fact(engine_lost=pb.EngineLost(role=pb.ROLE_SOURCE)))
        (reason,) = await reasons(stub, lost)
        assert (reason.cause, reason.role, reason.lost_cause) == (
            pb.END_CAUSE_ENGINE_LOST,
            pb.ROLE_SOURCE,
            pb.LOST_CAUSE_REPORTED,
        )

        reopened = (await stub.StartHandoff(start_request())).handoff.handoff_id
        await succeed(stub, reopened)
        await fact(stub, reopened, pb.Fact(engine_lost=pb.EngineLost(role=pb.ROLE_DESTINATION)))
        assert [r.cause for r in await reasons(stub, reopened)] == [
            pb.END_CAUSE_SUCCEEDED,
            pb.END_CAUSE_ENGINE_LOST,
        ]
        assert server.metrics.cancellations_by  # the counter exists with its label


async def test_deadline_and_unreachable_engine_and_inspect(start_server: StartServer) -> None:
    server = await start_server(delivery_timeout_s=0.5)
    async with (
        asyncio.timeout(10),
        grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel,
    ):
        stub: Stub = pb_grpc.HandoffCoordinatorStub(channel)
        async with recorders(stub, SOURCE) as (source,):
            timed = (await stub.StartHandoff(start_request(timeout_s=0.3))).handoff.handoff_id
            await outcome(stub, timed, 0, SUBMITTED)
            await source.wait_for(timed, 1)  # CancelSource
            (reason,) = await reasons(stub, timed)
            assert reason.cause == pb.END_CAUSE_DEADLINE

            unreachable = (await stub.StartHandoff(start_request())).handoff.handoff_id
            await outcome(stub, unreachable, 0, SUBMITTED)
            await fact(stub, unreachable, HELD)  # ReserveDestination: nobody listens
            await source.wait_for(unreachable, 2)  # CancelSource
            state = await stub.GetHandoff(pb.GetHandoffRequest(handoff_id=unreachable))
            handoff = handoff_from_pb(state.handoff)
            (lost,) = handoff.end_reasons
            assert (lost.cause, lost.lost_cause) == (EndCause.ENGINE_LOST, LostCause.UNREACHABLE)
            assert "ended        engine_lost: destination decode-0 (unreachable)" in render(handoff)
