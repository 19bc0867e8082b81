"""Helpers for tests over real gRPC: request builders and engine stream recorders."""

from __future__ import annotations

import asyncio
import contextlib
import math
import uuid
from collections import defaultdict
from collections.abc import AsyncIterator
from typing import TypeAlias

import grpc

from handoff_proto.v1 import coordinator_pb2 as pb
from handoff_proto.v1 import coordinator_pb2_grpc as pb_grpc
from handoff_server.commands.conformance import Answer, FactStep, OutcomeStep, StartStep
from handoff_server.domain.model import (
    Action,
    ActionKind,
    Canceled,
    Completion,
    DestinationReserved,
    EngineLost,
    Fact,
    Failed,
    Order,
    Outcome,
    Role,
    SourceHeld,
    TimedOut,
    TimingMode,
    TransferCompleted,
)

SOURCE = "prefill-0"
DESTINATION = "decode-0"


def fact_message(fact: Fact) -> pb.Fact:
    if isinstance(fact, SourceHeld):
        timing = fact.transfer_timing
        message = pb.TransferTiming(
            mode=pb.TRANSFER_TIMING_MODE_FULL_PROMPT
            if timing.mode is TimingMode.FULL_PROMPT
            else pb.TRANSFER_TIMING_MODE_DESTINATION_MISSING,
            full_prompt_tokens=timing.full_prompt_tokens,
            state_bytes=timing.state_bytes,
        )
        if timing.kv_bytes_per_token is not None:
            message.kv_bytes_per_token = timing.kv_bytes_per_token
        if timing.bandwidth_gb_s is not None:
            message.bandwidth_gb_s = timing.bandwidth_gb_s
        return pb.Fact(source_held=pb.SourceHeld(transfer_timing=message))
    if isinstance(fact, DestinationReserved):
        return pb.Fact(
            destination_reserved=pb.DestinationReserved(
                transferable_prompt_tokens=fact.transferable_prompt_tokens
            )
        )
    if isinstance(fact, TransferCompleted):
        return pb.Fact(transfer_completed=pb.TransferCompleted())
    if isinstance(fact, Failed):
        return pb.Fact(failed=pb.Failed(reason="test"))
    if isinstance(fact, TimedOut):
        return pb.Fact(timed_out=pb.TimedOut())
    if isinstance(fact, EngineLost):
        role = pb.ROLE_SOURCE if fact.role is Role.SOURCE else pb.ROLE_DESTINATION
        return pb.Fact(engine_lost=pb.EngineLost(role=role))
    assert isinstance(fact, Canceled)
    return pb.Fact(canceled=pb.Canceled(reason="test"))


def outcome_message(outcome: Outcome) -> pb.Outcome:
    kind = pb.OutcomeKind.Value("OUTCOME_KIND_" + outcome.kind.name)
    return pb.Outcome(kind=kind, reason=outcome.reason)


def start_message(
    step: StartStep, source: str = SOURCE, destination: str = DESTINATION
) -> pb.StartHandoffRequest:
    order = (
        pb.HANDOFF_ORDER_SOURCE_FIRST
        if step.order is Order.SOURCE_FIRST
        else pb.HANDOFF_ORDER_DESTINATION_FIRST
    )
    return pb.StartHandoffRequest(
        handoff_id=step.handoff_id,
        order=order,
        source_engine_id=source,
        destination_engine_id=destination,
        fallback_transfer_delay_ms=step.fallback_transfer_delay_ms,
    )


def core_action(message: pb.Action) -> Action:
    kind = ActionKind[pb.ActionKind.Name(message.kind).removeprefix("ACTION_KIND_")]
    delay = message.delay_ms if kind is ActionKind.START_TRANSFER else None
    completion = (
        Completion[pb.Completion.Name(message.completion).removeprefix("COMPLETION_")]
        if message.completion
        else None
    )
    return Action(message.id, kind, delay, completion)


def state_of(handoff: pb.Handoff) -> tuple[str, str | None]:
    phase = pb.Phase.Name(handoff.phase).removeprefix("PHASE_").lower()
    completion = (
        pb.Completion.Name(handoff.completion).removeprefix("COMPLETION_").lower()
        if handoff.completion
        else None
    )
    return phase, completion


async def call_unary(
    stub: pb_grpc.HandoffCoordinatorAsyncStub,
    handoff_id: str,
    step: StartStep | FactStep | OutcomeStep,
) -> tuple[bool, str | None, str, tuple[Action, ...]]:
    """One conformance step over the unary RPCs: (ok, code, message, actions)."""
    response: pb.StartHandoffResponse | pb.ReportFactResponse | pb.ReportOutcomeResponse
    try:
        if isinstance(step, StartStep):
            response = await stub.StartHandoff(start_message(step))
        elif isinstance(step, FactStep):
            response = await stub.ReportFact(
                pb.ReportFactRequest(handoff_id=handoff_id, fact=fact_message(step.fact))
            )
        else:
            response = await stub.ReportOutcome(
                pb.ReportOutcomeRequest(
                    handoff_id=handoff_id,
                    action_id=step.action_id,
                    outcome=outcome_message(step.outcome),
                )
            )
    except grpc.aio.AioRpcError as error:
        return False, error.code().name, error.details() or "", ()
    return True, None, "", tuple(core_action(a) for a in response.actions)


