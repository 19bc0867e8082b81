"""The gRPC servicer: the one place where domain errors become status codes.

Every handler decodes its request (convert), makes one synchronous registry
call, and returns; or, when that fails, refuses through :meth:`Servicer.refusal`,
the one path from an error to a status. Nothing awaits between reading and
changing a handoff, so no two calls interleave on one handoff. Every write to
the network awaits :meth:`Servicer.durably` first (one line at each).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, NoReturn, Protocol, TypeVar

import grpc

from handoff_proto.v1 import coordinator_pb2 as pb
from handoff_proto.v1 import coordinator_pb2_grpc as pb_grpc
from handoff_server.domain.delivery import Dispatch, Fenced, Subscription
from handoff_server.domain.model import (
    HandoffError,
    InvalidArgument,
    PermissionDenied,
    ResourceExhausted,
)
from handoff_server.domain.registry import CallResult, Registry
from handoff_server.durability.journal import JournalFailed
from handoff_server.ops.metrics import Metrics
from handoff_server.ops.tracecontext import trace_context
from handoff_server.service import bindings, convert
from handoff_server.service.guard import HOLDER
from handoff_server.service.linger import Linger, Wake
from handoff_server.service.newcomers import Newcomers
from handoff_server.service.shards import Misrouted, Shards

log = logging.getLogger("handoff.servicer")
REPORT_RPC = {"fact": "ReportFact", "outcome": "ReportOutcome"}

STREAM_BATCH = 256
Message = TypeVar("Message", pb.Action, pb.ConnectResponse)  # what an engine stream writes
# Reports in one Connect message at most (convert.py).
MAX_REPORTS_PER_MESSAGE = convert.MAX_REPORTS_PER_MESSAGE
# Reports of one message handled before the reader lets others run: a turn
# is then ~0.1 ms, while a yield per report would cost as much as the report.
REPORTS_PER_TURN = 16
# Acks (with their answers) built for one Connect stream and not yet handed
# to gRPC to write, in bytes; past it the stream's reports wait for the writer.
MAX_OWED_BYTES = 256 * 1024
# Built once: OutcomeKind.values() makes a new list on every call, and every
# outcome report names its kind.
OUTCOME_NAMES = {value: name for name, value in pb.OutcomeKind.items()}
# Written on a stream that asked for heartbeats when it has been idle for the
# heartbeat interval: the sidecar's lease counts from the last message it read.
HEARTBEAT = pb.Action(kind=pb.ACTION_KIND_HEARTBEAT)


def _shown(handoff_id: str) -> str:
    """A caller-supplied id, safe to echo in a message or a log line."""
    return handoff_id if len(handoff_id) <= 64 else handoff_id[:64] + "..."


@dataclass(frozen=True, slots=True)
class Refusal:
    """A call refused: the status it ends with (or its Connect ack carries)."""

    code: grpc.StatusCode
    message: str
    trailers: tuple[tuple[str, str], ...] = ()


class Barrier(Protocol):
    """What the servicer needs of the journal: how far it has been appended
    to, and a wait until it is committed that far."""

    @property
    def appended(self) -> int: ...

    async def durable(self, upto: int | None = None) -> None: ...


class Unjournaled:
    """No journal: every call is as durable as it will be once it returns."""

    appended = 0

    async def durable(self, upto: int | None = None) -> None:
        return None


class Ready(Wake):
    """An engine stream's wake-up, and how far the journal must be committed
    before its writer may write what it took: as far as it was appended when
    the latest ack or action was queued for the stream. Reading the journal's
    length when the writer takes instead would count what calls for other
    streams appended since, and wait a whole commit more for them."""

    def __init__(self, journal: Barrier) -> None:
        super().__init__()
        self._journal = journal
        # What is queued before the stream's first wake-up (actions issued
        # while the engine had no stream) was appended before it opened.
        self.owes = journal.appended

    def set(self) -> None:
        self.owes = self._journal.appended
        super().set()

    def queued(self) -> None:
        """Acks were queued, the writer not woken yet (it may run at the next await)."""
        self.owes = self._journal.appended


class Servicer(pb_grpc.HandoffCoordinatorServicer):
    def __init__(
        self,
        registry: Registry,
        metrics: Metrics,
        *,
        journal: Barrier | None = None,
        subscription_headers: Sequence[tuple[str, str]] = (),
        engine_incarnation: Callable[[str, str], None] = lambda engine_id, incarnation: None,
        shards: Shards | None = None,
        admit_start: Callable[[], None] = lambda: None,
    ) -> None:
        self.registry = registry
        self.metrics = metrics
        # None: a single coordinator, which owns every id.
        self.shards = shards if shards is not None else Shards.single(metrics)
        # Awaited before anything is written to the network: with a journal,
        # nothing leaves before the commit that holds it (journal.py).
        self._journal: Barrier = journal if journal is not None else Unjournaled()
        self.subscription_headers = tuple(subscription_headers)
        self._engine_incarnation = engine_incarnation
        # Raises (a domain error) when a new handoff must be refused: the
        # journal's volume is short of room (durability/space.py).
        self._admit_start = admit_start
        self.newcomers = Newcomers(registry.settings, metrics)

    async def durably(
        self, context: grpc.aio.ServicerContext[Any, Any], upto: int | None = None
    ) -> None:
        """Wait until every accepted call so far (or the journal's first ``upto``
        items) is durable; a broken journal ends the call."""
        try:
            await self._journal.durable(upto)
        except JournalFailed as error:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(error))

    def refusal(self, rpc: str, subject: str, error: Exception) -> Refusal:
        """The one path from a failed call to its status, counted; ``subject`` names what failed.

        A domain error carries its own code; anything else is a bug, logged
        with its traceback and answered INTERNAL without the details.
        """
        trailers: tuple[tuple[str, str], ...] = ()
        if isinstance(error, HandoffError):
            code, reason = grpc.StatusCode[error.code], error.message
            if isinstance(error, Fenced):
                # The sidecar acts on why it was fenced, not on the message.
                trailers = (("handoff-fence", error.fence.value),)
            elif isinstance(error, Misrouted):
                # The routing client follows the owner without parsing the message.
                trailers = (("handoff-owner", error.owner),)
        else:
            code, reason = grpc.StatusCode.INTERNAL, f"internal error in {rpc}"
            log.error("unexpected failure in %s", rpc, exc_info=error, extra={"subject": subject})
        self.metrics.rejected(rpc, code.name)
        return Refusal(code, f"{subject}: {reason}", trailers)

    async def refuse(
        self,
        context: grpc.aio.ServicerContext[Any, Any],
        rpc: str,
        subject: str,
        error: Exception,
    ) -> NoReturn:
        """End the call with the status of ``error``."""
        refusal = self.refusal(rpc, subject, error)
        await self.durably(context)  # a refusal tells of state too (an id in use)
        await context.abort(refusal.code, refusal.message, refusal.trailers)
        raise AssertionError("abort returns only by raising")

    # --- unary --------------------------------------------------------------

    async def StartHandoff(
        self,
        request: pb.StartHandoffRequest,
        context: grpc.aio.ServicerContext[pb.StartHandoffRequest, pb.StartHandoffResponse],
    ) -> pb.StartHandoffResponse:
        try:
            start = convert.start_request(request)
            trace, dropped = trace_context(context.invocation_metadata() or ())
            for header in dropped:
                self.metrics.trace_context_dropped_by[header].inc()
            if trace:
                start = dataclasses.replace(start, trace_context=trace)
            known = start.handoff_id in self.registry.handoffs
            self.shards.check_start(start.handoff_id, known)
            if not known:
                self._admit_start()
                self.newcomers.check_start((start.source_engine_id, start.destination_engine_id))
            result = self.registry.start(start)
            answer = Answer.of(result)
        except Exception as error:
            await self.refuse(context, "StartHandoff", _handoff_subject(request), error)
        await self.durably(context)
        return pb.StartHandoffResponse(
            handoff=answer.handoff,
            actions=answer.actions,
            already_started=result.already_started,
            shard=self.shards.identity.name,
        )

    async def ReportFact(
        self,
        request: pb.ReportFactRequest,
        context: grpc.aio.ServicerContext[pb.ReportFactRequest, pb.ReportFactResponse],
    ) -> pb.ReportFactResponse:
        try:
            answer = Answer.of(self._report_fact(request))
        except Exception as error:
            await self.refuse(context, "ReportFact", _fact_subject(request), error)
        await self.durably(context)
        return pb.ReportFactResponse(handoff=answer.handoff, actions=answer.actions)

    async def ReportOutcome(
        self,
        request: pb.ReportOutcomeRequest,
        context: grpc.aio.ServicerContext[pb.ReportOutcomeRequest, pb.ReportOutcomeResponse],
    ) -> pb.ReportOutcomeResponse:
        try:
            answer = Answer.of(self._report_outcome(request))
        except Exception as error:
            await self.refuse(context, "ReportOutcome", _outcome_subject(request), error)
        await self.durably(context)
        return pb.ReportOutcomeResponse(handoff=answer.handoff, actions=answer.actions)

    async def GetHandoff(
        self,
        request: pb.GetHandoffRequest,
        context: grpc.aio.ServicerContext[pb.GetHandoffRequest, pb.GetHandoffResponse],
    ) -> pb.GetHandoffResponse:
        try:
            handoff = convert.handoff(self.registry.get(convert.handoff_id(request.handoff_id)))
        except Exception as error:
            await self.refuse(context, "GetHandoff", _handoff_subject(request), error)
        await self.durably(context)
        return pb.GetHandoffResponse(handoff=handoff)

    async def Reconcile(
        self,
        request: pb.ReconcileRequest,
        context: grpc.aio.ServicerContext[pb.ReconcileRequest, pb.ReconcileResponse],
    ) -> pb.ReconcileResponse:
        subject = "Reconcile"  # every refusal below names the engine itself
        try:
            engine_id = bindings.authorize_engine(convert.engine_id(request.engine_id))
            incarnation = convert.plausible_incarnation(
                convert.incarnation(request.incarnation), self.registry.clock()
            )
            releases, lost_applied = self.registry.reconcile(
                engine_id,
                convert.held_sides(request.held, "held"),
                convert.held_sides(request.freed, "freed"),
                incarnation=incarnation,
                session_id=convert.session_id(request.session_id),
            )
        except Exception as error:
            await self.refuse(context, "Reconcile", subject, error)
        await self.durably(context)  # the EngineLost it reported are journaled first
        return pb.ReconcileResponse(
            releases=[convert.release(release) for release in releases], lost_applied=lost_applied
        )

    async def GetShardMap(
        self,
        request: pb.GetShardMapRequest,
        context: grpc.aio.ServicerContext[pb.GetShardMapRequest, pb.GetShardMapResponse],
    ) -> pb.GetShardMapResponse:
        shards = self.shards.shard_map().shards
        return pb.GetShardMapResponse(
            shards=[pb.Shard(name=s.name, address=s.address, placing=s.placing) for s in shards],
            self=self.shards.identity.name,
        )

    def _report_fact(self, request: pb.ReportFactRequest) -> CallResult:
        handoff_id = convert.handoff_id(request.handoff_id)
        fact = convert.fact(request.fact)
        bindings.authorize_report(self.registry.get(handoff_id), fact=fact)
        return self.registry.report_fact(handoff_id, fact, detail=convert.fact_text(request.fact))

    def _report_outcome(self, request: pb.ReportOutcomeRequest) -> CallResult:
        handoff_id = convert.handoff_id(request.handoff_id)
        outcome = convert.outcome(request.outcome)
        bindings.authorize_report(self.registry.get(handoff_id), action_id=request.action_id)
        return self.registry.report_outcome(handoff_id, request.action_id, outcome)

    # --- streams --------------------------------------------------------------

    async def StreamActions(
        self,
        request: pb.StreamActionsRequest,
        context: grpc.aio.ServicerContext[pb.StreamActionsRequest, pb.Action],
    ) -> AsyncIterator[pb.Action]:
        ready = Ready(self._journal)
        try:
            subscription = self._subscribe(
                request.engine_id, request.incarnation, request.session_id, ready.set
            )
        except Exception as error:
            await self.refuse(context, "StreamActions", "stream", error)
        engine_id = subscription.engine_id
        beat = self._heartbeat(request.heartbeats, ready)
        log.info("engine subscribed", extra={"engine_id": engine_id})
        try:
            # Headers now tell the engine it is subscribed before any action exists.
            await context.send_initial_metadata(self.subscription_headers)
            async for action in self._write(
                context, subscription, ready, beat, _actions, lambda: HEARTBEAT
            ):
                yield action
        finally:
            if beat is not None:
                beat.stop()
            self.registry.unsubscribe(subscription)
            log.info("engine stream ended", extra={"engine_id": engine_id})

    def _subscribe(
        self, engine_id: str, incarnation: str, session_id: str, on_ready: Callable[[], None]
    ) -> Subscription:
        subscription = self.registry.subscribe(
            bindings.authorize_engine(convert.engine_id(engine_id)),
            on_ready,
            convert.plausible_incarnation(convert.incarnation(incarnation), self.registry.clock()),
            convert.session_id(session_id),
        )
        if incarnation:
            self._engine_incarnation(subscription.engine_id, incarnation)
        self.newcomers.subscribed(subscription.engine_id)
        return subscription

    def _heartbeat(self, asked: bool, ready: asyncio.Event) -> Heartbeat | None:
        if not asked:
            return None
        return Heartbeat(ready, self.registry.settings.heartbeat_interval_s)

    async def _write(
        self,
        context: grpc.aio.ServicerContext[Any, Message],
        subscription: Subscription,
        ready: Ready,
        beat: Heartbeat | None,
        render: Callable[[list[Dispatch]], Sequence[Message]],
        heartbeat: Callable[[], Message],
        finished: Callable[[], Awaitable[bool]] | None = None,
    ) -> AsyncIterator[Message]:
        """The one writer of both engine streams (StreamActions, Connect): what
        ``subscription`` is owed, ``render``-ed, each batch once the journal is
        committed as far as it owes (:class:`Ready`) and, while the loop is
        behind, after the linger (linger.py); a
        heartbeat only where it would otherwise wait; until the stream is
        replaced or ``finished`` says it is done."""
        linger = Linger(self.registry.settings.stream_linger_ms / 1000)
        while True:
            ready.clear()
            await linger.wait()
            dispatches = self.registry.take(subscription, STREAM_BATCH)
            if dispatches is None:
                return  # replaced by a newer stream for this engine
            owes = ready.owes  # covers every ack and action queued so far
            messages = render(dispatches)
            if messages:
                await self.durably(context, owes)
                self._first_writes(dispatches)
                for message in messages:
                    yield message
                linger.wrote()
                if beat is not None:
                    beat.written = True
                continue
            if finished is not None and await finished():
                return
            if beat is not None and beat.take():
                yield heartbeat()
                continue
            await ready.wait()
            linger.woke(ready)

    def _first_writes(self, dispatches: list[Dispatch]) -> None:
        """Each action written for the first time: how long since the call
        that issued it (handoff_dispatch_latency_seconds). Neither a
        redelivery nor an action issued while its engine had no stream is
        counted: their wait was the engine's absence, not the coordinator's."""
        now = self.registry.clock()
        by_kind = self.metrics.dispatch_latency_by
        for dispatch in dispatches:
            if dispatch.attempt == 1 and dispatch.issued_at is not None:
                by_kind[dispatch.action.kind].observe(max(0.0, now - dispatch.issued_at))

    async def Connect(
        self,
        request_iterator: AsyncIterator[pb.ConnectRequest],
        context: grpc.aio.ServicerContext[pb.ConnectRequest, pb.ConnectResponse],
    ) -> AsyncIterator[pb.ConnectResponse]:
        first = await anext(aiter(request_iterator), None)
        ready = Ready(self._journal)
        try:
            hello = _hello(first)
            subscription = self._subscribe(
                hello.engine_id, hello.incarnation, hello.session_id, ready.set
            )
        except Exception as error:
            await self.refuse(context, "Connect", "connect", error)
        owed = Owed(batch=hello.batch, lean_acks=hello.lean_acks)
        beat = self._heartbeat(hello.heartbeats, ready)
        reader = asyncio.create_task(
            self._read_reports(hello.engine_id, request_iterator, owed, ready)
        )
        log.info("engine connected", extra={"engine_id": hello.engine_id})

        async def finished() -> bool:
            """The engine half-closed and everything is acknowledged."""
            if not reader.done():
                return False
            try:
                reader.result()  # surfaces a read error, if any
            except HandoffError as error:
                # Everything before the refused message is acknowledged.
                await self.refuse(context, "Connect", f"engine {hello.engine_id}", error)
            return True

        try:
            await context.send_initial_metadata(self.subscription_headers)
            async for response in self._write(
                context, subscription, ready, beat, owed.responses, owed.heartbeat, finished
            ):
                yield response
        finally:
            if beat is not None:
                beat.stop()
            reader.cancel()
            self.registry.unsubscribe(subscription)
            log.info("engine disconnected", extra={"engine_id": hello.engine_id})

    async def _read_reports(
        self,
        engine_id: str,
        requests: AsyncIterator[pb.ConnectRequest],
        owed: Owed,
        ready: Ready,
    ) -> None:
        try:
            async for request in requests:
                for index, report in enumerate(_capped_reports(request), 1):
                    self._report(report, owed)
                    if owed.full:
                        # The ack window: nothing more is read until the
                        # writer took what is owed, so a peer that does not
                        # read its acks is slowed down instead of queued for.
                        ready.set()
                        await owed.written()
                    elif index % REPORTS_PER_TURN == 0:
                        # One stream's batch must not hold the loop: other
                        # streams and calls run between its slices of reports.
                        ready.queued()
                        await asyncio.sleep(0)
                ready.set()
        finally:
            ready.set()

    def _report(self, request: pb.ConnectRequest | pb.ConnectReport, owed: Owed) -> None:
        """Handle one report and write its acknowledgement where it will be sent."""
        which = request.WhichOneof("kind")
        try:
            # A report on Connect needs the scope its unary call needs.
            holder = HOLDER.get()
            rpc = REPORT_RPC.get(which or "")
            if holder is not None and rpc and (refused := holder.refusal(rpc)) is not None:
                raise PermissionDenied(refused)
            if which == "fact":
                result = self._report_fact(request.fact)
            elif which == "outcome":
                result = self._report_outcome(request.outcome)
            else:
                raise InvalidArgument(
                    "a report must carry a fact or an outcome; hello comes once, first"
                )
        except Exception as error:
            refusal = self.refusal("Connect", _report_subject(request), error)
            ack = owed.ack(request.request_id)
            ack.code = refusal.code.value[0]
            ack.message = refusal.message
            owed.bytes += len(refusal.message)
            return
        ack = owed.ack(request.request_id)
        if not owed.lean_acks:
            answer = Answer.of(result)
            ack.handoff.CopyFrom(answer.handoff)
            ack.actions.extend(answer.actions)
            owed.bytes += ack.ByteSize()


class Owed:
    """What one Connect stream owes its engine: acks, then actions, in messages.

    Acks are built in place, inside the message that will carry them: a
    sub-message given to a constructor is copied, and nesting an ack that
    way copied the whole handoff twice per report.
    """

    __slots__ = ("batch", "lean_acks", "acks", "bytes", "_messages", "_written")

    def __init__(self, *, batch: bool, lean_acks: bool) -> None:
        self.batch = batch
        self.lean_acks = lean_acks
        self.acks = 0  # queued, not yet taken to be written
        # What the queued acks' answers and error messages weigh, roughly
        # (an ack's own few fields are not counted): bounds the queue in bytes.
        self.bytes = 0
        # Batched: at most one message, collecting every ack until written.
        self._messages: deque[pb.ConnectResponse] = deque()
        self._written = asyncio.Event()

    @property
    def full(self) -> bool:
        """The ack window is full: as many acks as one message may ask for, or
        their weight in bytes, are waiting to be written."""
        return self.acks >= MAX_REPORTS_PER_MESSAGE or self.bytes > MAX_OWED_BYTES

    async def written(self) -> None:
        """Until the acks queued so far have been taken to be written."""
        self._written.clear()
        await self._written.wait()

    def ack(self, request_id: int) -> pb.ConnectAck:
        """A new, empty acknowledgement of ``request_id``, queued to be written."""
        if self.batch:
            if not self._messages:
                self._messages.append(pb.ConnectResponse())
            ack = self._messages[0].acks.add()
        else:
            message = pb.ConnectResponse()
            self._messages.append(message)
            ack = message.ack
            ack.SetInParent()
        ack.request_id = request_id
        self.acks += 1
        return ack

    def heartbeat(self) -> pb.ConnectResponse:
        """A heartbeat, packed as this stream's actions are."""
        if self.batch:
            return pb.ConnectResponse(actions=[HEARTBEAT])
        return pb.ConnectResponse(action=HEARTBEAT)

    def responses(self, dispatches: list[Dispatch]) -> list[pb.ConnectResponse]:
        """The messages to write now: every ack owed so far, then ``dispatches``."""
        messages = list(self._messages)
        self._messages.clear()
        self.acks = self.bytes = 0
        self._written.set()
        if not dispatches:
            return messages
        actions = [convert.action(dispatch) for dispatch in dispatches]
        if not self.batch:
            messages.extend(pb.ConnectResponse(action=action) for action in actions)
        elif messages:
            messages[0].actions.extend(actions)
        else:
            messages.append(pb.ConnectResponse(actions=actions))
        return messages


