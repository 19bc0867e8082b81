"""The interceptor in front of every call: tokens, undecodable input, call and stream limits.

For every RPC it checks the bearer token (unless the method is exempt, like
health's Check). For every RPC but health's (which has budgets of its own,
see :mod:`handoff_server.service.probes`) it counts the call against
``max_concurrent_rpcs``. For the coordinator's own RPCs it also wraps the handler:

- a request that does not decode gets INVALID_ARGUMENT (gRPC's own answer
  would be UNKNOWN, with the parser's exception in the message);
- the caller's credentials (token, certificate) are put in
  :data:`bindings.CALLER` for the servicer's engine checks;
- at most ``max_engines`` engines hold a live stream (StreamActions or
  Connect); a new subscription for an engine that already has one replaces
  it in the registry and is always admitted.

A Connect peer that does not read its acknowledgements is the servicer's to
slow down (its ack window, ``Owed``): the guard does only what every call needs.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any, NoReturn

import grpc

from handoff_proto.v1 import coordinator_pb2 as pb
from handoff_server.ops.config import Settings
from handoff_server.ops.metrics import RPCS, Metrics
from handoff_server.service import bindings, convert, security
from handoff_server.service.arrival import first_message, read_before_refusal
from handoff_server.service.probes import SERVICE as HEALTH_SERVICE
from handoff_server.service.quotas import Budget, Quotas, Slot
from handoff_server.service.security import EngineIdentities, Token, TokenSet

log = logging.getLogger("handoff.guard")

SERVICE_PREFIX = "/" + pb.DESCRIPTOR.services_by_name["HandoffCoordinator"].full_name + "/"
HEALTH_PREFIX = f"/{HEALTH_SERVICE}/"

# grpc's handler objects are untyped at this level: behaviours take and
# return messages of whichever type the method has.
Handler = Any
Context = grpc.aio.ServicerContext[Any, Any]


# gRPC binds with SO_REUSEPORT by default: a second coordinator started on
# the same port would bind too and take part of the connections, silently.
# Off, it fails to start instead.
EXCLUSIVE_PORT = ("grpc.so_reuseport", 0)


def grpc_options(settings: Settings) -> list[tuple[str, int]]:
    """Server channel arguments for the message, stream, keepalive and age limits."""
    options = [
        EXCLUSIVE_PORT,
        ("grpc.max_receive_message_length", settings.max_message_bytes),
        ("grpc.max_concurrent_streams", settings.max_concurrent_streams),
        ("grpc.keepalive_time_ms", round(settings.keepalive_time_s * 1000)),
        ("grpc.keepalive_timeout_ms", round(settings.keepalive_timeout_s * 1000)),
        # In this gRPC the wait for a ping's ack is bounded by ping_timeout
        # (default one minute), not by keepalive_timeout alone: set both.
        ("grpc.http2.ping_timeout_ms", round(settings.keepalive_timeout_s * 1000)),
        # Keepalive must also probe a connection that carries only an idle
        # engine stream; by default gRPC stops pinging after two pings
        # without data, and a dead engine would then go unnoticed.
        ("grpc.http2.max_pings_without_data", 0),
        ("grpc.keepalive_permit_without_calls", 1),
        (
            "grpc.http2.min_ping_interval_without_data_ms",
            round(settings.keepalive_min_client_interval_s * 1000),
        ),
        # HTTP/2 rapid reset (CVE-2023-44487): a stream the peer resets keeps
        # counting against max_concurrent_streams until the server is done with
        # it, so one connection cannot open streams faster than they are
        # served; at most 32 new streams are taken per read of a connection,
        # and every 100th RST_STREAM is answered with a PING, so a peer that
        # stops reading is paused. These are gRPC's defaults in this version,
        # set here so that no upgrade turns them off unnoticed.
        ("grpc.http.overload_protection", 1),
        ("grpc.http2.max_requests_per_read", 32),
        ("grpc.http2.ping_on_rst_stream_percent", 1),
    ]
    if settings.max_connection_age_s > 0:
        options += [
            ("grpc.max_connection_age_ms", round(settings.max_connection_age_s * 1000)),
            ("grpc.max_connection_age_grace_ms", round(settings.max_connection_age_grace_s * 1000)),
        ]
    return options


@dataclass(frozen=True, slots=True)
class Undecodable:
    """Stands in for a request whose bytes are not a message of the method's type."""

    type_name: str


