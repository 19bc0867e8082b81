"""The gRPC servicer: the one place where domain errors become status codes.

Every handler validates its request (convert), makes one synchronous registry
call, and answers. Nothing awaits between reading and changing a handoff, so
no two calls interleave on one handoff.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import TypeVar

import grpc

from handoff.v1 import coordinator_pb2 as pb
from handoff.v1 import coordinator_pb2_grpc as pb_grpc
from handoff_server import convert, security
from handoff_server.metrics import Metrics
from handoff_server.model import HandoffError, InvalidArgument
from handoff_server.registry import CallResult, Dispatch, Registry, Subscription

log = logging.getLogger("handoff.servicer")

R = TypeVar("R")
STREAM_BATCH = 256
# Built once: OutcomeKind.values() makes a new list on every call, and every
# outcome report names its kind.
OUTCOME_NAMES = {value: name for name, value in pb.OutcomeKind.items()}


def _shown(handoff_id: str) -> str:
    """A caller-supplied id, safe to echo in a message or a log line."""
    return handoff_id if len(handoff_id) <= 64 else handoff_id[:64] + "..."


class Rejection(Exception):
    """A call refused with a gRPC status; raised out of :meth:`Servicer.answer`."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


class Servicer(pb_grpc.HandoffCoordinatorServicer):
    def __init__(self, registry: Registry, metrics: Metrics) -> None:
        self.registry = registry
        self.metrics = metrics

    def answer(self, rpc: str, subject: str, work: Callable[[], R]) -> R:
        """Run ``work``; turn any failure into a Rejection with a clear message."""
        try:
            return work()
        except HandoffError as error:
            code = grpc.StatusCode[error.code]
            message = f"{subject}: {error.message}"
        except Exception:
            log.exception("unexpected failure in %s", rpc, extra={"subject": subject})
            code, message = grpc.StatusCode.INTERNAL, f"{subject}: internal error in {rpc}"
        self.metrics.rejected(rpc, code.name)
        raise Rejection(code, message)

    # --- unary --------------------------------------------------------------

    async def StartHandoff(
        self,
        request: pb.StartHandoffRequest,
        context: grpc.aio.ServicerContext[pb.StartHandoffRequest, pb.StartHandoffResponse],
    ) -> pb.StartHandoffResponse:
        subject = f"handoff {_shown(request.handoff_id)}"

        def work() -> pb.StartHandoffResponse:
            answer = Answer.of(self.registry.start(convert.start_request(request)))
            return pb.StartHandoffResponse(handoff=answer.handoff, actions=answer.actions)

        try:
            return self.answer("StartHandoff", subject, work)
        except Rejection as rejection:
            await context.abort(rejection.code, rejection.message)

    async def ReportFact(
        self,
        request: pb.ReportFactRequest,
        context: grpc.aio.ServicerContext[pb.ReportFactRequest, pb.ReportFactResponse],
    ) -> pb.ReportFactResponse:
        try:
            answer = self.report_fact(request, "ReportFact")
            return pb.ReportFactResponse(handoff=answer.handoff, actions=answer.actions)
        except Rejection as rejection:
            await context.abort(rejection.code, rejection.message)

    async def ReportOutcome(
        self,
        request: pb.ReportOutcomeRequest,
        context: grpc.aio.ServicerContext[pb.ReportOutcomeRequest, pb.ReportOutcomeResponse],
    ) -> pb.ReportOutcomeResponse:
        try:
            answer = self.report_outcome(request, "ReportOutcome")
            return pb.ReportOutcomeResponse(handoff=answer.handoff, actions=answer.actions)
        except Rejection as rejection:
            await context.abort(rejection.code, rejection.message)

    async def GetHandoff(
        self,
        request: pb.GetHandoffRequest,
        context: grpc.aio.ServicerContext[pb.GetHandoffRequest, pb.GetHandoffResponse],
    ) -> pb.GetHandoffResponse:
        subject = f"handoff {_shown(request.handoff_id)}"

        def work() -> pb.GetHandoffResponse:
            entry = self.registry.get(convert.handoff_id(request.handoff_id))
            return pb.GetHandoffResponse(handoff=convert.handoff(entry))

        try:
            return self.answer("GetHandoff", subject, work)
        except Rejection as rejection:
            await context.abort(rejection.code, rejection.message)

    def report_fact(self, request: pb.ReportFactRequest, rpc: str) -> Answer:
        kind = request.fact.WhichOneof("kind") or "unset"
        subject = f"handoff {_shown(request.handoff_id)}, fact {kind}"

        def work() -> Answer:
            handoff_id = convert.handoff_id(request.handoff_id)
            fact = convert.fact(request.fact)
            security.authorize_report(self.registry.get(handoff_id), fact=fact)
            return Answer.of(self.registry.report_fact(handoff_id, fact))

        return self.answer(rpc, subject, work)

    def report_outcome(self, request: pb.ReportOutcomeRequest, rpc: str) -> Answer:
        kind = OUTCOME_NAMES.get(request.outcome.kind) or str(request.outcome.kind)
        subject = (
            f"handoff {_shown(request.handoff_id)}, action {request.action_id}, outcome {kind}"
        )

        def work() -> Answer:
            handoff_id = convert.handoff_id(request.handoff_id)
            outcome = convert.outcome(request.outcome)
            security.authorize_report(self.registry.get(handoff_id), action_id=request.action_id)
            return Answer.of(self.registry.report_outcome(handoff_id, request.action_id, outcome))

        return self.answer(rpc, subject, work)

    # --- streams --------------------------------------------------------------

    async def StreamActions(
        self,
        request: pb.StreamActionsRequest,
        context: grpc.aio.ServicerContext[pb.StreamActionsRequest, pb.Action],
    ) -> AsyncIterator[pb.Action]:
        try:
            engine_id = self.answer(
                "StreamActions",
                "stream",
                lambda: security.authorize_engine(convert.engine_id(request.engine_id)),
            )
        except Rejection as rejection:
            await context.abort(rejection.code, rejection.message)
        ready = asyncio.Event()
        subscription = self.registry.subscribe(engine_id, ready.set)
        log.info("engine subscribed", extra={"engine_id": engine_id})
        try:
            # Headers now tell the engine it is subscribed before any action exists.
            await context.send_initial_metadata(())
            while (batch := await self._next_batch(subscription, ready)) is not None:
                for dispatch in batch:
                    yield convert.action(dispatch)
        finally:
            self.registry.unsubscribe(subscription)
            log.info("engine stream ended", extra={"engine_id": engine_id})

    async def _next_batch(
        self, subscription: Subscription, ready: asyncio.Event
    ) -> list[Dispatch] | None:
        """Wait for work on ``subscription``; None once it has been replaced."""
        while True:
            ready.clear()
            batch = self.registry.take(subscription, STREAM_BATCH)
            if batch is None or batch:
                return batch
            await ready.wait()

    async def Connect(
        self,
        request_iterator: AsyncIterator[pb.ConnectRequest],
        context: grpc.aio.ServicerContext[pb.ConnectRequest, pb.ConnectResponse],
    ) -> AsyncIterator[pb.ConnectResponse]:
        hello = await anext(aiter(request_iterator), None)
        try:
            engine_id = self.answer("Connect", "connect", lambda: _hello(hello))
        except Rejection as rejection:
            await context.abort(rejection.code, rejection.message)
        ready = asyncio.Event()
        acks: deque[pb.ConnectResponse] = deque()
        subscription = self.registry.subscribe(engine_id, ready.set)
        reader = asyncio.create_task(self._read_reports(request_iterator, acks, ready))
        log.info("engine connected", extra={"engine_id": engine_id})
        try:
            await context.send_initial_metadata(())
            while True:
                ready.clear()
                while acks:
                    yield acks.popleft()
                batch = self.registry.take(subscription, STREAM_BATCH)
                if batch is None:
                    return  # replaced by a newer stream for this engine
                for dispatch in batch:
                    yield pb.ConnectResponse(action=convert.action(dispatch))
                if batch or acks:
                    continue
                if reader.done():
                    reader.result()  # surfaces a read error, if any
                    return  # the engine half-closed and everything is acknowledged
                await ready.wait()
        finally:
            reader.cancel()
            self.registry.unsubscribe(subscription)
            log.info("engine disconnected", extra={"engine_id": engine_id})

    async def _read_reports(
        self,
        requests: AsyncIterator[pb.ConnectRequest],
        acks: deque[pb.ConnectResponse],
        ready: asyncio.Event,
    ) -> None:
        try:
            async for request in requests:
                acks.append(self._report(request))
                ready.set()
        finally:
            ready.set()

    def _report(self, request: pb.ConnectRequest) -> pb.ConnectResponse:
        """The acknowledgement of one report, ready to write."""
        which = request.WhichOneof("kind")
        try:
            if which == "fact":
                answer = self.report_fact(request.fact, "Connect")
            elif which == "outcome":
                answer = self.report_outcome(request.outcome, "Connect")
            else:
                self.answer("Connect", "connect", _unexpected_hello)
                raise AssertionError("unreachable")
        except Rejection as rejection:
            return pb.ConnectResponse(
                ack=pb.ConnectAck(
                    request_id=request.request_id,
                    code=rejection.code.value[0],
                    message=rejection.message,
                )
            )
        # Filled in place: a sub-message given to a constructor is copied, and
        # nesting the ack that way copied the whole handoff twice per report.
        response = pb.ConnectResponse()
        ack = response.ack
        ack.SetInParent()
        ack.request_id = request.request_id
        ack.handoff.CopyFrom(answer.handoff)
        ack.actions.extend(answer.actions)
        return response


@dataclass(frozen=True, slots=True)
class Answer:
    """What every call returns: the handoff after it, and the actions it caused."""

    handoff: pb.Handoff
    actions: list[pb.Action]

    @classmethod
    def of(cls, result: CallResult) -> Answer:
        return cls(convert.handoff(result.entry), [convert.action(d) for d in result.actions])


def _hello(request: pb.ConnectRequest | None) -> str:
    if request is None or request.WhichOneof("kind") != "hello":
        raise InvalidArgument("the first Connect message must be a hello naming the engine")
    return security.authorize_engine(convert.engine_id(request.hello.engine_id, "hello.engine_id"))


def _unexpected_hello() -> None:
    raise InvalidArgument("a report must carry a fact or an outcome; hello comes once, first")
