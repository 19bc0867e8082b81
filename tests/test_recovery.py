"""Recovery: a registry rebuilt from its journal equals the one that wrote it.

Random call sequences run on a registry with a fake clock that journals to a
real SQLite file; at a random point it "crashes" (the registry is dropped,
the file kept) and a new registry recovers from the file. Every handoff must
then be exactly as it was: its answer (GetHandoff's view), its core, its
deadline, its outstanding actions, each waiting to be redelivered to its
engine. Then both go on with the same calls and must stay equal.
"""

from __future__ import annotations

import json
import sqlite3
import tempfile
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from handoff_server import convert
from handoff_server.config import Settings
from handoff_server.delivery import Role, Subscription
from handoff_server.entries import Entry, Retained, StartRequest
from handoff_server.journal import DATABASE, Journal
from handoff_server.metrics import Metrics
from handoff_server.model import (
    ActionKind,
    Canceled,
    Completion,
    DestinationReserved,
    EngineLost,
    Fact,
    Failed,
    HandoffError,
    LifecycleEvent,
    Order,
    Outcome,
    OutcomeKind,
    Phase,
    Side,
    SourceHeld,
    TimingMode,
    TransferCompleted,
    TransferTiming,
)
from handoff_server.recovery import RETAINED, JournalRecorder, ReplayClock, recover
from handoff_server.registry import Registry

COMPLETE = ActionKind.COMPLETE
INCARNATIONS = ["", "a", "b"]
IDS = [f"h{i}" for i in range(8)]
ENGINES = ["prefill-a", "prefill-b", "decode-a", "decode-b"]
SETTINGS = Settings(
    default_timeout_s=20.0,
    delivery_timeout_s=15.0,
    cleanup_timeout_s=25.0,
    cleanup_redelivery_s=1.0,
    retention_s=30.0,
    max_retained=4,
)
TIMINGS = [
    TransferTiming(TimingMode.FULL_PROMPT, 1000, 1_000_000, 1.0),
    TransferTiming(TimingMode.DESTINATION_MISSING, 500, 2048, 10.0, 64),
    TransferTiming(TimingMode.FULL_PROMPT, 10),
]
FACTS: list[Fact] = [
    *(SourceHeld(t) for t in TIMINGS),
    DestinationReserved(700),
    DestinationReserved(0),
    TransferCompleted(),
    Failed(),
    Canceled(),
    EngineLost(Side.SOURCE),
    EngineLost(Side.DESTINATION),
]
OUTCOMES = [Outcome(kind) for kind in OutcomeKind if kind is not OutcomeKind.FAILED] + [
    Outcome(OutcomeKind.FAILED, "engine said no")
]


class FakeClock:
    def __init__(self) -> None:
        self.now = 1_800_000_000.0

    def __call__(self) -> float:
        return self.now


