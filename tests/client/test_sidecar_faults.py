"""The SDK's failures of issue #11, over real gRPC on loopback.

Against the real server: stuck handlers must not starve cleanup, and twin
sidecars must not make asyncio report a generator closed while running.
What the real server cannot be made to send (an action kind from a newer
server, a fencing refusal, an answer lost after StartHandoff was applied)
comes from a scripted coordinator: a real gRPC server on a loopback port
whose answers the test chooses; the SDK under test is unchanged.
"""

from __future__ import annotations

import asyncio
import gc
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import grpc
import pytest

from handoff_client import (
    SUBMITTED,
    Action,
    ActionKind,
    EngineSidecar,
    EngineType,
    Facts,
    HandoffClient,
    Outcome,
    TransportKind,
    new_incarnation,
)
from handoff_client.errors import FENCE_KEY, OlderIncarnationError
from handoff_client.retry import Backoff, RetryPolicy
from handoff_client.transport import TRANSPORT_KINDS
from handoff_proto.v1 import coordinator_pb2 as pb
from handoff_proto.v1 import coordinator_pb2_grpc as pb_grpc
from handoff_server.service.app import Server
from tests.support.sidecar import QUICK, SOURCE, TIMEOUT_S, ScriptedEngine, running

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(params=TRANSPORT_KINDS)
def kind(request: pytest.FixtureRequest) -> TransportKind:
    """The transport the test's sidecars use."""
    kind: TransportKind = request.param
    return kind


@pytest.fixture
async def client(lean_server: Server) -> AsyncIterator[HandoffClient]:
    async with HandoffClient(f"127.0.0.1:{lean_server.port}", timeout_s=TIMEOUT_S) as client:
        yield client


async def start_vllm(client: HandoffClient, handoff_id: str | None = None) -> str:
    handoff_id = handoff_id or str(uuid.uuid4())
    await client.start_handoff(
        handoff_id,
        engine_type=EngineType.VLLM,
        source_engine_id=SOURCE,
        destination_engine_id="decode-absent",
    )
    return handoff_id


async def test_cleanup_runs_while_every_handler_slot_is_stuck(
    client: HandoffClient, kind: TransportKind
) -> None:
    prefill = ScriptedEngine()
    healthy = {str(uuid.uuid4()) for _ in range(2)}
    stuck_in = asyncio.Semaphore(0)
    hang = asyncio.Event()

    async def submit(action: Action, facts: Facts) -> Outcome:
        if action.handoff_id in healthy:
            return SUBMITTED  # no SourceHeld: the handoff waits, holding
        stuck_in.release()
        await hang.wait()  # longer than the test
        return SUBMITTED

    prefill.overrides[ActionKind.SUBMIT_PREFILL] = submit
    async with running(client, SOURCE, prefill, transport=kind, max_concurrency=2):
        async with asyncio.timeout(TIMEOUT_S):
            for handoff_id in healthy:
                await start_vllm(client, handoff_id)
            stuck = [await start_vllm(client) for _ in range(2)]
            for _ in stuck:
                await stuck_in.acquire()

            # Every handler slot is taken. The frontend cancels the healthy ones.
            for handoff_id in healthy:
                await client.cancel(handoff_id, "user went away")
            for handoff_id in healthy:
                await prefill.notices[handoff_id].get()  # COMPLETE: CancelSource was applied
        hang.set()
    assert prefill.count(ActionKind.CANCEL_SOURCE) == 2


async def test_twin_sidecars_leave_no_generator_closed_while_running(
    client: HandoffClient,
) -> None:
    loop = asyncio.get_running_loop()
    errors: list[dict[str, Any]] = []
    previous = loop.get_exception_handler()
    loop.set_exception_handler(lambda _, context: errors.append(context))
    try:
        # Misconfigured twins: one engine id, one incarnation, two sidecars.
        incarnation = new_incarnation()
        one, two = (
            EngineSidecar(
                client, SOURCE, ScriptedEngine(), reconnect_backoff=QUICK, incarnation=incarnation
            )
            for _ in range(2)
        )
        async with one, two, asyncio.timeout(TIMEOUT_S):
            waits = [asyncio.create_task(twin.wait_subscribed()) for twin in (one, two)]
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
            for wait in waits:
                wait.cancel()
            # Whichever came second is refused while the first's stream is
            # live (a server without sessions lets them replace each other).
            await asyncio.sleep(0.5)
        gc.collect()  # a destroyed pending task reports when it is collected
        await asyncio.sleep(0)
    finally:
        loop.set_exception_handler(previous)
    assert [context.get("message") for context in errors] == []


