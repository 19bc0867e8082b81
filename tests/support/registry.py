"""A registry on a fake clock, shared by the registry tests."""

from __future__ import annotations

import uuid
from typing import Any

from handoff_server.domain.delivery import Dispatch, Subscription
from handoff_server.domain.entries import StartRequest
from handoff_server.domain.model import (
    ActionKind,
    Completion,
    DestinationReserved,
    Order,
    Outcome,
    OutcomeKind,
    Phase,
    Release,
    Role,
    SourceHeld,
    TimingMode,
    TransferCompleted,
    TransferTiming,
)
from handoff_server.domain.registry import Registry
from handoff_server.ops.config import Settings
from handoff_server.ops.metrics import Metrics
from tests.support.fakes import FakeClock

SOURCE, DESTINATION = "prefill-a", "decode-b"
TIMING = TransferTiming(TimingMode.FULL_PROMPT, 1000, 1_000_000, 1.0)  # 1000 ms transfer
APPLIED = Outcome(OutcomeKind.APPLIED)
SUBMITTED = Outcome(OutcomeKind.SUBMITTED)


class Harness:
    def __init__(self, **overrides: Any) -> None:
        self.clock = FakeClock()
        self.metrics = Metrics()
        # Engines in these tests rarely subscribe; only the tests about
        # unreachable engines want the delivery timeout to bite.
        overrides.setdefault("delivery_timeout_s", 1000.0)
        self.registry = Registry(Settings(**overrides), self.metrics, self.clock)
        self.inbox: dict[str, list[Dispatch]] = {SOURCE: [], DESTINATION: []}
        self.subscriptions: dict[str, Subscription] = {}

    def subscribe(self, engine_id: str) -> Subscription:
        subscription = self.registry.subscribe(engine_id, lambda: None)
        self.subscriptions[engine_id] = subscription
        return subscription

    def reconcile(
        self, engine_id: str, held: list[tuple[str, Role]], freed: list[tuple[str, Role]]
    ) -> tuple[list[Release], int]:
        """Reconcile as the engine's live stream, subscribing it first if it has none."""
        live = self.subscriptions.get(engine_id)
        if live is None or live.closed:
            live = self.subscribe(engine_id)
        return self.registry.reconcile(
            engine_id, held, freed, incarnation=live.incarnation, session_id=live.session_id
        )

    def drain(self, engine_id: str) -> list[Dispatch]:
        """What the engine's live stream would write now."""
        batch = self.registry.delivery.take(self.subscriptions[engine_id]) or []
        self.inbox[engine_id].extend(batch)
        return batch

    def start(self, handoff_id: str | None = None, **extra: Any) -> str:
        handoff_id = handoff_id or str(uuid.uuid4())
        self.registry.start(
            StartRequest(handoff_id, Order.SOURCE_FIRST, SOURCE, DESTINATION, 5.0, **extra)
        )
        return handoff_id

    def advance(self, seconds: float) -> None:
        self.clock.advance(seconds)
        self.registry.fire_due()

    def phase(self, handoff_id: str) -> Phase:
        return self.registry.get(handoff_id).core.phase

    def value(self, name: str, **labels: str) -> float:
        sample = self.metrics.registry.get_sample_value(name, labels)
        return 0.0 if sample is None else sample

    def succeed(self, handoff_id: str) -> None:
        """Drive a started SOURCE_FIRST handoff to SUCCESS, as the engines would."""
        r = self.registry
        r.report_outcome(handoff_id, 0, Outcome(OutcomeKind.SUBMITTED))
        r.report_fact(handoff_id, SourceHeld(TIMING))
        r.report_outcome(handoff_id, 1, Outcome(OutcomeKind.ACCEPTED))
        r.report_fact(handoff_id, DestinationReserved(1000))
        r.report_outcome(handoff_id, 2, Outcome(OutcomeKind.SCHEDULED))
        r.report_fact(handoff_id, TransferCompleted())
        r.report_outcome(handoff_id, 3, APPLIED)
        r.report_outcome(handoff_id, 4, APPLIED)
        assert r.get(handoff_id).core.completion is Completion.SUCCESS


def kinds(dispatches: list[Dispatch]) -> list[ActionKind]:
    return [d.action.kind for d in dispatches]