async def observe_state(
    stub: pb_grpc.HandoffCoordinatorAsyncStub, handoff_id: str
) -> tuple[str | None, str | None]:
    try:
        response = await stub.GetHandoff(pb.GetHandoffRequest(handoff_id=handoff_id))
    except grpc.aio.AioRpcError as error:
        if error.code() is not grpc.StatusCode.NOT_FOUND:
            raise
        return None, None
    return state_of(response.handoff)


def answer(
    ok: bool,
    code: str | None,
    message: str,
    actions: tuple[Action, ...],
    state: tuple[str | None, str | None],
) -> Answer:
    return Answer(ok, code, actions, state[0], state[1], message)


class ActionLog:
    """Every action one engine received, awaitable by (handoff id, action id)."""

    def __init__(self, engine_id: str) -> None:
        self.engine_id = engine_id
        self.received: dict[tuple[str, int], list[pb.Action]] = defaultdict(list)
        self._changed = asyncio.Condition()

    async def record(self, action: pb.Action) -> None:
        async with self._changed:
            self.received[(action.handoff_id, action.id)].append(action)
            self._changed.notify_all()

    async def wait_for(self, handoff_id: str, action_id: int, attempts: int = 1) -> pb.Action:
        """The latest copy of an action, once at least ``attempts`` copies arrived."""
        key = (handoff_id, action_id)
        async with self._changed:
            await self._changed.wait_for(lambda: len(self.received[key]) >= attempts)
            return self.received[key][-1]


class StreamRecorder(ActionLog):
    """Reads one engine's StreamActions and records every action it receives."""

    def __init__(
        self,
        stub: pb_grpc.HandoffCoordinatorAsyncStub,
        engine_id: str,
        incarnation: str = "",
        session_id: str = "",
    ) -> None:
        super().__init__(engine_id)
        request = pb.StreamActionsRequest(
            engine_id=engine_id, incarnation=incarnation, session_id=session_id
        )
        self._call = stub.StreamActions(request)
        self._task = asyncio.create_task(self._read())

    async def _read(self) -> None:
        with contextlib.suppress(asyncio.CancelledError):
            async for action in self._call:
                await self.record(action)

    async def subscribed(self) -> None:
        """Returns once the server has registered this stream (it sends headers then)."""
        await self._call.initial_metadata()

    async def stream_ended(self) -> grpc.StatusCode:
        await self._task
        return await self._call.code()

    async def close(self) -> None:
        self._call.cancel()
        try:
            await self._task
        except grpc.aio.AioRpcError as error:
            # A stream the server was ending as we canceled it (a drain) can
            # end CANCELLED by either side: closed either way.
            if error.code() is not grpc.StatusCode.CANCELLED:
                raise


@contextlib.asynccontextmanager
async def recorders(
    stub: pb_grpc.HandoffCoordinatorAsyncStub, *engine_ids: str
) -> AsyncIterator[list[StreamRecorder]]:
    streams = [StreamRecorder(stub, engine_id) for engine_id in engine_ids]
    for stream in streams:
        await stream.subscribed()
    try:
        yield streams
    finally:
        for stream in streams:
            await stream.close()


def same_delay(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=1e-9)


CODE_NAMES = {code.value[0]: code.name for code in grpc.StatusCode}


class ConnectEngine(ActionLog):
    """One engine on the bidirectional Connect stream: reports out, acks and actions in.

    With ``batch`` it asks for packed responses and sends its reports in
    ``ConnectRequest.reports``, as the SDK does (but with full acks).
    """

    def __init__(
        self,
        stub: pb_grpc.HandoffCoordinatorAsyncStub,
        engine_id: str,
        batch: bool = False,
        incarnation: str = "",
        session_id: str = "",
    ) -> None:
        super().__init__(engine_id)
        self.batch = batch
        self._outbox: asyncio.Queue[pb.ConnectRequest | None] = asyncio.Queue()
        self._acks: dict[int, asyncio.Future[pb.ConnectAck]] = {}
        self._next_request = 0
        hello = pb.ConnectHello(
            engine_id=engine_id, batch=batch, incarnation=incarnation, session_id=session_id
        )
        self._outbox.put_nowait(pb.ConnectRequest(hello=hello))
        self._call = stub.Connect(self._requests())
        self._task = asyncio.create_task(self._read())

    async def _requests(self) -> AsyncIterator[pb.ConnectRequest]:
        while (request := await self._outbox.get()) is not None:
            yield request

    async def _read(self) -> None:
        with contextlib.suppress(asyncio.CancelledError):
            async for response in self._call:
                which = response.WhichOneof("kind")
                assert self.batch != (which is not None), "packed only when asked in the hello"
                for ack in [response.ack] if which == "ack" else response.acks:
                    self._acks.pop(ack.request_id).set_result(ack)
                for action in [response.action] if which == "action" else response.actions:
                    await self.record(action)

    async def subscribed(self) -> None:
        await self._call.initial_metadata()

    async def stream_ended(self) -> grpc.StatusCode:
        await self._task
        return await self._call.code()

    async def report(
        self, message: pb.ReportFactRequest | pb.ReportOutcomeRequest
    ) -> pb.ConnectAck:
        self._next_request += 1
        request = pb.ConnectRequest()
        report = request.reports.add() if self.batch else request
        report.request_id = self._next_request
        if isinstance(message, pb.ReportFactRequest):
            report.fact.CopyFrom(message)
        else:
            report.outcome.CopyFrom(message)
        acknowledged: asyncio.Future[pb.ConnectAck] = asyncio.get_running_loop().create_future()
        self._acks[self._next_request] = acknowledged
        await self._outbox.put(request)
        return await acknowledged

    async def close(self) -> None:
        await self._outbox.put(None)
        await self._task


