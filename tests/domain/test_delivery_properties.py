"""Delivery under random drops, reconnects, restarts and twins (hypothesis, fake clock).

Two engines act on what their live stream writes, as sidecars would. Whatever
happens to their streams: each stream writes a handoff's actions in issue
order, a replaced or fenced stream gets nothing more, and once both engines
are back and working, every handoff completes with nothing abandoned.
"""

from __future__ import annotations

import itertools

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from handoff_server.domain.delivery import Dispatch, Fenced, Subscription
from handoff_server.domain.entries import Entry, StartRequest
from handoff_server.domain.model import (
    ActionKind,
    Canceled,
    DestinationReserved,
    Fact,
    HandoffError,
    Order,
    Outcome,
    OutcomeKind,
    Phase,
    SourceHeld,
    TransferCompleted,
)
from handoff_server.domain.registry import Registry
from handoff_server.ops.config import Settings
from handoff_server.ops.metrics import Metrics
from tests.support.fakes import FakeClock
from tests.support.registry import TIMING

ENGINES = ("prefill-a", "decode-b")
ANSWER: dict[ActionKind, tuple[OutcomeKind, Fact | None]] = {
    ActionKind.SUBMIT_PREFILL: (OutcomeKind.SUBMITTED, SourceHeld(TIMING)),
    ActionKind.RESERVE_DESTINATION: (OutcomeKind.ACCEPTED, DestinationReserved(1000)),
    ActionKind.START_TRANSFER: (OutcomeKind.SCHEDULED, TransferCompleted()),
    ActionKind.ACTIVATE_DESTINATION: (OutcomeKind.APPLIED, None),
    ActionKind.RELEASE_SOURCE: (OutcomeKind.APPLIED, None),
    ActionKind.CANCEL_SOURCE: (OutcomeKind.APPLIED, None),
    ActionKind.CANCEL_DESTINATION: (OutcomeKind.APPLIED, None),
}


class Engine:
    """One engine id: its current process (incarnation, session) and what it holds."""

    def __init__(self, engine_id: str, incarnation: str) -> None:
        self.engine_id = engine_id
        self.incarnation = incarnation
        self.session = f"{incarnation}-s0"
        self.stream: Subscription | None = None
        self.todo: list[Dispatch] = []  # written to its live stream, not yet acted on
        # Per stream: the highest action id first written, per handoff.
        self.first_written: dict[str, int] = {}
        self.seen: set[tuple[str, int]] = set()


class DeliveryMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.clock = FakeClock()
        self.metrics = Metrics()
        self.registry = Registry(
            Settings(
                delivery_timeout_s=5.0,
                cleanup_redelivery_s=1.0,
                cleanup_timeout_s=1e6,
                default_timeout_s=80_000.0,
                retention_s=1e6,
            ),
            self.metrics,
            self.clock,
        )
        self.counter = itertools.count(1)
        self.engines = {e: Engine(e, self.incarnation()) for e in ENGINES}
        self.fenced: list[Subscription] = []
        self.started: list[str] = []

    def incarnation(self) -> str:
        return f"{next(self.counter):013d}-ab"

    def connect(self, engine: Engine) -> None:
        engine.stream = self.registry.subscribe(
            engine.engine_id, lambda: None, engine.incarnation, engine.session
        )
        engine.first_written = {}
        engine.seen = set()

    # --- the world ------------------------------------------------------------

    @rule(order=st.sampled_from(Order))
    def start(self, order: Order) -> None:
        handoff_id = f"00000000-0000-4000-8000-{len(self.started):012d}"
        self.registry.start(StartRequest(handoff_id, order, ENGINES[0], ENGINES[1], 5.0))
        self.started.append(handoff_id)

    @precondition(lambda self: self.started)
    @rule(data=st.data())
    def cancel(self, data: st.DataObject) -> None:
        handoff_id = data.draw(st.sampled_from(self.started))
        self.registry.report_fact(handoff_id, Canceled())

    @rule(seconds=st.sampled_from([0.5, 1.0, 3.0, 6.0]))
    def advance(self, seconds: float) -> None:
        self.clock.advance(seconds)
        self.registry.fire_due()

    # --- streams ------------------------------------------------------------------

    @rule(engine_id=st.sampled_from(ENGINES))
    def connect_or_reconnect(self, engine_id: str) -> None:
        self.connect(self.engines[engine_id])

    @rule(engine_id=st.sampled_from(ENGINES))
    def drop(self, engine_id: str) -> None:
        engine = self.engines[engine_id]
        if engine.stream is not None:
            self.registry.delivery.unsubscribe(engine.stream)
            engine.stream = None

    @rule(engine_id=st.sampled_from(ENGINES))
    def restart(self, engine_id: str) -> None:
        """The process dies and a new one starts: memory and stream gone."""
        engine = self.engines[engine_id]
        if engine.stream is not None:
            self.fenced.append(engine.stream)
        engine.incarnation = self.incarnation()
        engine.session = f"{engine.incarnation}-s0"
        engine.todo = []
        self.connect(engine)

    @rule(engine_id=st.sampled_from(ENGINES))
    def twin(self, engine_id: str) -> None:
        """A second sidecar under the same incarnation: refused while the first is live."""
        engine = self.engines[engine_id]
        other = f"{engine.incarnation}-s{next(self.counter)}"
        live = engine.stream is not None and not engine.stream.closed
        try:
            stream = self.registry.subscribe(engine_id, lambda: None, engine.incarnation, other)
        except Fenced:
            assert live
            return
        assert not live
        engine.session, engine.stream = other, stream
        engine.first_written, engine.seen = {}, set()

    @rule(engine_id=st.sampled_from(ENGINES))
    def older(self, engine_id: str) -> None:
        stream = self.engines[engine_id].stream
        if stream is None or stream.closed:
            return  # refused only while a newer one is live (or remembered)
        try:
            self.registry.subscribe(engine_id, lambda: None, "0000000000000-00", "stale")
        except Fenced:
            return
        raise AssertionError("an older incarnation got a stream")

    @rule(engine_id=st.sampled_from(ENGINES))
    def take(self, engine_id: str) -> None:
        engine = self.engines[engine_id]
        if engine.stream is None:
            return
        batch = self.registry.delivery.take(engine.stream)
        if batch is None:
            engine.stream = None  # replaced
            return
        for dispatch in batch:
            assert dispatch.engine_id == engine_id
            key = (dispatch.handoff_id, dispatch.action.id)
            if key not in engine.seen:
                engine.seen.add(key)
                last = engine.first_written.get(dispatch.handoff_id, -1)
                assert dispatch.action.id > last, f"{key} written after a later action"
                engine.first_written[dispatch.handoff_id] = dispatch.action.id
            if dispatch.action.kind is not ActionKind.COMPLETE:
                engine.todo.append(dispatch)

    @rule(engine_id=st.sampled_from(ENGINES), data=st.data())
    def act(self, engine_id: str, data: st.DataObject) -> None:
        engine = self.engines[engine_id]
        if engine.todo:
            index = data.draw(st.integers(0, len(engine.todo) - 1))
            self.execute(engine.todo.pop(index))

    def execute(self, dispatch: Dispatch) -> None:
        outcome, fact = ANSWER[dispatch.action.kind]
        try:
            self.registry.report_outcome(dispatch.handoff_id, dispatch.action.id, Outcome(outcome))
            if fact is not None:
                self.registry.report_fact(dispatch.handoff_id, fact)
        except HandoffError:
            pass  # a late report the handoff no longer takes

    @invariant()
    def fenced_streams_get_nothing(self) -> None:
        for stream in self.fenced:
            assert self.registry.delivery.take(stream) is None

    def teardown(self) -> None:
        """Both engines back and working: every handoff completes."""
        for engine in self.engines.values():
            if engine.stream is None or engine.stream.closed:
                self.connect(engine)
        for _ in range(200):
            unfinished = [
                h for h in self.started if isinstance(self.registry.handoffs.get(h), Entry)
            ]
            if not unfinished:
                break
            for engine_id in ENGINES:
                self.take(engine_id)
                engine = self.engines[engine_id]
                while engine.todo:
                    self.execute(engine.todo.pop(0))
            self.advance(1.0)
        for handoff_id in self.started:
            assert self.registry.get(handoff_id).core.phase is Phase.COMPLETE, handoff_id
        assert self.metrics.registry.get_sample_value("handoff_abandoned_total") == 0


TestDelivery = DeliveryMachine.TestCase
TestDelivery.settings = settings(
    max_examples=150,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
