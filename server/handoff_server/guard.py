"""The interceptor in front of every call: tokens, undecodable input, stream limits.

For every RPC it checks the bearer token (unless the method is exempt, like
health). For the coordinator's own RPCs it also wraps the handler:

- a request that does not decode gets INVALID_ARGUMENT (gRPC's own answer
  would be UNKNOWN, with the parser's exception in the message);
- the caller's certificate identity is put in :data:`security.CALLER` for the
  servicer's engine checks;
- at most ``max_engines`` engines hold a live stream (StreamActions or
  Connect); a new subscription for an engine that already has one replaces
  it in the registry and is always admitted.

Connect's window of unacknowledged reports is delivery's (delivery.AckWindow).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any, NoReturn

import grpc

from handoff.v1 import coordinator_pb2 as pb
from handoff_server import security
from handoff_server.config import Settings
from handoff_server.convert import ENGINE_ID
from handoff_server.metrics import RPCS, Metrics
from handoff_server.security import EngineIdentities, TokenSet

log = logging.getLogger("handoff.guard")

SERVICE_PREFIX = "/" + pb.DESCRIPTOR.services_by_name["HandoffCoordinator"].full_name + "/"

# grpc's handler objects are untyped at this level: behaviours take and
# return messages of whichever type the method has.
Handler = Any
Context = grpc.aio.ServicerContext[Any, Any]


def grpc_options(settings: Settings) -> list[tuple[str, int]]:
    """Server channel arguments for the message, stream, keepalive and age limits."""
    options = [
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
        self._changed = asyncio.Event()

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
        self._changed.set()

    async def wait_until(self, predicate: Callable[[dict[str, int]], bool]) -> None:
        """Until ``predicate(live)`` holds: lets tests await a stream's end."""
        while not predicate(self.live):
            self._changed.clear()
            await self._changed.wait()


class Guard(grpc.aio.ServerInterceptor):  # type: ignore[type-arg]
    def __init__(
        self,
        *,
        metrics: Metrics,
        streams: EngineStreams,
        tokens: TokenSet | None = None,
        exempt: tuple[str, ...] = (),
        identities: EngineIdentities | None = None,
    ) -> None:
        self.metrics = metrics
        self.streams = streams
        self.tokens = tokens
        self.exempt = exempt
        self.identities = identities
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
            problem = security.bearer_problem(
                self.tokens, handler_call_details.invocation_metadata or ()
            )
            if problem is not None:
                # Refused before the method is even looked up: an unknown
                # method gets the same answer, and nothing of the request
                # is read or parsed.
                self._count(method, grpc.StatusCode.UNAUTHENTICATED)
                return _refusal(grpc.StatusCode.UNAUTHENTICATED, problem)
        handler = await continuation(handler_call_details)
        if handler is None or not method.startswith(SERVICE_PREFIX):
            return handler
        cached = self._wrapped.get(method)
        if cached is not None and cached[0] is handler:
            return cached[1]
        wrapped = self._wrap(method.removeprefix(SERVICE_PREFIX), handler)
        self._wrapped[method] = (handler, wrapped)
        return wrapped

    def _count(self, method: str, code: grpc.StatusCode) -> None:
        rpc = method.removeprefix(SERVICE_PREFIX)
        if rpc in RPCS:  # labels stay bounded whatever method names arrive
            self.metrics.rejected(rpc, code.name)

    async def _refuse(
        self, rpc: str, context: Context, code: grpc.StatusCode, message: str
    ) -> NoReturn:
        self.metrics.rejected(rpc, code.name)
        await context.abort(code, message)

    def _enter(self, context: Context) -> None:
        if self.identities is not None:
            security.CALLER.set(security.Caller.of(self.identities, context.auth_context()))

    def _wrap(self, rpc: str, handler: Handler) -> Handler:
        descriptor = pb.DESCRIPTOR.services_by_name["HandoffCoordinator"].methods_by_name[rpc]
        type_name = descriptor.input_type.full_name
        assert handler.request_deserializer is not None, f"{rpc} has no deserializer"
        deserialize = _tolerant(handler.request_deserializer, type_name)
        undecodable = f"the request is not a valid {type_name} message"
        if handler.unary_unary is not None:
            inner = handler.unary_unary

            async def unary(request: Any, context: Context) -> Any:
                if isinstance(request, Undecodable):
                    await self._refuse(rpc, context, grpc.StatusCode.INVALID_ARGUMENT, undecodable)
                self._enter(context)
                return await inner(request, context)

            return grpc.unary_unary_rpc_method_handler(
                unary, deserialize, handler.response_serializer
            )
        if handler.unary_stream is not None:
            return grpc.unary_stream_rpc_method_handler(
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
        if not ENGINE_ID.fullmatch(engine_id):
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

    def _stream_actions(
        self, rpc: str, inner: Callable[[Any, Context], AsyncGenerator[Any, None]], undecodable: str
    ) -> Callable[[Any, Context], AsyncIterator[Any]]:
        async def stream(request: Any, context: Context) -> AsyncIterator[Any]:
            if isinstance(request, Undecodable):
                await self._refuse(rpc, context, grpc.StatusCode.INVALID_ARGUMENT, undecodable)
            self._enter(context)
            engine_id = await self._admit(rpc, context, request.engine_id)
            try:
                async with contextlib.aclosing(inner(request, context)) as actions:
                    async for action in actions:
                        yield action
            finally:
                if engine_id is not None:
                    self.streams.release(engine_id)

        return stream

    def _connect(
        self,
        rpc: str,
        inner: Callable[[AsyncIterator[Any], Context], AsyncGenerator[Any, None]],
        undecodable: str,
    ) -> Callable[[AsyncIterator[Any], Context], AsyncIterator[Any]]:
        async def stream(requests: AsyncIterator[Any], context: Context) -> AsyncIterator[Any]:
            incoming = aiter(requests)
            first = await anext(incoming, None)
            if isinstance(first, Undecodable):
                await self._refuse(rpc, context, grpc.StatusCode.INVALID_ARGUMENT, undecodable)
            self._enter(context)
            engine_id = None
            if first is not None and first.WhichOneof("kind") == "hello":
                engine_id = await self._admit(rpc, context, first.hello.engine_id)
            garbled: list[int] = []

            async def reports() -> AsyncIterator[Any]:
                if first is not None:
                    yield first  # the hello (or whatever came first), never acknowledged
                count = 1
                async for request in incoming:
                    count += 1
                    if isinstance(request, Undecodable):
                        # End the servicer's read as if the peer had half-closed,
                        # so what came before is still acknowledged; then refuse.
                        garbled.append(count)
                        return
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


def _refusal(code: grpc.StatusCode, message: str) -> Handler:
    # A stream-stream handler fits a call of any shape, and it never reads
    # (so never deserializes) the request.
    async def refuse(requests: AsyncIterator[bytes], context: Context) -> None:
        await context.abort(code, message)

    return grpc.stream_stream_rpc_method_handler(refuse)