async def call_connect(
    stub: pb_grpc.HandoffCoordinatorAsyncStub,
    engine: ConnectEngine,
    handoff_id: str,
    step: StartStep | FactStep | OutcomeStep,
) -> tuple[bool, str | None, str, tuple[Action, ...]]:
    """One conformance step with facts and outcomes on Connect (start stays unary)."""
    if isinstance(step, StartStep):
        return await call_unary(stub, handoff_id, step)
    if isinstance(step, FactStep):
        ack = await engine.report(
            pb.ReportFactRequest(handoff_id=handoff_id, fact=fact_message(step.fact))
        )
    else:
        ack = await engine.report(
            pb.ReportOutcomeRequest(
                handoff_id=handoff_id,
                action_id=step.action_id,
                outcome=outcome_message(step.outcome),
            )
        )
    if ack.code != 0:
        return False, CODE_NAMES[ack.code], ack.message, ()
    return True, None, "", tuple(core_action(a) for a in ack.actions)


# --- raw gRPC messages and calls shared by the service tests ---------------------

SUBMITTED = pb.Outcome(kind=pb.OUTCOME_KIND_SUBMITTED)
ACCEPTED = pb.Outcome(kind=pb.OUTCOME_KIND_ACCEPTED)
SCHEDULED = pb.Outcome(kind=pb.OUTCOME_KIND_SCHEDULED)
APPLIED = pb.Outcome(kind=pb.OUTCOME_KIND_APPLIED)
HELD = pb.Fact(
    source_held=pb.SourceHeld(
        transfer_timing=pb.TransferTiming(
            mode=pb.TRANSFER_TIMING_MODE_FULL_PROMPT,
            full_prompt_tokens=1000,
            kv_bytes_per_token=1000,
            bandwidth_gb_s=1.0,
        )
    )
)
RESERVED = pb.Fact(destination_reserved=pb.DestinationReserved(transferable_prompt_tokens=1000))
TRANSFERRED = pb.Fact(transfer_completed=pb.TransferCompleted())
CANCELED = pb.Fact(canceled=pb.Canceled(reason="client went away"))

# Only the stubs' .pyi knows the async stub type.
Stub: TypeAlias = "pb_grpc.HandoffCoordinatorAsyncStub"


def start_request(handoff_id: str | None = None, /, **fields: object) -> pb.StartHandoffRequest:
    values: dict[str, object] = {
        "handoff_id": handoff_id or str(uuid.uuid4()),
        "engine_type": pb.ENGINE_TYPE_VLLM,
        "source_engine_id": SOURCE,
        "destination_engine_id": DESTINATION,
        "fallback_transfer_delay_ms": 5.0,
    }
    values.update(fields)
    return pb.StartHandoffRequest(**values)  # type: ignore[arg-type]


async def fact(stub: Stub, handoff_id: str, message: pb.Fact) -> pb.ReportFactResponse:
    return await stub.ReportFact(pb.ReportFactRequest(handoff_id=handoff_id, fact=message))


async def outcome(
    stub: Stub, handoff_id: str, action_id: int, message: pb.Outcome
) -> pb.ReportOutcomeResponse:
    return await stub.ReportOutcome(
        pb.ReportOutcomeRequest(handoff_id=handoff_id, action_id=action_id, outcome=message)
    )


async def succeed(stub: Stub, handoff_id: str) -> None:
    await outcome(stub, handoff_id, 0, SUBMITTED)
    await fact(stub, handoff_id, HELD)
    await outcome(stub, handoff_id, 1, ACCEPTED)
    await fact(stub, handoff_id, RESERVED)
    await outcome(stub, handoff_id, 2, SCHEDULED)
    await fact(stub, handoff_id, TRANSFERRED)
    await outcome(stub, handoff_id, 3, APPLIED)
    response = await outcome(stub, handoff_id, 4, APPLIED)
    assert response.handoff.completion == pb.COMPLETION_SUCCESS
