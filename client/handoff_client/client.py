"""HandoffClient: typed async calls to the coordinator.

Every call has a deadline (``timeout_s``, per client and per call) and raises a
:class:`~handoff_client.errors.HandoffRpcError` subclass on failure. Calls that
the server makes idempotent (GetHandoff, ReportFact, ReportOutcome) are retried
on UNAVAILABLE with jittered backoff inside that deadline. StartHandoff is
idempotent too (the same id with the same parameters answers the handoff as it
stands, flagged ``already_started``), so it is retried on UNAVAILABLE and on
DEADLINE_EXCEEDED, each attempt with the whole deadline: an attempt whose
answer was lost is answered by the next one.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Sequence
from types import TracebackType
from typing import Self, TypeVar

import grpc

from handoff.v1 import coordinator_pb2 as pb
from handoff.v1 import coordinator_pb2_grpc as pb_grpc
from handoff_client import tracing
from handoff_client.convert import (
    action_from_pb,
    actions_from_pb,
    fact_to_pb,
    handoff_from_pb,
    outcome_to_pb,
)
from handoff_client.credentials import ChannelSecurity, PemSource
from handoff_client.errors import error_for
from handoff_client.liveness import Liveness
from handoff_client.model import (
    Action,
    Canceled,
    EngineType,
    Fact,
    Handoff,
    HandoffUpdate,
    Order,
    Outcome,
    Reconciled,
    Release,
    ReleaseReason,
    Role,
)
from handoff_client.retry import RetryPolicy

# Which failures each kind of call retries; a call retried on
# DEADLINE_EXCEEDED gives every attempt the whole deadline.
RETRY_UNAVAILABLE = frozenset({grpc.StatusCode.UNAVAILABLE})
RETRY_UNAVAILABLE_OR_DEADLINE = frozenset(
    {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED}
)

Request = TypeVar("Request")
Response = TypeVar("Response")

ChannelOptions = Sequence[tuple[str, str | int]]
Side = tuple[str, Role]  # a handoff id and the engine's role in it
# One Reconcile request carries sides up to about this many bytes: well under
# the server's default 64 KiB message limit, whatever the ids' length.
RECONCILE_CHUNK_BYTES = 32 * 1024


class HandoffClient:
    """An async client for one coordinator; use it with ``async with``.

    ``target`` is ``host:port``. TLS is on when ``tls=True`` or any certificate
    is given (PEM bytes, or a path); ``tls_client_cert`` with
    ``tls_client_key`` makes it mutual. ``token`` is sent as
    ``authorization: Bearer <token>`` on every call.
    """

    def __init__(
        self,
        target: str,
        *,
        timeout_s: float = 10.0,
        retry: RetryPolicy | None = None,
        tls: bool | None = None,
        tls_root_cert: PemSource | None = None,
        tls_client_cert: PemSource | None = None,
        tls_client_key: PemSource | None = None,
        token: str | None = None,
        channel_options: ChannelOptions = (),
        rng: random.Random | None = None,
    ) -> None:
        if not timeout_s > 0:
            raise ValueError("timeout_s must be > 0")
        security = ChannelSecurity.from_options(
            tls=tls,
            tls_root_cert=tls_root_cert,
            tls_client_cert=tls_client_cert,
            tls_client_key=tls_client_key,
            token=token,
        )
        credentials = security.channel_credentials()
        options = list(channel_options)
        self._channel = (
            grpc.aio.insecure_channel(target, options=options)
            if credentials is None
            else grpc.aio.secure_channel(target, credentials, options=options)
        )
        self._stub = pb_grpc.HandoffCoordinatorStub(self._channel)
        self._metadata = security.metadata()
        self.timeout_s = timeout_s
        self.retry = retry or RetryPolicy()
        self._rng = rng or random.Random()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        await self.close()

    async def close(self) -> None:
        # No grace: a caller closing the client is done with its calls, and a
        # grace period would keep long-lived streams open until it expired.
        await self._channel.close(None)

    async def wait_ready(self) -> None:
        """Until the channel is connected, e.g. after the server restarted.

        Bound it with asyncio.timeout.
        """
        await self._channel.channel_ready()

    # --- calls ------------------------------------------------------------

    async def start_handoff(
        self,
        handoff_id: str,
        *,
        source_engine_id: str,
        destination_engine_id: str,
        order: Order | None = None,
        engine_type: EngineType | None = None,
        fallback_transfer_delay_ms: float = 0.0,
        transfer_executor: Role = Role.SOURCE,
        handoff_timeout_s: float | None = None,
        timeout_s: float | None = None,
    ) -> HandoffUpdate:
        """Create and start one handoff. Give ``order`` or ``engine_type`` (or both, agreeing).

        ``handoff_timeout_s`` is the handoff's own deadline (server default when
        None); ``timeout_s`` is each attempt's. Retried on UNAVAILABLE and
        DEADLINE_EXCEEDED up to ``retry.max_attempts`` times: when an earlier
        attempt reached the server, the answer has ``already_started`` set and
        no actions (they went to the engines' streams). ALREADY_EXISTS means
        the id is taken by a handoff with other parameters; the message names
        the field that differs.
        """
        if order is None and engine_type is None:
            raise ValueError("give order or engine_type")
        request = pb.StartHandoffRequest(
            handoff_id=handoff_id,
            order=pb.HandoffOrder.Value(
                "HANDOFF_ORDER_" + (order.name if order else "UNSPECIFIED")
            ),
            engine_type=pb.EngineType.Value(
                "ENGINE_TYPE_" + (engine_type.name if engine_type else "UNSPECIFIED")
            ),
            source_engine_id=source_engine_id,
            destination_engine_id=destination_engine_id,
            fallback_transfer_delay_ms=fallback_transfer_delay_ms,
            transfer_executor=pb.Role.Value("ROLE_" + transfer_executor.name),
            timeout_s=handoff_timeout_s,  # None leaves it absent: the server default
        )
        # The caller's trace continues in the coordinator (with the otel extra).
        metadata = self._metadata + tracing.current_context_metadata()
        response = await self._call(
            self._stub.StartHandoff,
            request,
            timeout_s,
            retry=RETRY_UNAVAILABLE_OR_DEADLINE,
            metadata=metadata,
        )
        return HandoffUpdate(
            handoff_from_pb(response.handoff),
            actions_from_pb(response.actions),
            already_started=response.already_started,
        )

    async def report_fact(
        self, handoff_id: str, fact: Fact, *, timeout_s: float | None = None
    ) -> HandoffUpdate:
        request = pb.ReportFactRequest(handoff_id=handoff_id, fact=fact_to_pb(fact))
        response = await self._call(
            self._stub.ReportFact, request, timeout_s, retry=RETRY_UNAVAILABLE
        )
        return HandoffUpdate(handoff_from_pb(response.handoff), actions_from_pb(response.actions))

    async def cancel(
        self, handoff_id: str, reason: str, *, timeout_s: float | None = None
    ) -> HandoffUpdate:
        """Cancel a handoff (the frontend's call); after success it reopens and frees the decode."""
        return await self.report_fact(handoff_id, Canceled(reason), timeout_s=timeout_s)

    async def report_outcome(
        self, handoff_id: str, action_id: int, outcome: Outcome, *, timeout_s: float | None = None
    ) -> HandoffUpdate:
        request = pb.ReportOutcomeRequest(
            handoff_id=handoff_id, action_id=action_id, outcome=outcome_to_pb(outcome)
        )
        response = await self._call(
            self._stub.ReportOutcome, request, timeout_s, retry=RETRY_UNAVAILABLE
        )
        return HandoffUpdate(handoff_from_pb(response.handoff), actions_from_pb(response.actions))

    async def reconcile(
        self,
        engine_id: str,
        *,
        incarnation: str,
        session_id: str,
        held: Sequence[Side],
        freed: Sequence[Side],
        timeout_s: float | None = None,
    ) -> Reconciled:
        """Tell the coordinator what ``engine_id`` holds and freed on its own; which to free.

        Sent in as many requests as the message limit needs (each within
        ``timeout_s``), freed sides first; retried on UNAVAILABLE (a
        reconcile is idempotent). See :class:`~handoff_client.sidecar.EngineSidecar`.
        """
        releases: list[Release] = []
        lost_applied = 0
        for chunk in _chunks([(side, True) for side in freed] + [(side, False) for side in held]):
            request = pb.ReconcileRequest(
                engine_id=engine_id, incarnation=incarnation, session_id=session_id
            )
            for (handoff_id, role), was_freed in chunk:
                sides = request.freed if was_freed else request.held
                sides.add(handoff_id=handoff_id, role=_ROLE_TO_PB[role])
            response = await self._call(
                self._stub.Reconcile, request, timeout_s, retry=RETRY_UNAVAILABLE
            )
            lost_applied += response.lost_applied
            releases.extend(
                Release(
                    release.handoff_id,
                    Role(release.role),
                    ReleaseReason(release.reason)
                    if release.reason in _RELEASE_REASONS
                    else ReleaseReason.UNSPECIFIED,
                )
                for release in response.releases
                if release.role in _ROLE_TO_PB.values()
            )
        return Reconciled(tuple(releases), lost_applied)

    async def get_handoff(self, handoff_id: str, *, timeout_s: float | None = None) -> Handoff:
        request = pb.GetHandoffRequest(handoff_id=handoff_id)
        response = await self._call(
            self._stub.GetHandoff, request, timeout_s, retry=RETRY_UNAVAILABLE
        )
        return handoff_from_pb(response.handoff)

    async def stream_actions(
        self,
        engine_id: str,
        on_subscribed: Callable[[], None] | None = None,
        *,
        incarnation: str = "",
        session_id: str = "",
        liveness: Liveness | None = None,
    ) -> AsyncGenerator[Action, None]:
        """Every action addressed to ``engine_id``, until the stream ends or fails.

        ``incarnation`` and ``session_id`` fence the subscription (see
        :class:`~handoff_client.sidecar.EngineSidecar`); empty, there is none.
        Given ``liveness``, the stream asks for heartbeats and stamps each
        message (heartbeats are not yielded) and the subscription's headers there.

        ``on_subscribed`` is called once the server confirms the subscription
        (its response headers), which may be long before the first action.
        A long-lived stream: it has no deadline and is not retried here
        (:class:`~handoff_client.sidecar.EngineSidecar` reconnects). Close it
        with ``contextlib.aclosing`` to cancel the call.
        """
        call = self._stub.StreamActions(
            pb.StreamActionsRequest(
                engine_id=engine_id,
                incarnation=incarnation,
                session_id=session_id,
                heartbeats=liveness is not None,
            ),
            metadata=self._metadata,
        )
        try:
            if on_subscribed is not None or liveness is not None:
                headers = await call.initial_metadata()
                # A call that failed before the server took it (no server, a
                # refused token) also "has" headers: empty ones, and it is done.
                # It is no subscription; iterating raises its error.
                if not call.done():
                    if liveness is not None:
                        liveness.subscribed(headers)
                    if on_subscribed is not None:
                        on_subscribed()
            async for message in call:
                if liveness is not None:
                    liveness.heard()
                    if message.kind == pb.ACTION_KIND_HEARTBEAT:
                        continue
                yield action_from_pb(message)
        except grpc.aio.AioRpcError as error:
            raise error_for(error) from error
        finally:
            call.cancel()

    def _open_connect(
        self, requests: AsyncIterator[pb.ConnectRequest]
    ) -> grpc.aio.StreamStreamCall[pb.ConnectRequest, pb.ConnectResponse]:
        """A Connect call with this client's credentials, for :class:`ConnectTransport`.

        Package-internal: the SDK's public surface carries no protobuf.
        """
        return self._stub.Connect(requests, metadata=self._metadata)

    # --- the one path every unary call takes --------------------------------

    async def _call(
        self,
        method: grpc.aio.UnaryUnaryMultiCallable[Request, Response],
        request: Request,
        timeout_s: float | None,
        *,
        retry: frozenset[grpc.StatusCode],
        metadata: tuple[tuple[str, str], ...] | None = None,
    ) -> Response:
        loop = asyncio.get_running_loop()
        budget = self.timeout_s if timeout_s is None else timeout_s
        deadline = loop.time() + budget
        per_attempt = grpc.StatusCode.DEADLINE_EXCEEDED in retry
        failures = 0
        while True:
            if per_attempt:
                deadline = loop.time() + budget
            try:
                return await method(
                    request,
                    timeout=deadline - loop.time(),
                    metadata=self._metadata if metadata is None else metadata,
                )
            except grpc.aio.AioRpcError as error:
                failures += 1
                delay = self.retry.backoff.delay_s(failures, self._rng)
                if not (
                    error.code() in retry
                    and failures < self.retry.max_attempts
                    and (per_attempt or loop.time() + delay < deadline)
                ):
                    raise error_for(error) from error
            await asyncio.sleep(delay)


_ROLE_TO_PB = {Role.SOURCE: pb.ROLE_SOURCE, Role.DESTINATION: pb.ROLE_DESTINATION}
_RELEASE_REASONS = frozenset(reason.value for reason in ReleaseReason)


def _chunks(sides: list[tuple[Side, bool]]) -> list[list[tuple[Side, bool]]]:
    """``sides`` cut into requests of at most about RECONCILE_CHUNK_BYTES; at least one."""
    chunks: list[list[tuple[Side, bool]]] = [[]]
    size = 0
    for side in sides:
        weight = len(side[0][0]) + 8  # the id, plus a side's framing and role
        if size + weight > RECONCILE_CHUNK_BYTES and chunks[-1]:
            chunks.append([])
            size = 0
        chunks[-1].append(side)
        size += weight
    return chunks
