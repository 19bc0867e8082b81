"""HandoffClient: typed async calls to the coordinator.

Every call has a deadline (``timeout_s``, per client and per call) that it
never outlives, whatever the retry policy, and raises a
:class:`~handoff_client.errors.HandoffRpcError` subclass on failure
(DeadlineExceededError once the deadline passed). Calls that the server makes
idempotent (GetHandoff, ReportFact, ReportOutcome, Reconcile) are retried on
UNAVAILABLE with jittered backoff inside that deadline. StartHandoff is
idempotent too (the same id with the same parameters answers the handoff as it
stands, flagged ``already_started``), so it is retried on UNAVAILABLE and on
DEADLINE_EXCEEDED inside its deadline: an attempt whose answer was lost is
answered by the next one.

Sharded coordinators (docs/sharding.md): the client learns the shard map
(routing.py) and sends a new handoff to the shard that wins it by rendezvous
hashing (placement.py), later calls to the shard that answered its start;
with one shard, every call takes the one channel as before.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Mapping, Sequence
from types import TracebackType
from typing import Self, TypeVar

import grpc

from handoff_client import tracing
from handoff_client.convert import (
    action_from_pb,
    actions_from_pb,
    fact_to_pb,
    handoff_from_pb,
    outcome_to_pb,
)
from handoff_client.credentials import ChannelSecurity, PemSource
from handoff_client.errors import (
    DeadlineExceededError,
    HandoffRpcError,
    MisroutedError,
    NotFoundError,
    UnavailableError,
    error_for,
)
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
from handoff_client.placement import ShardInfo, ShardMap
from handoff_client.retry import RetryPolicy
from handoff_client.routing import REFRESH_S, Router
from handoff_proto.v1 import coordinator_pb2 as pb
from handoff_proto.v1 import coordinator_pb2_grpc as pb_grpc

# Which failures each kind of call retries, inside its deadline.
RETRY_UNAVAILABLE = frozenset({grpc.StatusCode.UNAVAILABLE})
RETRY_UNAVAILABLE_OR_DEADLINE = frozenset(
    {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED}
)

NO_RETRY: frozenset[grpc.StatusCode] = frozenset()

Request = TypeVar("Request")
Response = TypeVar("Response")

ChannelOptions = Sequence[tuple[str, str | int]]
SideId = tuple[str, Role]  # a handoff id and the engine's role in it
Side = SideId  # the name before there were other kinds of side: kept for code that imports it
# One Reconcile request carries sides up to about this many bytes: well under
# the server's default 64 KiB message limit, whatever the ids' length.
RECONCILE_CHUNK_BYTES = 32 * 1024

# gRPC's own reconnect backoff grows to 120 s: a coordinator back after a
# restart of a few seconds would wait for the channel's next try. Capped,
# the channel notices it within a second (the caller's options win).
RECONNECT_OPTIONS: ChannelOptions = (
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
)


class HandoffClient:
    """An async client for a coordinator, sharded or not; use it with ``async with``.

    ``target`` is ``host:port``: a coordinator, one shard of a sharded one, or
    the Service in front of them; the client learns the shard map from it.
    ``shards`` gives the map instead (``{"handoff-0": "host:port", ...}``, in
    ordinal order, every shard placing). TLS is on when ``tls=True`` or any certificate
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
        shards: Mapping[str, str] | None = None,
        shard_refresh_s: float = REFRESH_S,
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
        given = {key for key, _ in channel_options}
        options = [*(o for o in RECONNECT_OPTIONS if o[0] not in given), *channel_options]

        def dial(address: str) -> grpc.aio.Channel:
            if credentials is None:
                return grpc.aio.insecure_channel(address, options=options)
            return grpc.aio.secure_channel(address, credentials, options=options)

        self._on(
            dial(target),
            owns_channel=True,
            metadata=security.metadata(),
            timeout_s=timeout_s,
            retry=retry or RetryPolicy(),
            rng=rng or random.Random(),
        )
        self._router = Router(
            self._channel,
            target,
            dial=dial,
            fetch=self._fetch_shard_map,
            explicit=None if shards is None else ShardMap.of(shards.items()),
            refresh_s=shard_refresh_s,
        )

    def _on(
        self,
        channel: grpc.aio.Channel,
        *,
        owns_channel: bool,
        metadata: tuple[tuple[str, str], ...],
        timeout_s: float,
        retry: RetryPolicy,
        rng: random.Random,
    ) -> None:
        """Everything a client is but its router: the one place its state is set."""
        self._channel = channel
        self._owns_channel = owns_channel
        self._stub = pb_grpc.HandoffCoordinatorStub(channel)
        self._metadata = metadata
        self.timeout_s = timeout_s
        self.retry = retry
        self._rng = rng

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
        await self._router.close()
        if self._owns_channel:
            await self._channel.close(None)

    async def wait_ready(self) -> None:
        """Until the channel is connected, e.g. after the server restarted.

        Bound it with asyncio.timeout.
        """
        await self._channel.channel_ready()

    # --- shards -------------------------------------------------------------

    async def shard_map(self) -> ShardMap:
        """The coordinator's shards, in ordinal order (learned now if not yet known)."""
        return await self._router.shard_map()

    async def learn_shard_map(self) -> ShardMap | None:
        """Ask for the map now, unless a coordinator answered it already (or it was
        given): None while none answers (:meth:`shard_map` then stands in one shard
        at this client's address)."""
        return await self._router.learn()

    def owner_of(self, handoff_id: str) -> str:
        """The shard this client would send ``handoff_id``'s calls to (after ``shard_map()``).

        The shard that answered its start when this client started it, else
        the rendezvous winner among the placing shards.
        """
        return self._router.owner(handoff_id) or self._router.known.owner_of(handoff_id)

    def shard_map_stale(self) -> None:
        """A shard did not answer: it may be back on another address, so learn the
        map again soon (at most once a second)."""
        self._router.stale()

    def for_shard(self, name: str) -> HandoffClient:
        """A client for shard ``name`` alone, on this client's channel to it: no routing.

        Close it when done (that leaves the shared channel open). Needs the
        map known (``await client.shard_map()`` first).
        """
        shard = next((s for s in self._router.known.shards if s.name == name), None)
        if shard is None:
            raise KeyError(f"no shard named {name!r} in the map ({self._router.known.names})")
        channel = self._router.channel(name) if self._router.sharded() else self._channel
        # An alternate constructor: the same settings, on the shard's channel,
        # which it does not own, with a router that knows that shard alone.
        bound = HandoffClient.__new__(HandoffClient)
        bound._on(
            channel,
            owns_channel=False,
            metadata=self._metadata,
            timeout_s=self.timeout_s,
            retry=self.retry,
            rng=self._rng,
        )
        bound._router = Router(
            channel,
            shard.address,
            dial=lambda address: channel,
            fetch=bound._fetch_shard_map,
            explicit=ShardMap((ShardInfo(shard.name, shard.address, shard.placing),)),
        )
        return bound

    async def _fetch_shard_map(self) -> ShardMap:
        """GetShardMap from the given address; when it is down, from any shard known."""
        try:
            return await self._ask_shard_map(None)
        except UnavailableError:
            if not self._router.sharded():
                raise
            for name in self._router.known.names:
                try:
                    return await self._ask_shard_map(name)
                except HandoffRpcError:
                    continue
            raise

    async def _ask_shard_map(self, shard: str | None) -> ShardMap:
        request, deadline = pb.GetShardMapRequest(), self._deadline(None)
        response: pb.GetShardMapResponse = await self._call(
            "GetShardMap", request, deadline, retry=NO_RETRY, shard=shard
        )
        return ShardMap(tuple(ShardInfo(s.name, s.address, s.placing) for s in response.shards))

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
        None); ``timeout_s`` is the call's, attempts included. Retried on UNAVAILABLE
        and DEADLINE_EXCEEDED per ``retry``, within ``timeout_s``: when an earlier
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
        deadline = self._deadline(timeout_s)
        async with self._within("StartHandoff", handoff_id, deadline):
            response = await self._start(handoff_id, request, deadline, metadata)
        return HandoffUpdate(
            handoff_from_pb(response.handoff),
            actions_from_pb(response.actions),
            already_started=response.already_started,
        )

    async def report_fact(
        self, handoff_id: str, fact: Fact, *, timeout_s: float | None = None
    ) -> HandoffUpdate:
        request = pb.ReportFactRequest(handoff_id=handoff_id, fact=fact_to_pb(fact))
        response: pb.ReportFactResponse = await self._routed(
            "ReportFact", handoff_id, request, self._deadline(timeout_s)
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
        response: pb.ReportOutcomeResponse = await self._routed(
            "ReportOutcome", handoff_id, request, self._deadline(timeout_s)
        )
        return HandoffUpdate(handoff_from_pb(response.handoff), actions_from_pb(response.actions))

    async def reconcile(
        self,
        engine_id: str,
        *,
        incarnation: str,
        session_id: str,
        held: Sequence[SideId],
        freed: Sequence[SideId],
        timeout_s: float | None = None,
    ) -> Reconciled:
        """Tell the coordinator what ``engine_id`` holds and freed on its own; which to free.

        Sent in as many requests as the message limit needs (all within
        ``timeout_s``), freed sides first; retried on UNAVAILABLE (a
        reconcile is idempotent). See :class:`~handoff_client.sidecar.EngineSidecar`.
        """
        releases: list[Release] = []
        lost_applied = 0
        deadline = self._deadline(timeout_s)
        for chunk in _chunks([(side, True) for side in freed] + [(side, False) for side in held]):
            request = pb.ReconcileRequest(
                engine_id=engine_id, incarnation=incarnation, session_id=session_id
            )
            for (handoff_id, role), was_freed in chunk:
                sides = request.freed if was_freed else request.held
                sides.add(handoff_id=handoff_id, role=_ROLE_TO_PB[role])
            response: pb.ReconcileResponse = await self._call(
                "Reconcile", request, deadline, retry=RETRY_UNAVAILABLE
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
        response: pb.GetHandoffResponse = await self._routed(
            "GetHandoff", handoff_id, request, self._deadline(timeout_s)
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

    # --- routing: which shard each call goes to --------------------------------

    async def _start(
        self,
        handoff_id: str,
        request: pb.StartHandoffRequest,
        deadline: float,
        metadata: tuple[tuple[str, str], ...],
    ) -> pb.StartHandoffResponse:
        """At the rendezvous winner, or where an earlier attempt for the id went."""
        retry = RETRY_UNAVAILABLE_OR_DEADLINE
        shard_map = await self._router.shard_map()
        if len(shard_map.shards) == 1:
            single: pb.StartHandoffResponse = await self._call(
                "StartHandoff", request, deadline, retry=retry, metadata=metadata
            )
            return single
        shard = self._router.owner(handoff_id) or shard_map.owner_of(handoff_id)
        self._router.remember(handoff_id, shard)  # a retry goes where this attempt went
        try:
            response: pb.StartHandoffResponse = await self._call(
                "StartHandoff", request, deadline, retry=retry, metadata=metadata, shard=shard
            )
        except MisroutedError as refused:
            # Our map is behind the shard's: learn it again, and go where it said, once.
            self._router.stale()
            shard_map = await self._router.shard_map()
            if refused.owner not in shard_map.names:
                shard_map = await self._router.refetch()
            if refused.owner not in shard_map.names:
                raise
            shard = refused.owner
            self._router.remember(handoff_id, shard)
            response = await self._call(
                "StartHandoff", request, deadline, retry=retry, metadata=metadata, shard=shard
            )
        self._router.remember(handoff_id, response.shard or shard)
        return response

    async def _routed(
        self, rpc: str, handoff_id: str, request: Request, deadline: float
    ) -> Response:
        """A call about one handoff, at its owner; NOT_FOUND there asks each other shard once."""
        async with self._within(rpc, handoff_id, deadline):
            return await self._routed_within(rpc, handoff_id, request, deadline)

    async def _routed_within(
        self, rpc: str, handoff_id: str, request: Request, deadline: float
    ) -> Response:
        shard_map = await self._router.shard_map()
        if len(shard_map.shards) == 1:
            single: Response = await self._call(rpc, request, deadline, retry=RETRY_UNAVAILABLE)
            return single
        owner = self._router.owner(handoff_id) or shard_map.owner_of(handoff_id)
        try:
            response: Response = await self._call(
                rpc, request, deadline, retry=RETRY_UNAVAILABLE, shard=owner
            )
            return response
        except NotFoundError as not_found:
            missing = not_found
        for shard in shard_map.names:
            if shard == owner:
                continue
            try:
                response = await self._call(
                    rpc, request, deadline, retry=RETRY_UNAVAILABLE, shard=shard
                )
            except NotFoundError:
                continue
            except HandoffRpcError:
                self._router.remember(handoff_id, shard)  # it holds the handoff, and refused
                raise
            self._router.remember(handoff_id, shard)
            return response
        raise missing

    # --- the one path every unary call takes --------------------------------

    def _deadline(self, timeout_s: float | None) -> float:
        """The loop time by which a call given ``timeout_s`` (None: the client's) ends."""
        budget = self.timeout_s if timeout_s is None else timeout_s
        return asyncio.get_running_loop().time() + budget

    @contextlib.asynccontextmanager
    async def _within(self, rpc: str, handoff_id: str, deadline: float) -> AsyncIterator[None]:
        """Ends the call at ``deadline`` wherever it is (learning the shard map, say)."""
        try:
            async with asyncio.timeout_at(deadline):
                yield
        except TimeoutError as error:
            raise DeadlineExceededError(
                f"handoff {handoff_id}: {rpc} did not complete within its deadline "
                "(timeout_s, per call or the client's)"
            ) from error

    async def _call(
        self,
        rpc: str,
        request: Request,
        deadline: float,
        *,
        retry: frozenset[grpc.StatusCode],
        metadata: tuple[tuple[str, str], ...] | None = None,
        shard: str | None = None,
    ) -> Response:
        """``rpc`` on ``shard`` (None: the client's own channel), retried per ``retry``
        until ``deadline`` (loop time), and never after it.

        Each attempt gets what is left of the deadline, and dials the shard's
        address as the map has it then: a shard that was unreachable may be
        back on a new address. ``retry.within_s`` stops retrying sooner.
        """
        loop = asyncio.get_running_loop()
        retry_until = min(loop.time() + self.retry.within_s, deadline)
        per_attempt = self.retry.attempt_timeout_s
        if grpc.StatusCode.DEADLINE_EXCEEDED not in retry:
            per_attempt = None
        failures = 0
        while True:
            method: grpc.aio.UnaryUnaryMultiCallable[Request, Response] = getattr(
                self._router.stub(shard), rpc
            )
            left = max(deadline - loop.time(), 0.0)
            try:
                return await method(
                    request,
                    timeout=left if per_attempt is None else min(left, per_attempt),
                    metadata=self._metadata if metadata is None else metadata,
                )
            except grpc.aio.AioRpcError as error:
                if not retry:
                    raise error_for(error) from error
                failures += 1
                if shard is not None and error.code() is grpc.StatusCode.UNAVAILABLE:
                    self._router.stale()
                delay = self.retry.backoff.delay_s(failures, self._rng)
                if not (
                    error.code() in retry
                    and failures < self.retry.max_attempts
                    and loop.time() + delay < retry_until
                ):
                    raise error_for(error) from error
            await asyncio.sleep(delay)
            if shard is not None:
                await self._router.shard_map()  # refreshed if a failure made it due


_ROLE_TO_PB = {Role.SOURCE: pb.ROLE_SOURCE, Role.DESTINATION: pb.ROLE_DESTINATION}
_RELEASE_REASONS = frozenset(reason.value for reason in ReleaseReason)


def _chunks(sides: list[tuple[SideId, bool]]) -> list[list[tuple[SideId, bool]]]:
    """``sides`` cut into requests of at most about RECONCILE_CHUNK_BYTES; at least one."""
    chunks: list[list[tuple[SideId, bool]]] = [[]]
    size = 0
    for side in sides:
        weight = len(side[0][0]) + 8  # the id, plus a side's framing and role
        if size + weight > RECONCILE_CHUNK_BYTES and chunks[-1]:
            chunks.append([])
            size = 0
        chunks[-1].append(side)
        size += weight
    return chunks
