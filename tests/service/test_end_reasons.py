"""Why a handoff ended, over real gRPC on loopback: GetHandoff's end_reasons,
the COMPLETE notice's end_reason, the SDK's reading of them, ``handoff
inspect`` and the cancellation counter, for every cause the server tells."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import grpc

from handoff_client.convert import action_from_pb, handoff_from_pb
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
    StreamRecorder,
    Stub,
    fact,
    outcome,
    recorders,
    start_request,
    succeed,
)
from tests.support.servers import StartServer


@contextlib.asynccontextmanager
async def connected(server: Server, seconds: float) -> AsyncIterator[Stub]:
    """A stub on ``server``, for at most ``seconds``."""
    async with (
        asyncio.timeout(seconds),
        grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel,
    ):
        yield pb_grpc.HandoffCoordinatorStub(channel)


async def reasons(stub: Stub, handoff_id: str) -> list[pb.EndReason]:
    state = await stub.GetHandoff(pb.GetHandoffRequest(handoff_id=handoff_id))
    return list(state.handoff.end_reasons)


async def test_each_cause_is_told_apart(server: Server) -> None:
    async with connected(server, 10) as stub:
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
        # Counted as each completes: the failed one still owes its CancelSource.
        counted = server.metrics.registry.get_sample_value
        for cause, count in (("frontend_canceled", 1), ("action_failed", 0), ("engine_lost", 2)):
            assert counted("handoff_cancellations_total", {"reason": cause}) == count


async def test_deadline_and_unreachable_engine_and_inspect(start_server: StartServer) -> None:
    server = await start_server(delivery_timeout_s=0.5)
    async with connected(server, 10) as stub, recorders(stub, SOURCE) as (source,):
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


NOOP = pb.Outcome(kind=pb.OUTCOME_KIND_NOOP)


async def test_the_complete_notice_says_why_on_the_stream_and_in_the_answer(
    server: Server,
) -> None:
    async with connected(server, 10) as stub, recorders(stub, SOURCE) as (source,):
        handoff_id = (await stub.StartHandoff(start_request())).handoff.handoff_id
        await source.wait_for(handoff_id, 0)  # SubmitPrefill reached it
        failed = pb.Fact(failed=pb.Failed(reason="router gave up"))
        await fact(stub, handoff_id, failed)  # CancelSource#1
        answer = await outcome(stub, handoff_id, 1, NOOP)
        (complete,) = answer.actions
        streamed = await source.wait_for(handoff_id, 2)
        assert streamed.kind == complete.kind == pb.ACTION_KIND_COMPLETE
        for message in (complete, streamed):
            assert (message.end_reason.cause, message.end_reason.detail) == (
                pb.END_CAUSE_FAILED,
                "router gave up",
            )
        # The SDK reads it; an action that is not COMPLETE has none.
        assert (
            action_from_pb(streamed).end_reason == handoff_from_pb(answer.handoff).end_reasons[-1]
        )
        submit = await source.wait_for(handoff_id, 0)
        assert action_from_pb(submit).end_reason is None


async def test_a_restarted_and_a_reconciled_engine_are_told_apart(server: Server) -> None:
    async with connected(server, 10) as stub:
        first = StreamRecorder(stub, SOURCE, incarnation="first")
        await first.subscribed()
        restarted = (await stub.StartHandoff(start_request())).handoff.handoff_id
        await first.wait_for(restarted, 0)  # the old process had its SubmitPrefill
        second = StreamRecorder(stub, SOURCE, incarnation="second")
        await second.subscribed()  # registered: the old incarnation's handoffs are lost
        (reason,) = await reasons(stub, restarted)
        assert (reason.cause, reason.role, reason.engine_id, reason.lost_cause) == (
            pb.END_CAUSE_ENGINE_LOST,
            pb.ROLE_SOURCE,
            SOURCE,
            pb.LOST_CAUSE_RESTARTED,
        )

        reconciled = (await stub.StartHandoff(start_request())).handoff.handoff_id
        await second.wait_for(reconciled, 0)
        freed = pb.HeldSide(handoff_id=reconciled, role=pb.ROLE_SOURCE)
        await stub.Reconcile(
            pb.ReconcileRequest(engine_id=SOURCE, incarnation="second", freed=[freed])
        )
        (reason,) = await reasons(stub, reconciled)
        assert (reason.cause, reason.role, reason.lost_cause) == (
            pb.END_CAUSE_ENGINE_LOST,
            pb.ROLE_SOURCE,
            pb.LOST_CAUSE_RECONCILED,
        )
        await first.close()
        await second.close()


async def test_a_drain_is_the_reason_its_complete_notice_gives(
    start_server: StartServer,
) -> None:
    server = await start_server(drain_grace_s=0.3)
    async with connected(server, 15) as stub, recorders(stub, SOURCE) as (source,):
        handoff_id = (await stub.StartHandoff(start_request())).handoff.handoff_id
        await source.wait_for(handoff_id, 0)
        stopping = asyncio.create_task(server.stop())
        await source.wait_for(handoff_id, 1)  # CancelSource: the grace ran out
        answer = await outcome(stub, handoff_id, 1, NOOP)
        (complete,) = answer.actions
        assert (complete.end_reason.cause, complete.end_reason.detail) == (
            pb.END_CAUSE_DRAIN,
            "server shutting down",
        )
        (reason,) = answer.handoff.end_reasons
        assert reason == complete.end_reason
        await stopping
