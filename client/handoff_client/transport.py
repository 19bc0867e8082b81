"""How an engine sidecar talks to the coordinator: the seam between the two.

The sidecar needs three things: a subscription to its actions, and a way to
report facts and outcomes. Two transports implement them:

- :class:`~handoff_client.connect.ConnectTransport` (the default): all of
  it on one bidirectional Connect stream per engine;
- :class:`UnaryTransport`: StreamActions plus one unary ReportFact or
  ReportOutcome call per report.

A transport raises :class:`~handoff_client.errors.HandoffRpcError` subclasses;
the sidecar retries UNAVAILABLE and DEADLINE_EXCEEDED reports (every report is
idempotent on the server) and treats any other error as final.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncGenerator, Callable
from typing import Literal, Protocol, runtime_checkable

from handoff_client.client import HandoffClient, SideId
from handoff_client.connect import ConnectTransport
from handoff_client.errors import HandoffRpcError
from handoff_client.liveness import Liveness
from handoff_client.model import Action, Fact, Outcome, Reconciled
from handoff_client.onshard import OnShard, ReconcilesOnShard
from handoff_client.outbox import Report, Sent, landing

# What EngineSidecar(transport=...), `handoff sim` and `handoff demo` accept.
TransportKind = Literal["connect", "unary"]
TRANSPORT_KINDS: tuple[TransportKind, ...] = ("connect", "unary")


class SidecarTransport(Protocol):
    def subscribe(
        self,
        engine_id: str,
        on_subscribed: Callable[[], None],
        *,
        incarnation: str,
        session_id: str,
    ) -> AsyncGenerator[Action, None]:
        """Actions for ``engine_id`` until the subscription ends; closing it unsubscribes.

        ``on_subscribed`` is called once the server has registered the
        subscription. ``incarnation`` and ``session_id`` go to the server with
        it, which fences older incarnations and twin sessions.
        """
        ...

    async def report_fact(self, handoff_id: str, fact: Fact) -> None: ...

    async def report_outcome(self, handoff_id: str, action_id: int, outcome: Outcome) -> None: ...


@runtime_checkable
class OrderedTransport(SidecarTransport, Protocol):
    """A transport whose wire keeps reports in order (Connect: one stream,
    handled in order), so a handoff's report can go out behind an earlier
    one not answered yet: an outcome and the fact after it share a message.

    ``send_*`` returns once the report is on the wire, with what ends when it
    lands; given ``after`` (the handoff's previous report, unanswered), it is
    put behind it on the same wire, or raises UnavailableError if that wire
    is gone (it must then wait for ``after``'s retry).
    """

    async def send_fact(self, handoff_id: str, fact: Fact, after: Sent | None) -> Sent: ...

    async def send_outcome(
        self, handoff_id: str, action_id: int, outcome: Outcome, after: Sent | None
    ) -> Sent: ...


class Reports:
    """The outbox's reports over one link's transport: pipelined where it keeps order."""

    def __init__(self, transport: SidecarTransport) -> None:
        self._transport = transport
        self._ordered = transport if isinstance(transport, OrderedTransport) else None

    def fact(self, handoff_id: str, fact: Fact) -> Report:
        ordered = self._ordered
        if ordered is not None:
            return lambda after: ordered.send_fact(handoff_id, fact, after)
        transport = self._transport
        return landing(lambda: transport.report_fact(handoff_id, fact))

    def outcome(self, handoff_id: str, action_id: int, outcome: Outcome) -> Report:
        ordered = self._ordered
        if ordered is not None:
            return lambda after: ordered.send_outcome(handoff_id, action_id, outcome, after)
        transport = self._transport
        return landing(lambda: transport.report_outcome(handoff_id, action_id, outcome))


@runtime_checkable
class LeasedTransport(SidecarTransport, Protocol):
    """A transport that also reconciles, and stamps every message it reads on
    ``liveness``: what a sidecar's lease and reconcile need (both built-in
    transports). Over any other transport the sidecar runs neither."""

    liveness: Liveness

    async def reconcile(
        self,
        engine_id: str,
        *,
        incarnation: str,
        session_id: str,
        held: list[SideId],
        freed: list[SideId],
    ) -> Reconciled: ...


class UnaryTransport(ReconcilesOnShard):
    """StreamActions for actions, one unary call per report; all at ``shard`` if given."""

    def __init__(self, client: HandoffClient, shard: str | None = None) -> None:
        self._shard = OnShard(client, shard)
        self.liveness = Liveness()

    def subscribe(
        self,
        engine_id: str,
        on_subscribed: Callable[[], None],
        *,
        incarnation: str,
        session_id: str,
    ) -> AsyncGenerator[Action, None]:
        return self._subscribe(engine_id, on_subscribed, incarnation, session_id)

    async def _subscribe(
        self,
        engine_id: str,
        on_subscribed: Callable[[], None],
        incarnation: str,
        session_id: str,
    ) -> AsyncGenerator[Action, None]:
        client = await self._shard.client()
        actions = client.stream_actions(
            engine_id,
            on_subscribed,
            incarnation=incarnation,
            session_id=session_id,
            liveness=self.liveness,
        )
        async with contextlib.aclosing(actions):
            try:
                async for action in actions:
                    yield action
            except HandoffRpcError:
                self._shard.unreachable()
                raise

    async def report_fact(self, handoff_id: str, fact: Fact) -> None:
        client = await self._shard.client()
        await client.report_fact(handoff_id, fact)

    async def report_outcome(self, handoff_id: str, action_id: int, outcome: Outcome) -> None:
        client = await self._shard.client()
        await client.report_outcome(handoff_id, action_id, outcome)


def make_transport(
    client: HandoffClient, kind: TransportKind, shard: str | None = None
) -> SidecarTransport:
    """A new transport of ``kind`` over ``client`` (at ``shard`` alone, if given); one per link."""
    if kind == "connect":
        return ConnectTransport(client, shard)
    if kind == "unary":
        return UnaryTransport(client, shard)
    raise ValueError(f"unknown transport {kind!r}: choose one of {', '.join(TRANSPORT_KINDS)}")
