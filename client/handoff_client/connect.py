"""ConnectTransport: an engine's actions and reports on one Connect stream.

Over the unary transport, a handoff costs each of its engines one
StreamActions message per action plus one ReportFact or ReportOutcome call
per report: about ten calls per successful handoff, each a new HTTP/2 stream
with its own headers and deadline. On Connect the same traffic is messages
on one long-lived stream per engine.

It behaves like :class:`~handoff_client.transport.UnaryTransport`, so the
sidecar's ordered outbox, retries and outcome cache work unchanged:

- :meth:`ConnectTransport.subscribe` opens one Connect stream (hello first)
  and yields the actions that arrive on it; ``on_subscribed`` runs when the
  server's headers say the subscription is registered. Closing the generator
  cancels the stream.
- A report goes out on the live stream and returns when its acknowledgement
  arrives. ``send_fact``/``send_outcome`` return once it is on the stream
  (what the outbox uses): a handoff's next report goes out behind it on the
  same stream before its ack, since the server handles a stream's reports
  in order. Reports queued together go out together, up to
  ``MAX_REPORTS_PER_MESSAGE`` in one message, and the server packs its acks
  and actions the same way (``ConnectHello.batch``): gRPC costs about the
  same per message whatever it carries. Acks come without the handoff's
  state (``ConnectHello.lean_acks``): the sidecar acts on its actions alone.
  A non-zero code raises the exception the unary call would raise for the
  same refusal (same class, same details).
- It asks for heartbeats and stamps every message it reads (action, ack,
  heartbeat) on :attr:`ConnectTransport.liveness`, the sidecar's lease clock;
  heartbeats go no further.
- A report still unacknowledged when its stream ends (dropped, replaced by
  a newer stream for the engine, closed) fails with ``UnavailableError``, so
  the outbox sends it again, on the next stream. Reports are idempotent on
  the server: one that landed before the break is harmless to repeat.
- Between streams a report waits for the next one. Every report has the
  client's deadline (``timeout_s``), that wait included; past it,
  ``DeadlineExceededError``, which the outbox retries as well.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import AsyncGenerator, AsyncIterator, Callable

import grpc

from handoff_client.client import HandoffClient
from handoff_client.convert import action_from_pb, fact_to_pb, outcome_to_pb
from handoff_client.errors import (
    CallCancelledError,
    DeadlineExceededError,
    UnavailableError,
    error_for,
    error_for_status,
)
from handoff_client.liveness import Liveness
from handoff_client.model import Action, Fact, Outcome
from handoff_client.onshard import OnShard, ReconcilesOnShard
from handoff_client.outbox import Sent
from handoff_proto.v1 import coordinator_pb2 as pb

# Actions read ahead of the sidecar. Past this the reader stops and leaves the
# rest to gRPC flow control and the server's queue, as StreamActions does.
MAX_BUFFERED_ACTIONS = 256
# Reports per Connect message at most. A report is at most about 1.2 KiB (a
# 1 KiB reason at most), so a full message stays well under the server's
# default 64 KiB message limit.
MAX_REPORTS_PER_MESSAGE = 32


class ConnectTransport(ReconcilesOnShard):
    """Actions and reports of one engine on one Connect stream at a time.

    One transport per :class:`~handoff_client.sidecar.EngineSidecar` link; it
    uses ``client``'s channel, credentials and ``timeout_s``. Given ``shard``,
    it talks to that shard of a routing client alone, at the shard's address
    as the client's map has it at each subscription.
    """

    def __init__(self, client: HandoffClient, shard: str | None = None) -> None:
        self._shard = OnShard(client, shard)
        self.liveness = Liveness()
        self._live: _Stream | None = None  # the stream reports go out on
        self._changed = asyncio.Condition()  # notified when a stream goes live
        self._last_request_id = 0

    def subscribe(
        self,
        engine_id: str,
        on_subscribed: Callable[[], None],
        *,
        incarnation: str,
        session_id: str,
    ) -> AsyncGenerator[Action, None]:
        hello = pb.ConnectHello(
            engine_id=engine_id,
            batch=True,
            lean_acks=True,
            incarnation=incarnation,
            session_id=session_id,
            heartbeats=True,
        )
        return self._subscribe(hello, on_subscribed)

    async def report_fact(self, handoff_id: str, fact: Fact) -> None:
        await (await self.send_fact(handoff_id, fact, None)).landed

    async def report_outcome(self, handoff_id: str, action_id: int, outcome: Outcome) -> None:
        await (await self.send_outcome(handoff_id, action_id, outcome, None)).landed

    async def send_fact(self, handoff_id: str, fact: Fact, after: Sent | None) -> Sent:
        report = pb.ReportFactRequest(handoff_id=handoff_id, fact=fact_to_pb(fact))
        return await self._send(pb.ConnectReport(fact=report), after)

    async def send_outcome(
        self, handoff_id: str, action_id: int, outcome: Outcome, after: Sent | None
    ) -> Sent:
        report = pb.ReportOutcomeRequest(
            handoff_id=handoff_id, action_id=action_id, outcome=outcome_to_pb(outcome)
        )
        return await self._send(pb.ConnectReport(outcome=report), after)

    @property
    def unacknowledged(self) -> int:
        """Reports sent on the live stream and not acknowledged yet."""
        stream = self._live
        return 0 if stream is None else len(stream.pending)

    # --- the stream ------------------------------------------------------------

    async def _subscribe(
        self, hello: pb.ConnectHello, on_subscribed: Callable[[], None]
    ) -> AsyncGenerator[Action, None]:
        stream = _Stream(await self._shard.client(), hello, self.liveness)
        try:
            try:
                headers = await stream.call.initial_metadata()
            except grpc.aio.AioRpcError as error:
                self._shard.unreachable()
                raise error_for(error) from error
            stream.start_reading()
            # A call refused before the server took it (no server, a bad
            # token) has empty headers and is already done: no subscription.
            # Its reader records the error, raised below.
            if not stream.call.done():
                self.liveness.subscribed(headers)
                async with self._changed:
                    self._live = stream
                    self._changed.notify_all()
                on_subscribed()
            while True:
                while stream.actions:
                    action = stream.actions.popleft()
                    stream.room.set()
                    yield action
                if stream.ended:
                    if stream.failure is not None:
                        self._shard.unreachable()
                        raise stream.failure
                    return  # ended by the server: replaced, or shutting down
                stream.arrived.clear()
                await stream.arrived.wait()
        finally:
            if self._live is stream:
                self._live = None
            await stream.close()

    # --- reports ---------------------------------------------------------------

    def _usable(self) -> bool:
        return self._live is not None and not self._live.ended

    async def _send(self, request: pb.ConnectReport, after: Sent | None) -> Sent:
        """Put ``request`` on the live stream; behind ``after`` (not answered
        yet), on ``after``'s stream alone, which handles it after ``after``."""
        timeout_s = self._shard.timeout_s
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        if after is not None:
            if after.on is not self._live or not self._usable():
                # Sent on another stream it could overtake ``after``'s retry.
                raise UnavailableError("the report before it is unanswered on a stream that ended")
        elif not self._usable():
            try:
                async with asyncio.timeout(timeout_s):
                    async with self._changed:
                        await self._changed.wait_for(self._usable)
            except TimeoutError:
                raise self._late(timeout_s) from None
        stream = self._live
        assert stream is not None  # _usable, and nothing awaited since
        self._last_request_id += 1
        request_id = request.request_id = self._last_request_id
        acknowledged = stream.send(request)
        timer = loop.call_at(deadline, self._expire, stream, request_id, timeout_s)

        def settled(_: asyncio.Future[None]) -> None:
            # Answered, expired or given up (cancelled): either way its ack no
            # longer counts as owed.
            timer.cancel()
            stream.pending.pop(request_id, None)

        acknowledged.add_done_callback(settled)
        return Sent(acknowledged, stream)

    def _expire(self, stream: _Stream, request_id: int, timeout_s: float) -> None:
        acknowledged = stream.pending.pop(request_id, None)
        if acknowledged is not None and not acknowledged.done():
            acknowledged.set_exception(self._late(timeout_s))

    @staticmethod
    def _late(timeout_s: float) -> DeadlineExceededError:
        return DeadlineExceededError(f"no acknowledgement on Connect within {timeout_s:g} s")