class World:
    """A registry journaling to ``state_dir``, and the engines' streams on it."""

    def __init__(self, state_dir: Path, clock: FakeClock) -> None:
        self.clock = clock
        self.journal = Journal.open(state_dir)
        self.replay_clock = ReplayClock(clock)
        self.registry = Registry(SETTINGS, Metrics(), self.replay_clock)
        self.recovery = recover(self.journal, self.registry, self.replay_clock)
        self.registry.recorder = JournalRecorder(self.journal)
        self.streams: dict[str, Subscription] = {}

    def step(self, data: st.DataObject) -> None:
        r = self.registry
        op = data.draw(st.sampled_from(["start", "fact", "outcome", "stream", "time", "take"]))
        try:
            if op == "start":
                source, destination = (
                    data.draw(st.sampled_from(ENGINES)),
                    data.draw(st.sampled_from(ENGINES)),
                )
                r.start(
                    StartRequest(
                        data.draw(st.sampled_from(IDS)),
                        data.draw(st.sampled_from(list(Order))),
                        source,
                        destination,
                        data.draw(st.sampled_from([0.0, 5.0, 250.0])),
                        data.draw(st.sampled_from([Role.SOURCE, Role.DESTINATION])),
                        data.draw(st.sampled_from([None, 3.0, 60.0])),
                        data.draw(st.sampled_from([(), (("traceparent", "00-ab-cd-01"),)])),
                    )
                )
            elif op == "fact":
                r.report_fact(data.draw(st.sampled_from(IDS)), data.draw(st.sampled_from(FACTS)))
            elif op == "outcome":
                handoff_id = data.draw(st.sampled_from(IDS))
                entry = r.handoffs.get(handoff_id)
                outstanding = (
                    [a.id for a in entry.core.outstanding] if isinstance(entry, Entry) else []
                )
                action_id = data.draw(st.sampled_from([*outstanding, 0, 7]))
                r.report_outcome(handoff_id, action_id, data.draw(st.sampled_from(OUTCOMES)))
            elif op == "stream":
                engine = data.draw(st.sampled_from(ENGINES))
                if engine in self.streams:
                    r.delivery.unsubscribe(self.streams.pop(engine))
                else:
                    # A later incarnation is a restart: the old one is lost.
                    incarnation = data.draw(st.sampled_from(INCARNATIONS))
                    self.streams[engine] = r.subscribe(engine, lambda: None, incarnation)
                    if incarnation:
                        self.journal.engine(engine, incarnation)
            elif op == "take":
                for stream in self.streams.values():
                    r.delivery.take(stream)
            else:
                self.clock.now += data.draw(st.sampled_from([0.5, 2.0, 9.0, 16.0, 40.0]))
                r.fire_due()
        except HandoffError:
            pass  # refused calls change nothing and are not journaled


def state(registry: Registry) -> dict[str, Any]:
    """Everything a handoff is, as comparable values."""
    out: dict[str, Any] = {}
    for handoff_id, entry in registry.handoffs.items():
        core = entry.core if isinstance(entry, Entry) else entry.unpack().core
        out[handoff_id] = (
            convert.handoff(entry).SerializeToString(deterministic=True),
            core.snapshot(),
            entry.deadline,
            tuple(sorted(entry.routed.items())) if isinstance(entry, Entry) else (),
        )
    return out


