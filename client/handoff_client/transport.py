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

from collections.abc import AsyncGenerator, Callable
from typing import Literal, Protocol, runtime_checkable

from handoff_client.client import HandoffClient, Side
from handoff_client.connect import ConnectTransport
from handoff_client.liveness import Liveness
from handoff_client.model import Action, Fact, Outcome, Reconciled

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
        held: list[Side],
        freed: list[Side],
    ) -> Reconciled: ...


class UnaryTransport:
    """StreamActions for actions, one unary call per report."""

    def __init__(self, client: HandoffClient) -> None:
        self._client = client
        self.liveness = Liveness()

    def subscribe(
        self,
        engine_id: str,
        on_subscribed: Callable[[], None],
        *,
        incarnation: str,
        session_id: str,
    ) -> AsyncGenerator[Action, None]:
        return self._client.stream_actions(
            engine_id,
            on_subscribed,
            incarnation=incarnation,
            session_id=session_id,
            liveness=self.liveness,
        )

    async def reconcile(
        self,
        engine_id: str,
        *,
        incarnation: str,
        session_id: str,
        held: list[Side],
        freed: list[Side],
    ) -> Reconciled:
        return await self._client.reconcile(
            engine_id, incarnation=incarnation, session_id=session_id, held=held, freed=freed
        )

    async def report_fact(self, handoff_id: str, fact: Fact) -> None:
        await self._client.report_fact(handoff_id, fact)

    async def report_outcome(self, handoff_id: str, action_id: int, outcome: Outcome) -> None:
        await self._client.report_outcome(handoff_id, action_id, outcome)


def make_transport(client: HandoffClient, kind: TransportKind) -> SidecarTransport:
    """A new transport of ``kind`` over ``client``; one per sidecar."""
    if kind == "connect":
        return ConnectTransport(client)
    if kind == "unary":
        return UnaryTransport(client)
    raise ValueError(f"unknown transport {kind!r}: choose one of {', '.join(TRANSPORT_KINDS)}")