# --- a scripted coordinator -------------------------------------------------------


@dataclass
class Script:
    """One subscription's fate: refused, or sent ``actions`` (and ended after an outcome)."""

    actions: list[pb.Action] = field(default_factory=list)
    refusal: tuple[str, str] | None = None  # (handoff-fence value, message)
    end_after_outcome: bool = False


class Scripted(pb_grpc.HandoffCoordinatorServicer):
    """A coordinator that answers each subscription with the next script."""

    def __init__(self) -> None:
        self.scripts: list[Script] = []
        self.hellos: list[tuple[str, str, str]] = []  # (engine id, incarnation, session)
        self.outcomes: asyncio.Queue[pb.ReportOutcomeRequest] = asyncio.Queue()
        self.outcome_arrived = asyncio.Event()
        self.starts: list[Callable[[], Awaitable[pb.StartHandoffResponse]]] = []

    async def _subscription(
        self, hello: tuple[str, str, str], context: grpc.aio.ServicerContext[Any, Any]
    ) -> Script:
        self.hellos.append(hello)
        script = self.scripts.pop(0) if self.scripts else Script()
        if script.refusal is not None:
            fence, message = script.refusal
            context.set_trailing_metadata(((FENCE_KEY, fence),))
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, message)
        await context.send_initial_metadata(())
        return script

    def _outcome(self, request: pb.ReportOutcomeRequest) -> None:
        self.outcomes.put_nowait(request)
        self.outcome_arrived.set()

    async def StreamActions(
        self, request: pb.StreamActionsRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> AsyncIterator[pb.Action]:
        hello = (request.engine_id, request.incarnation, request.session_id)
        script = await self._subscription(hello, context)
        self.outcome_arrived.clear()
        for action in script.actions:
            yield action
        await self.outcome_arrived.wait()
        if not script.end_after_outcome:
            await asyncio.Event().wait()

    async def Connect(
        self,
        request_iterator: AsyncIterator[pb.ConnectRequest],
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> AsyncIterator[pb.ConnectResponse]:
        first = await anext(aiter(request_iterator))
        hello = (first.hello.engine_id, first.hello.incarnation, first.hello.session_id)
        script = await self._subscription(hello, context)
        if script.actions:
            yield pb.ConnectResponse(actions=script.actions)
        async for request in request_iterator:
            for report in request.reports:
                if report.HasField("outcome"):
                    self._outcome(report.outcome)
            yield pb.ConnectResponse(
                acks=[pb.ConnectAck(request_id=report.request_id) for report in request.reports]
            )
            if script.end_after_outcome and self.outcome_arrived.is_set():
                return

    async def ReportOutcome(
        self, request: pb.ReportOutcomeRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.ReportOutcomeResponse:
        self._outcome(request)
        return pb.ReportOutcomeResponse()

    async def ReportFact(
        self, request: pb.ReportFactRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.ReportFactResponse:
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, "not scripted")

    async def GetHandoff(
        self, request: pb.GetHandoffRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.GetHandoffResponse:
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, "not scripted")

    async def Reconcile(
        self, request: pb.ReconcileRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.ReconcileResponse:
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, "not scripted")

    async def GetShardMap(
        self, request: pb.GetShardMapRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.GetShardMapResponse:
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, "not scripted")

    async def StartHandoff(
        self, request: pb.StartHandoffRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.StartHandoffResponse:
        return await self.starts.pop(0)()


@pytest.fixture
async def scripted() -> AsyncIterator[tuple[Scripted, int]]:
    servicer = Scripted()
    server = grpc.aio.server()
    pb_grpc.add_HandoffCoordinatorServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        yield servicer, port
    finally:
        await server.stop(None)


def wire_action(kind: pb.ActionKind.ValueType, action_id: int) -> pb.Action:
    return pb.Action(
        handoff_id="h", id=action_id, kind=kind, target=pb.ROLE_SOURCE, attempt=1, engine_id=SOURCE
    )


async def test_an_unknown_action_kind_from_a_newer_server_is_skipped(
    scripted: tuple[Scripted, int], kind: TransportKind
) -> None:
    servicer, port = scripted
    newer = wire_action(pb.ActionKind.ValueType(99), 0)  # no ActionKind has this number
    servicer.scripts.append(Script([newer, wire_action(pb.ACTION_KIND_SUBMIT_PREFILL, 1)]))
    prefill = ScriptedEngine()
    prefill.overrides[ActionKind.SUBMIT_PREFILL] = lambda action, facts: asyncio.sleep(0, SUBMITTED)
    async with (
        HandoffClient(f"127.0.0.1:{port}") as client,
        running(client, SOURCE, prefill, transport=kind) as car,
        asyncio.timeout(TIMEOUT_S),
    ):
        outcome = await servicer.outcomes.get()
    assert outcome.action_id == 1  # the stream went on past the unknown one
    assert car.stats.unknown_actions == 1
    assert car.stats.reconnects == 0


async def test_a_refusal_as_older_incarnation_stops_the_sidecar_after_freeing(
    scripted: tuple[Scripted, int], kind: TransportKind
) -> None:
    servicer, port = scripted
    servicer.scripts += [
        # SubmitPrefill runs (the engine now holds a prefill), then the stream ends.
        Script([wire_action(pb.ACTION_KIND_SUBMIT_PREFILL, 0)], end_after_outcome=True),
        Script(refusal=("session-conflict", "engine prefill-0: incarnation live in a session")),
        Script(refusal=("older-incarnation", "engine prefill-0: incarnation A older than live B")),
    ]
    prefill = ScriptedEngine()
    prefill.overrides[ActionKind.SUBMIT_PREFILL] = lambda action, facts: asyncio.sleep(0, SUBMITTED)
    async with HandoffClient(f"127.0.0.1:{port}") as client:
        car = EngineSidecar(client, SOURCE, prefill, transport=kind, reconnect_backoff=QUICK)
        async with car, asyncio.timeout(TIMEOUT_S):
            with pytest.raises(OlderIncarnationError, match="older than live"):
                await car.wait()
    cancels = [a for a in prefill.calls if a.kind is ActionKind.CANCEL_SOURCE]
    assert [(a.handoff_id, a.attempt) for a in cancels] == [("h", 0)]  # freed by the sidecar
    assert car.stats.session_conflicts == 1
    assert [hello[1:] for hello in servicer.hellos] == [(car.incarnation, car.session_id)] * 3


async def test_a_start_whose_answer_was_lost_is_retried_and_says_already_started(
    scripted: tuple[Scripted, int],
) -> None:
    servicer, port = scripted
    applied = asyncio.Event()

    async def slow() -> pb.StartHandoffResponse:
        applied.set()  # applied, but the answer comes after the caller's deadline
        await asyncio.sleep(1.0)
        return pb.StartHandoffResponse()

    async def retried() -> pb.StartHandoffResponse:
        return pb.StartHandoffResponse(
            handoff=pb.Handoff(
                handoff_id="h",
                order=pb.HANDOFF_ORDER_SOURCE_FIRST,
                phase=pb.PHASE_ACTIVE,
                transfer_executor=pb.ROLE_SOURCE,
            ),
            already_started=True,
        )

    servicer.starts += [slow, retried]
    # Each attempt gets 0.2 s of the call's 5 s: the second asks again in time.
    retry = RetryPolicy(
        max_attempts=3, backoff=Backoff(initial_s=0.01, max_s=0.02), attempt_timeout_s=0.2
    )
    async with HandoffClient(f"127.0.0.1:{port}", retry=retry) as client:
        async with asyncio.timeout(TIMEOUT_S):
            update = await client.start_handoff(
                "h",
                engine_type=EngineType.VLLM,
                source_engine_id=SOURCE,
                destination_engine_id="decode-0",
                timeout_s=5.0,
            )
    assert applied.is_set()
    assert update.already_started
    assert update.actions == ()