def _tolerant(deserializer: Callable[[bytes], Any], type_name: str) -> Callable[[bytes], Any]:
    def deserialize(raw: bytes) -> Any:
        try:
            return deserializer(raw)
        except Exception:
            return Undecodable(type_name)

    return deserialize


class EngineStreams:
    """Live engine streams, counted per engine id, at most ``limit`` engines."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.live: dict[str, int] = {}

    def admit(self, engine_id: str) -> bool:
        count = self.live.get(engine_id, 0)
        if count == 0 and len(self.live) >= self.limit:
            return False
        self.live[engine_id] = count + 1
        return True

    def release(self, engine_id: str) -> None:
        count = self.live.pop(engine_id) - 1
        if count:
            self.live[engine_id] = count


class Guard(grpc.aio.ServerInterceptor):  # type: ignore[type-arg]
    def __init__(
        self,
        *,
        metrics: Metrics,
        streams: EngineStreams,
        calls: Budget,
        quotas: Quotas,
        tokens: TokenSet | None = None,
        exempt: tuple[str, ...] = (),
        identities: EngineIdentities | None = None,
        client_certificates: bool = False,
        request_within_s: float = 10.0,
    ) -> None:
        self.metrics = metrics
        self.streams = streams
        self.calls = calls
        self.quotas = quotas
        self.tokens = tokens
        self.exempt = exempt
        self.identities = identities
        self.client_certificates = client_certificates
        self.request_within_s = request_within_s
        # Method -> (handler found, its wrapper): gRPC looks handlers up on
        # every call and finds the same object each time; wrap it once.
        self._wrapped: dict[str, tuple[Handler, Handler]] = {}

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[Handler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> Handler:
        method = handler_call_details.method
        if self.tokens is not None and not method.startswith(self.exempt):
            holder = security.authenticate(
                self.tokens, handler_call_details.invocation_metadata or ()
            )
            if isinstance(holder, str):
                # Refused before the method is even looked up: an unknown
                # method gets the same answer, and nothing of the request
                # is parsed.
                self._count(method, grpc.StatusCode.UNAUTHENTICATED)
                return _refusal(grpc.StatusCode.UNAUTHENTICATED, holder)
            rpc = method.removeprefix(SERVICE_PREFIX)
            if (refused := holder.refusal(rpc)) is not None:
                self._count(method, grpc.StatusCode.PERMISSION_DENIED)
                return _refusal(grpc.StatusCode.PERMISSION_DENIED, refused)
            # The handler runs in this call's task, after this returns.
            HOLDER.set(holder)
        handler = await continuation(handler_call_details)
        if handler is None or method.startswith(HEALTH_PREFIX):
            return handler
        cached = self._wrapped.get(method)
        if cached is not None and cached[0] is handler:
            return cached[1]
        if method.startswith(SERVICE_PREFIX):
            wrapped = self._wrap(method.removeprefix(SERVICE_PREFIX), handler)
        else:
            wrapped = self._counted(handler)
        self._wrapped[method] = (handler, wrapped)
        return wrapped

    def _count(self, method: str, code: grpc.StatusCode) -> None:
        rpc = method.removeprefix(SERVICE_PREFIX)
        if rpc in RPCS:  # labels stay bounded whatever method names arrive
            self.metrics.rejected(rpc, code.name)

    async def _refuse(
        self,
        rpc: str,
        context: Context,
        code: grpc.StatusCode,
        message: str,
        unread: AsyncIterator[Any] | None = None,
    ) -> NoReturn:
        """End the call with ``code``; ``unread``: its requests, when its first
        message is not read yet (:func:`arrival.read_before_refusal`)."""
        self.metrics.rejected(rpc, code.name)
        if unread is not None:
            await read_before_refusal(unread)
        await context.abort(code, message)

    def _identity(self, context: Context) -> str | None:
        """The caller: its token's name, else its client certificate's first DNS or URI SAN."""
        holder = HOLDER.get()
        if holder is not None:
            return str(holder)
        if not self.client_certificates:
            return None  # no certificate to read (and reading costs on every call)
        return security.certificate_identity(context.auth_context())

    async def _enter(self, rpc: str, context: Context, requests: AsyncIterator[Any]) -> Held:
        """Count a call as it arrives, before its first message, server-wide and
        for its caller's identity (or refuse it), and note who makes it;
        :meth:`_leave` what it holds when it ends."""
        slot = self.calls.enter()
        if slot is None:
            await self._refuse(
                rpc, context, grpc.StatusCode.RESOURCE_EXHAUSTED, self.calls.refusal(), requests
            )
        held = Held(slot, self._identity(context))
        caller = bindings.caller_of(
            HOLDER.get(),
            tokens=self.tokens is not None,
            identities=self.identities,
            mutual=self.client_certificates,
            auth_context=context.auth_context,
        )
        if caller is not None:
            bindings.CALLER.set(caller)
        if held.identity is not None:
            left_s = context.time_remaining()
            turn = self.quotas.arrive(held.identity, rpc, math.inf if left_s is None else left_s)
            if isinstance(turn, str):
                slot.leave()
                code = grpc.StatusCode.RESOURCE_EXHAUSTED
                await self._refuse(rpc, context, code, turn, requests)
            held.arriving = True
            if turn > 0:
                await self._wait_turn(rpc, context, held, turn)
        return held

    async def _wait_turn(self, rpc: str, context: Context, held: Held, wait_s: float) -> None:
        """Hold a call past its identity's rate of calls until its turn: the
        caller is slowed to its rate, where a refusal at once would be tried
        again at once, each try costing a call, and its waiting calls take
        their connections' streams (max_concurrent_streams), not other
        callers' place in the transport's queue. A newer arrival may still
        end it (Budget), as it may end any call without its message."""
        self.metrics.calls_paced.inc()
        evicted = asyncio.Event()
        held.slot.on_evict = evicted.set
        try:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(wait_s):
                    await evicted.wait()
        except BaseException:
            self._leave(held)  # canceled by its caller while it waited
            raise
        if held.slot.evicted:
            self._leave(held)
            # Ended at once, unread: evictions shed a crowd of calls without
            # messages, and waiting on each for its message would keep them.
            await self._refuse(
                rpc, context, grpc.StatusCode.RESOURCE_EXHAUSTED, held.slot.budget.eviction()
            )

    async def _first(
        self, rpc: str, requests: AsyncIterator[Any], context: Context, held: Held
    ) -> Any:
        """The call's first message, within ``request_within_s`` of its arrival;
        counted for its identity from then on as a call, or with ``engine_id``
        (of the message) as that engine's stream, once per engine."""
        request = await first_message(
            requests,
            context,
            held.slot,
            self.request_within_s,
            what=rpc,
            setting="request_within_s",
            refused=lambda code: self.metrics.rejected(rpc, code.name),
        )
        self._arrived(held)
        return request

    def _arrived(self, held: Held) -> None:
        if held.arriving and held.identity is not None:
            held.arriving = False
            self.quotas.arrived(held.identity)

    async def _hold(
        self, rpc: str, context: Context, held: Held, engine_id: str | None = None
    ) -> None:
        """Count the call for its identity, now that its message came: as a
        call, or with ``engine_id`` as that engine's stream (a stream replacing
        the same engine's is always admitted and not counted again)."""
        if held.identity is None:
            return
        if engine_id is None:
            refusal = self.quotas.enter_call(held.identity)
            held.call = refusal is None
        else:
            refusal = self.quotas.enter_stream(held.identity, engine_id)
            held.engine_id = None if refusal else engine_id
        if refusal is not None:
            await self._refuse(rpc, context, grpc.StatusCode.RESOURCE_EXHAUSTED, refusal)

    def _leave(self, held: Held) -> None:
        held.slot.leave()
        if held.identity is None:
            return
        self._arrived(held)
        if held.call:
            self.quotas.leave_call(held.identity)
        if held.engine_id is not None:
            self.quotas.leave_stream(held.identity, held.engine_id)

    def _counted(self, handler: Handler) -> Handler:
        """Another service's streaming handler (reflection), counted as a call."""
        assert handler.stream_stream is not None, "only reflection is expected here"
        inner = handler.stream_stream

        async def stream(requests: AsyncIterator[Any], context: Context) -> AsyncIterator[Any]:
            held = await self._enter("ServerReflectionInfo", context, requests)
            self._arrived(held)  # counted as a call from the start

            async def arriving() -> AsyncIterator[Any]:
                async for request in requests:
                    held.slot.arrived()
                    yield request

            try:
                await self._hold("ServerReflectionInfo", context, held)
                async for response in inner(arriving(), context):
                    yield response
            finally:
                self._leave(held)

        return grpc.stream_stream_rpc_method_handler(
            stream, handler.request_deserializer, handler.response_serializer
        )

    def _wrap(self, rpc: str, handler: Handler) -> Handler:
        descriptor = pb.DESCRIPTOR.services_by_name["HandoffCoordinator"].methods_by_name[rpc]
        type_name = descriptor.input_type.full_name
        assert handler.request_deserializer is not None, f"{rpc} has no deserializer"
        deserialize = _tolerant(handler.request_deserializer, type_name)
        undecodable = f"the request is not a valid {type_name} message"
        if handler.unary_unary is not None:
            inner = handler.unary_unary
            starts = rpc == "StartHandoff"

            async def unary(requests: AsyncIterator[Any], context: Context) -> Any:
                held = await self._enter(rpc, context, requests)
                try:
                    request = await self._first(rpc, requests, context, held)
                    if isinstance(request, Undecodable):
                        code = grpc.StatusCode.INVALID_ARGUMENT
                        await self._refuse(rpc, context, code, undecodable)
                    await self._hold(rpc, context, held)
                    if starts and held.identity is not None:
                        refusal = self.quotas.admit_start(held.identity)
                        if refusal is not None:
                            code = grpc.StatusCode.RESOURCE_EXHAUSTED
                            await self._refuse(rpc, context, code, refusal)
                    response = await inner(request, context)
                    if starts and held.identity is not None:
                        handoff = response.handoff
                        if handoff.phase != pb.PHASE_COMPLETE:
                            self.quotas.started(held.identity, handoff.handoff_id)
                    return response
                finally:
                    self._leave(held)

            # Registered as streaming handlers whatever their shape on the
            # wire, so that they run (and count) when the call arrives
            # (arrival.py), not once its message has.
            return grpc.stream_unary_rpc_method_handler(
                unary, deserialize, handler.response_serializer
            )
        if handler.unary_stream is not None:
            return grpc.stream_stream_rpc_method_handler(
                self._stream_actions(rpc, handler.unary_stream, undecodable),
                deserialize,
                handler.response_serializer,
            )
        assert handler.stream_stream is not None, f"unexpected method shape for {rpc}"
        return grpc.stream_stream_rpc_method_handler(
            self._connect(rpc, handler.stream_stream, undecodable),
            deserialize,
            handler.response_serializer,
        )

    async def _admit(self, rpc: str, context: Context, engine_id: str) -> str | None:
        """Count a stream for a well-formed engine id (a malformed one is the
        servicer's to refuse); None when there is nothing to count."""
        if not convert.ENGINE_ID.fullmatch(engine_id):
            return None
        if not self.streams.admit(engine_id):
            await self._refuse(
                rpc,
                context,
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"engine {engine_id}: {self.streams.limit} engines already have a live "
                "stream, the limit (max_engines)",
            )
        return engine_id

    async def _pace(self, held: Held, request: Any) -> None:
        """Hold a Connect message back until its identity may send its reports
        (max_reports_per_s_per_identity): the stream is read more slowly, which
        costs the server nothing, where refused reports would be sent again."""
        if held.identity is None:
            return
        # A message past the cap is refused whole, unread: it costs one message.
        reports = min(len(convert.reports_of(request)), convert.MAX_REPORTS_PER_MESSAGE)
        delay = self.quotas.report_delay_s(held.identity, reports)
        if delay > 0:
            self.metrics.reports_paced.inc()
            await asyncio.sleep(delay)  # the identity's rate, not a wait for an event

    def _stream_actions(
        self, rpc: str, inner: Callable[[Any, Context], AsyncGenerator[Any, None]], undecodable: str
    ) -> Callable[[AsyncIterator[Any], Context], AsyncIterator[Any]]:
        async def stream(requests: AsyncIterator[Any], context: Context) -> AsyncIterator[Any]:
            held = await self._enter(rpc, context, requests)
            try:
                request = await self._first(rpc, requests, context, held)
                if isinstance(request, Undecodable):
                    code = grpc.StatusCode.INVALID_ARGUMENT
                    await self._refuse(rpc, context, code, undecodable)
                named = (
                    request.engine_id if convert.ENGINE_ID.fullmatch(request.engine_id) else None
                )
                await self._hold(rpc, context, held, named)
                engine_id = await self._admit(rpc, context, request.engine_id)
                try:
                    async with contextlib.aclosing(inner(request, context)) as actions:
                        async for action in actions:
                            yield action
                finally:
                    if engine_id is not None:
                        self.streams.release(engine_id)
            finally:
                self._leave(held)

        return stream

    def _connect(
        self,
        rpc: str,
        inner: Callable[[AsyncIterator[Any], Context], AsyncGenerator[Any, None]],
        undecodable: str,
    ) -> Callable[[AsyncIterator[Any], Context], AsyncIterator[Any]]:
        async def stream(requests: AsyncIterator[Any], context: Context) -> AsyncIterator[Any]:
            # Counted as a call from its arrival, then once its hello names
            # its engine (within request_within_s) as that engine's stream.
            held = await self._enter(rpc, context, requests)
            try:
                async with contextlib.aclosing(connected(requests, context, held)) as responses:
                    async for response in responses:
                        yield response
            finally:
                self._leave(held)

        async def connected(
            requests: AsyncIterator[Any], context: Context, held: Held
        ) -> AsyncGenerator[Any, None]:
            incoming = aiter(requests)
            first = await self._first(rpc, incoming, context, held)
            if isinstance(first, Undecodable):
                await self._refuse(rpc, context, grpc.StatusCode.INVALID_ARGUMENT, undecodable)
            engine_id = None
            if first.WhichOneof("kind") == "hello":
                if convert.ENGINE_ID.fullmatch(first.hello.engine_id):
                    await self._hold(rpc, context, held, first.hello.engine_id)
                engine_id = await self._admit(rpc, context, first.hello.engine_id)
            garbled: list[int] = []

            async def reports() -> AsyncIterator[Any]:
                yield first  # the hello (or whatever came first), never acknowledged
                count = 1
                async for request in incoming:
                    count += 1
                    if isinstance(request, Undecodable):
                        # End the servicer's read as if the peer had half-closed,
                        # so what came before is still acknowledged; then refuse.
                        garbled.append(count)
                        return
                    await self._pace(held, request)
                    yield request

            try:
                async with contextlib.aclosing(inner(reports(), context)) as responses:
                    async for response in responses:
                        yield response
            finally:
                if engine_id is not None:
                    self.streams.release(engine_id)
            if garbled:
                await self._refuse(
                    rpc,
                    context,
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"message {garbled[0]} on this stream: {undecodable}",
                )

        return stream


# The accepted token of the call being handled; set by the interceptor, which
# runs in the call's own task before its handler.
HOLDER: ContextVar[Token | None] = ContextVar("handoff_token_holder", default=None)


@dataclass(slots=True)
class Held:
    """What one call holds: its server-wide slot, and in the per-identity accounting."""

    slot: Slot
    identity: str | None  # None: an anonymous caller, counted server-wide only
    arriving: bool = False  # counted as its identity's call waiting for a first message
    call: bool = False  # counted as a call of its identity
    engine_id: str | None = None  # counted as that engine's stream instead


def _refusal(code: grpc.StatusCode, message: str) -> Handler:
    # A stream-stream handler fits a call of any shape, and it never
    # deserializes the request (the first is read as bytes, see
    # arrival.read_before_refusal).
    async def refuse(requests: AsyncIterator[bytes], context: Context) -> None:
        await read_before_refusal(requests)
        await context.abort(code, message)

    return grpc.stream_stream_rpc_method_handler(refuse)