def _actions(dispatches: list[Dispatch]) -> list[pb.Action]:
    return [convert.action(dispatch) for dispatch in dispatches]


class Heartbeat:
    """When an idle stream that asked for heartbeats is owed one.

    A timer ticks every half interval; a tick that finds nothing written
    since the one before marks a heartbeat due and wakes the writer. So one
    follows at most an interval after the stream's last message; a stream
    with anything to write never gets one, and one never delays or reorders
    an action (the writer sends it only where it would otherwise wait). Its
    cost is a timer per half interval per stream, not one per wait.
    """

    __slots__ = ("written", "_due", "_ready", "_half_s", "_timer")

    def __init__(self, ready: asyncio.Event, interval_s: float) -> None:
        self.written = True  # set by the writer after each message
        self._due = False
        self._ready = ready
        self._half_s = interval_s / 2
        self._timer = asyncio.get_running_loop().call_later(self._half_s, self._tick)

    def _tick(self) -> None:
        if not self.written:
            self._due = True
            self._ready.set()
        self.written = False
        self._timer = asyncio.get_running_loop().call_later(self._half_s, self._tick)

    def take(self) -> bool:
        """Whether to send a heartbeat now; once per one due."""
        if not self._due:
            return False
        self._due = False
        self.written = True
        return True

    def stop(self) -> None:
        self._timer.cancel()