class _Stream:
    """One Connect call: the requests to write, a reader, the reports awaiting acks."""

    def __init__(self, client: HandoffClient, hello: pb.ConnectHello, liveness: Liveness) -> None:
        self._hello = hello
        self._liveness = liveness
        # None ends the requests: the stream is closing.
        self._requests: asyncio.Queue[pb.ConnectReport | None] = asyncio.Queue()
        self.call = client._open_connect(self._outgoing())
        self.pending: dict[int, asyncio.Future[None]] = {}
        self.actions: deque[Action] = deque()
        self.arrived = asyncio.Event()  # an action arrived, or the stream ended
        self.room = asyncio.Event()  # the reader may read on
        self.ended = False
        self.failure: Exception | None = None  # why reading stopped, unless the server ended it
        self._reader: asyncio.Task[None] | None = None

    async def _outgoing(self) -> AsyncIterator[pb.ConnectRequest]:
        yield pb.ConnectRequest(hello=self._hello)
        requests = self._requests
        while (report := await requests.get()) is not None:
            message = pb.ConnectRequest()
            message.reports.append(report)
            while not requests.empty() and len(message.reports) < MAX_REPORTS_PER_MESSAGE:
                report = requests.get_nowait()
                if report is None:
                    yield message
                    return
                message.reports.append(report)
            yield message

    def start_reading(self) -> None:
        self._reader = asyncio.create_task(self._read())

    def send(self, request: pb.ConnectReport) -> asyncio.Future[None]:
        """Queue ``request``; the future ends with its acknowledgement."""
        acknowledged: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.pending[request.request_id] = acknowledged
        self._requests.put_nowait(request)
        self.room.set()  # an ack is owed now: the reader must not stay parked
        return acknowledged

    async def _read(self) -> None:
        try:
            async for response in self.call:
                self._liveness.heard()
                # Batched (acks, actions), as asked in the hello; a server
                # that packs nothing still sends one item in kind.
                for ack in response.acks:
                    self._acknowledge(ack)
                actions = [
                    action_from_pb(action)
                    for action in response.actions
                    if action.kind != pb.ACTION_KIND_HEARTBEAT
                ]
                which = response.WhichOneof("kind")
                if which == "ack":
                    self._acknowledge(response.ack)
                elif which == "action" and response.action.kind != pb.ACTION_KIND_HEARTBEAT:
                    actions.append(action_from_pb(response.action))
                if actions:
                    self.actions.extend(actions)
                    self.arrived.set()
                # Park while the sidecar is behind, but never while a report
                # waits: its ack may come after actions the sidecar cannot
                # take yet, and a handler may be waiting for that ack.
                while len(self.actions) >= MAX_BUFFERED_ACTIONS and not self.pending:
                    self.room.clear()
                    await self.room.wait()
        except grpc.aio.AioRpcError as error:
            self.failure = error_for(error)
            self.failure.__cause__ = error
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if task is not None and task.cancelling():
                raise  # close(): this reader itself is being cancelled
            # The call was cancelled under it (its channel closed): a failure.
            self.failure = CallCancelledError("the Connect call was cancelled")
        except Exception as error:  # a transport bug: the sidecar logs it and reconnects
            self.failure = error
        finally:
            self._end()

    def _acknowledge(self, ack: pb.ConnectAck) -> None:
        acknowledged = self.pending.pop(ack.request_id, None)
        if acknowledged is None or acknowledged.done():
            return  # its report stopped waiting (deadline, cancel)
        if ack.code == grpc.StatusCode.OK.value[0]:
            acknowledged.set_result(None)
        else:
            acknowledged.set_exception(error_for_status(ack.code, ack.message))

    def _end(self) -> None:
        self.ended = True
        pending, self.pending = self.pending, {}
        for acknowledged in pending.values():
            if not acknowledged.done():
                acknowledged.set_exception(
                    UnavailableError("the Connect stream ended before the report was acknowledged")
                )
        self.arrived.set()

    async def close(self) -> None:
        self.call.cancel()
        # gRPC leaves its writer task waiting inside _outgoing; ending the
        # requests lets it finish (otherwise the task is destroyed pending
        # and Python reports "aclose(): asynchronous generator is already
        # running"). After the cancel, so the server never sees a half-close
        # (a clean end of the engine's stream).
        self._requests.put_nowait(None)
        if self._reader is not None:
            self._reader.cancel()
            # wait(), not a bare await: the reader's CancelledError stays
            # its own, and a cancel of the caller still propagates.
            await asyncio.wait([self._reader])
        self._end()