@settings(
    max_examples=150,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(st.data())
def test_a_recovered_registry_equals_the_one_that_crashed(data: st.DataObject) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        state_dir = Path(tmp)
        clock = FakeClock()
        first = World(state_dir, clock)
        for _ in range(data.draw(st.integers(1, 60))):
            first.step(data)
            if data.draw(st.booleans()):
                first.journal.commit_now()  # a commit in between, as the writer does
        first.journal.commit_now()
        # A retained handoff's history is one snapshot record (late calls that
        # changed nothing are journaled after it, and replay through it).
        with sqlite3.connect(state_dir / DATABASE) as db:
            kept = db.execute("SELECT handoff_id, body FROM records ORDER BY seq").fetchall()
        for handoff_id, entry in first.registry.handoffs.items():
            if isinstance(entry, Retained):
                kinds = [json.loads(body)[0] for h, body in kept if h == handoff_id]
                assert kinds[0] == RETAINED
                assert "start" not in kinds
        incarnation = first.journal.incarnation
        first.journal.close_now()  # the crash: nothing but the file survives
        first.registry.recorder = None  # it goes on in memory, as if it had not crashed

        later = FakeClock()
        later.now = clock.now
        second = World(state_dir, later)
        assert second.journal.incarnation > incarnation
        assert state(second.registry) == state(first.registry)
        assert second.recovery.skipped == 0
        assert second.recovery.total == len(first.registry.handoffs)
        assert second.registry.active_count == first.registry.active_count
        # Recovery gives engines time to come back before a cleanup is
        # abandoned; the reference, restarting at that instant, does too.
        first.registry.defer_abandonment(
            later.now + SETTINGS.delivery_timeout_s + SETTINGS.cleanup_redelivery_s
        )

        # Every outstanding action counts as written: an engine that comes
        # back to the recovered server is sent exactly what it would be sent
        # on coming back to the one that did not crash.
        last = second.recovery.engine_incarnations
        for engine in ENGINES:
            sent = {}
            for world in (first, second):
                if engine in world.streams:
                    world.registry.delivery.unsubscribe(world.streams.pop(engine))
                stream = world.registry.subscribe(engine, lambda: None, last.get(engine, ""))
                world.streams[engine] = stream
                taken = world.registry.delivery.take(stream, 10_000) or []
                sent[world] = {
                    (d.handoff_id, d.action.id) for d in taken if d.action.kind is not COMPLETE
                }
            assert sent[second] == sent[first]

        # From here both go on alike, engines connected to both.
        for _ in range(data.draw(st.integers(0, 30))):
            step = data.draw(
                st.sampled_from(["fact", "outcome", "time"]).flatmap(
                    lambda op: st.tuples(
                        st.just(op),
                        st.sampled_from(IDS),
                        st.sampled_from(FACTS),
                        st.sampled_from(OUTCOMES),
                        st.integers(0, 8),
                        st.sampled_from([0.5, 2.0, 9.0, 40.0]),
                    )
                )
            )
            for world in (first, second):
                apply(world, *step)
            second.journal.commit_now()
            assert state(second.registry) == state(first.registry)
        second.journal.close_now()


def apply(
    world: World,
    op: str,
    handoff_id: str,
    fact: Any,
    outcome: Outcome,
    action_id: int,
    seconds: float,
) -> None:
    registry = world.registry
    try:
        if op == "fact":
            registry.report_fact(handoff_id, fact)
        elif op == "outcome":
            registry.report_outcome(handoff_id, action_id, outcome)
        else:
            world.clock.now += seconds
            registry.fire_due()
    except HandoffError:
        pass


def test_an_empty_state_dir_recovers_nothing(tmp_path: Path) -> None:
    world = World(tmp_path, FakeClock())
    assert world.recovery.total == 0
    assert world.recovery.handoffs[Phase.ACTIVE] == 0
    world.journal.close_now()


def test_an_engine_that_does_not_come_back_is_lost_a_delivery_timeout_after_recovery(
    tmp_path: Path,
) -> None:
    clock = FakeClock()
    first = World(tmp_path, clock)
    for engine in ("prefill-a", "decode-a"):
        first.streams[engine] = first.registry.subscribe(engine, lambda: None)
    start = StartRequest(IDS[0], Order.SOURCE_FIRST, "prefill-a", "decode-a", 1.0, timeout_s=3600)
    first.registry.start(start)
    first.journal.commit_now()
    first.journal.close_now()

    # Down for far longer than the delivery timeout: counted from recovery,
    # not from the last record, so the engines get their full time back.
    later = FakeClock()
    later.now = clock.now + 10 * SETTINGS.delivery_timeout_s
    second = World(tmp_path, later)
    later.now += SETTINGS.delivery_timeout_s - 0.5
    second.registry.fire_due()
    assert second.registry.get(IDS[0]).core.phase is Phase.ACTIVE
    later.now += 1.0
    second.registry.fire_due()
    assert second.registry.get(IDS[0]).core.phase is not Phase.ACTIVE
    second.journal.close_now()


@pytest.mark.parametrize(("incarnation", "lost"), [("a1", False), ("a2", True)])
def test_after_recovery_a_restarted_engine_is_told_from_one_that_reconnects(
    tmp_path: Path, incarnation: str, lost: bool
) -> None:
    """The journal keeps each engine's last incarnation: coming back under it
    is a reconnect (its actions are sent again); under a newer one, the engine
    restarted while the coordinator was down, and its handoffs lose it."""
    clock = FakeClock()
    first = World(tmp_path, clock)
    first.registry.subscribe("prefill-a", lambda: None, "a1")
    first.journal.engine("prefill-a", "a1")
    start = StartRequest(IDS[0], Order.SOURCE_FIRST, "prefill-a", "decode-a", 1.0, timeout_s=3600)
    first.registry.start(start)
    first.journal.commit_now()
    first.journal.close_now()

    second = World(tmp_path, clock)
    stream = second.registry.subscribe("prefill-a", lambda: None, incarnation)
    sent = second.registry.delivery.take(stream) or []
    entry = second.registry.get(IDS[0])
    if lost:
        assert entry.core.phase is not Phase.ACTIVE
        assert LifecycleEvent.SOURCE_LOST in entry.core.lifecycle
        # Nothing to do for the engine that restarted: only the notice that it ended.
        assert [d.action.kind for d in sent] == [ActionKind.COMPLETE]
    else:
        assert entry.core.phase is Phase.ACTIVE
        assert [(d.action.kind, d.attempt) for d in sent] == [(ActionKind.SUBMIT_PREFILL, 2)]
    second.journal.close_now()


def test_a_side_settled_unsent_is_not_sent_after_recovery(tmp_path: Path) -> None:
    """The server settles a cleanup for a side whose engine never got anything
    (no stream when its action was issued). A replay counts every action as
    written, so the journal says which side was settled unsent: after
    recovery that engine is not sent the ReserveDestination it never had,
    for a handoff nobody will cancel it in again."""
    clock = FakeClock()
    first = World(tmp_path, clock)
    r = first.registry
    r.start(StartRequest("h", Order.SOURCE_FIRST, "prefill-a", "decode-a", 0.0))
    r.report_outcome("h", 0, Outcome(OutcomeKind.SUBMITTED))
    r.report_fact("h", SourceHeld(TIMINGS[0]))  # ReserveDestination#1 waits for decode-a
    r.report_fact("h", Canceled())  # CancelDestination settled: decode-a never had anything
    first.journal.commit_now()
    first.journal.close_now()
    first.registry.recorder = None
    second = World(tmp_path, clock)
    assert state(second.registry) == state(first.registry)
    for world in (first, second):
        stream = world.registry.subscribe("decode-a", lambda: None)
        assert world.registry.delivery.take(stream, 100) == []


@pytest.mark.parametrize("comes_back", [True, False])
def test_a_cleanup_timeout_that_ran_out_while_down_does_not_abandon_at_recovery(
    tmp_path: Path, comes_back: bool
) -> None:
    """Down for longer than the cleanup timeout: the handoff is not abandoned
    the moment the server recovers. Its engine comes back and acknowledges
    the cleanup, or is lost a delivery timeout later, which settles it;
    either way the handoff completes CANCELED, never abandoned."""
    clock = FakeClock()
    first = World(tmp_path, clock)
    stream = first.registry.subscribe("prefill-a", lambda: None)
    first.registry.start(StartRequest("h", Order.SOURCE_FIRST, "prefill-a", "decode-a", 0.0))
    assert [d.action.kind for d in first.registry.delivery.take(stream) or []] == [
        ActionKind.SUBMIT_PREFILL
    ]
    first.registry.report_fact("h", Canceled())  # CancelSource#1 owed by prefill-a
    assert first.registry.get("h").core.phase is Phase.CLEANING_UP
    first.journal.commit_now()
    first.journal.close_now()

    later = FakeClock()
    later.now = clock.now + SETTINGS.cleanup_timeout_s + 5.0
    second = World(tmp_path, later)
    r = second.registry
    r.fire_due()
    entry = r.get("h")
    assert isinstance(entry, Entry)
    assert entry.abandoned_at is None
    if comes_back:
        later.now += SETTINGS.delivery_timeout_s - 1.0
        r.fire_due()
        stream = r.subscribe("prefill-a", lambda: None)
        sent = [d.action for d in r.delivery.take(stream) or []]
        assert [a.kind for a in sent] == [ActionKind.SUBMIT_PREFILL, ActionKind.CANCEL_SOURCE]
        r.report_outcome("h", sent[0].id, Outcome(OutcomeKind.SUBMITTED))
        r.report_outcome("h", sent[1].id, Outcome(OutcomeKind.APPLIED))
    else:
        later.now += SETTINGS.delivery_timeout_s + 0.5
        r.fire_due()
        assert LifecycleEvent.SOURCE_LOST in r.get("h").core.lifecycle
    done = r.get("h")
    assert isinstance(done, Retained)  # complete; an abandoned one stays an Entry
    assert done.core.completion is Completion.CANCELED
    second.journal.close_now()