@dataclass(frozen=True, slots=True)
class Answer:
    """What every call returns: the handoff after it, and the actions it caused."""

    handoff: pb.Handoff
    actions: list[pb.Action]

    @classmethod
    def of(cls, result: CallResult) -> Answer:
        return cls(convert.handoff(result.entry), [convert.action(d) for d in result.actions])


def _hello(request: pb.ConnectRequest | None) -> pb.ConnectHello:
    if request is None or request.WhichOneof("kind") != "hello":
        raise InvalidArgument("the first Connect message must be a hello naming the engine")
    if request.reports:
        raise InvalidArgument("the hello comes alone: reports follow it in later messages")
    bindings.authorize_engine(convert.engine_id(request.hello.engine_id, "hello.engine_id"))
    return request.hello


def _capped_reports(request: pb.ConnectRequest) -> Sequence[pb.ConnectRequest | pb.ConnectReport]:
    """The message's reports, refused whole (before any is handled) when too many."""
    reports = convert.reports_of(request)
    if len(reports) > MAX_REPORTS_PER_MESSAGE:
        raise ResourceExhausted(
            f"a Connect message carries {len(reports)} reports; the limit is "
            f"{MAX_REPORTS_PER_MESSAGE} per message (max_reports_per_message)"
        )
    return reports


def _handoff_subject(request: pb.StartHandoffRequest | pb.GetHandoffRequest) -> str:
    return f"handoff {_shown(request.handoff_id)}"


def _report_subject(request: pb.ConnectRequest | pb.ConnectReport) -> str:
    which = request.WhichOneof("kind")
    if which == "fact":
        return _fact_subject(request.fact)
    if which == "outcome":
        return _outcome_subject(request.outcome)
    return "connect"


def _fact_subject(request: pb.ReportFactRequest) -> str:
    kind = request.fact.WhichOneof("kind") or "unset"
    return f"handoff {_shown(request.handoff_id)}, fact {kind}"


def _outcome_subject(request: pb.ReportOutcomeRequest) -> str:
    kind = OUTCOME_NAMES.get(request.outcome.kind) or str(request.outcome.kind)
    return f"handoff {_shown(request.handoff_id)}, action {request.action_id}, outcome {kind}"
