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
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from handoff_server.domain.delivery import Subscription
from handoff_server.domain.entries import Entry, StartRequest
from handoff_server.domain.model import (
    ALLOWED_OUTCOMES,
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
    Role,
    SourceHeld,
    TimingMode,
    TransferCompleted,
    TransferTiming,
)
from handoff_server.domain.registry import NOT_RECORDING, Registry
from handoff_server.domain.retained import Retained
from handoff_server.durability.journal import DATABASE, Journal
from handoff_server.durability.records import RETAINED, JournalRecorder
from handoff_server.durability.recovery import ReplayClock, recover
from handoff_server.ops.config import Settings
from handoff_server.ops.metrics import Metrics
from handoff_server.service import convert
from tests.support.fakes import FakeClock

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
    EngineLost(Role.SOURCE),
    EngineLost(Role.DESTINATION),
]
NATURAL_FACTS: list[Fact] = [
    SourceHeld(TIMINGS[0]),
    DestinationReserved(700),
    TransferCompleted(),
    Canceled(),
]
OUTCOMES = [Outcome(kind) for kind in OutcomeKind if kind is not OutcomeKind.FAILED] + [
    Outcome(OutcomeKind.FAILED, "engine said no")
]


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

    def step(self, data: st.DataObject, natural: bool = False) -> None:
        """One random call, or (``natural``) mostly what an engine would do next."""
        r = self.registry
        ops = ["start", "fact", "outcome", "natural", "stream", "time", "take"]
        if natural:
            ops = ["start", *["natural"] * 6, "stream", "take", "time"]
        op = data.draw(st.sampled_from(ops))
        try:
            if op == "start":
                source, destination = (
                    data.draw(st.sampled_from(ENGINES)),
                    data.draw(st.sampled_from(ENGINES)),
                )
                r.start(
                    StartRequest(
                        data.draw(st.sampled_from(IDS[:4] if natural else IDS)),
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
            elif op == "natural":
                # What an engine would report next, so handoffs get far along.
                handoff_id = data.draw(st.sampled_from(IDS[:3]))
                entry = r.handoffs.get(handoff_id)
                owed = list(entry.core.outstanding) if isinstance(entry, Entry) else []
                answering = data.draw(st.booleans())
                if owed and answering:
                    action = data.draw(st.sampled_from(owed))
                    allowed = sorted(ALLOWED_OUTCOMES[action.kind], key=lambda k: k.value)
                    kind = data.draw(st.sampled_from(allowed)) if allowed else OutcomeKind.NOOP
                    r.report_outcome(handoff_id, action.id, Outcome(kind))
                else:
                    r.report_fact(handoff_id, data.draw(st.sampled_from(NATURAL_FACTS)))
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
                steps = [0.5, 2.0, 9.0] if natural else [0.5, 2.0, 9.0, 16.0, 40.0]
                self.clock.now += data.draw(st.sampled_from(steps))
                r.fire_due()
        except HandoffError:
            pass  # refused calls change nothing and are not journaled


def state(registry: Registry) -> dict[str, Any]:
    """Everything a handoff is, as comparable values (why it ended included)."""
    out: dict[str, Any] = {}
    for handoff_id, entry in registry.handoffs.items():
        core = entry.core if isinstance(entry, Entry) else entry.unpack().core
        out[handoff_id] = (
            convert.handoff(entry).SerializeToString(deterministic=True),
            core.snapshot(),
            entry.deadline,
            tuple(sorted(entry.routed.items())) if isinstance(entry, Entry) else (),
            entry.reasons,
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
        first.registry.recorder = NOT_RECORDING  # it goes on in memory, as if it had not crashed

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
    first.registry.recorder = NOT_RECORDING
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


def internals(registry: Registry) -> dict[str, Any]:
    """Everything recovery builds, down to the delivery channels and live timers.

    White-box on purpose: it compares the two ways of recovering (rebuilt
    through the core, replayed through the registry), whose whole point is
    to leave the same private state behind.
    """
    delivery = registry.delivery
    channels = {}
    for engine_id, channel in delivery._channels.items():
        by_issue = sorted(channel.unacked.values(), key=lambda d: d.sequence)
        channels[engine_id] = (
            [(d.handoff_id, d.action, d.target, d.engine_id, d.attempt) for d in by_issue],
            list(channel.queue),
            sorted(channel.handoffs),
            {h: sorted(role.value for role in roles) for h, roles in channel.reached.items()},
            channel.incarnation,
            channel.subscription is None,
            channel.offline_since,
        )
    timers = {
        (
            t.when,
            t.kind.value,
            t.key,
            t.token if t.kind.value == "deadline" else None,
            t.token[1] if t.kind.value == "redeliver" else None,  # type: ignore[index]
        )
        for t in registry._timers._heap
        if registry._timer_is_live(t)
    }
    entries = {}
    for handoff_id, entry in registry.handoffs.items():
        if isinstance(entry, Entry):
            entries[handoff_id] = (
                entry.source_engine_id,
                entry.destination_engine_id,
                entry.transfer_executor,
                entry.timeout_s,
                entry.started_at,
                entry.deadline,
                entry.completed_at,
                entry.abandoned_at,
                list(entry.lifecycle_at),
                sorted(entry.routed.items()),
                entry.held_at,
                entry.redelivery_round,
                entry.cleanup_epoch > 0,
                entry.trace_context,
            )
    retained = registry.retention.ids()
    return {
        "state": state(registry),
        "entries": entries,
        "channels": channels,
        "timers": timers,
        "retained": retained,
        "active": registry.active_count,
    }


@settings(
    max_examples=120,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(st.data())
def test_rebuilding_through_the_core_recovers_what_replaying_every_call_does(
    data: st.DataObject,
) -> None:
    """The fast path (rebuild.py) against the registry's own call path, on
    one journal: the same handoffs, delivery channels, timers and retention."""
    with tempfile.TemporaryDirectory() as tmp:
        state_dir = Path(tmp)
        clock = FakeClock()
        first = World(state_dir, clock)
        natural = data.draw(st.booleans())
        for _ in range(data.draw(st.integers(1, 80))):
            first.step(data, natural)
            if data.draw(st.booleans()):
                first.journal.commit_now()
        first.journal.commit_now()
        first.journal.close_now()
        recovered = {}
        for rebuilding in (False, True):
            journal = Journal.open(state_dir)
            later = FakeClock()
            later.now = clock.now + 5.0
            replay_clock = ReplayClock(later)
            registry = Registry(SETTINGS, Metrics(), replay_clock)
            recovery = recover(journal, registry, replay_clock, rebuilding)
            journal.close_now()
            recovered[rebuilding] = (internals(registry), recovery.skipped, recovery.total)
            if rebuilding:
                event(f"rebuilt {min(recovery.rebuilt, 3)}+")
        assert recovered[True] == recovered[False]


def test_rebuilding_recovers_every_kind_of_unfinished_handoff(tmp_path: Path) -> None:
    """One journal with an unfinished handoff at each point the rebuild must
    follow (a moved deadline, a decode activated, a source canceled, a lost decode,
    a side settled unsent, an abandonment it gives back, both orders, either
    executor): both ways of recovering leave the same state behind."""
    clock = FakeClock()
    world = World(tmp_path, clock)
    r = world.registry
    streams = [r.subscribe(engine, lambda: None) for engine in ("prefill-a", "decode-a")]

    def take() -> None:
        for stream in streams:
            r.delivery.take(stream)

    def start(handoff_id: str, order: Order = Order.SOURCE_FIRST, **options: Any) -> None:
        decode = options.pop("decode", "decode-a")
        delay = options.pop("fallback_transfer_delay_ms", 0.0)
        r.start(
            StartRequest(handoff_id, order, "prefill-a", decode, delay, timeout_s=3600, **options)
        )
        take()

    def ack(handoff_id: str, kind: ActionKind, outcome: OutcomeKind) -> None:
        entry = r.get(handoff_id)
        assert isinstance(entry, Entry)
        (action,) = [a for a in entry.core.outstanding if a.kind is kind]
        r.report_outcome(handoff_id, action.id, Outcome(outcome))
        take()

    def fact(handoff_id: str, fact: Fact) -> None:
        r.report_fact(handoff_id, fact)
        take()

    def held(handoff_id: str, **options: Any) -> None:
        start(handoff_id, **options)
        ack(handoff_id, ActionKind.SUBMIT_PREFILL, OutcomeKind.SUBMITTED)
        fact(handoff_id, SourceHeld(TIMINGS[0]))

    def scheduled(handoff_id: str, **options: Any) -> None:
        held(handoff_id, **options)
        ack(handoff_id, ActionKind.RESERVE_DESTINATION, OutcomeKind.ACCEPTED)
        fact(handoff_id, DestinationReserved(700))
        ack(handoff_id, ActionKind.START_TRANSFER, OutcomeKind.SCHEDULED)

    start("abandoned")
    fact("abandoned", Canceled())
    clock.now += SETTINGS.cleanup_timeout_s + 1.0
    r.fire_due()
    start("started")
    start("destination-first", Order.DESTINATION_FIRST)
    ack("destination-first", ActionKind.RESERVE_DESTINATION, OutcomeKind.ACCEPTED)
    scheduled("scheduled", fallback_transfer_delay_ms=250.0)
    scheduled("pulled", fallback_transfer_delay_ms=50.0, transfer_executor=Role.DESTINATION)
    scheduled("activated")
    fact("activated", TransferCompleted())
    ack("activated", ActionKind.ACTIVATE_DESTINATION, OutcomeKind.APPLIED)
    held("canceled")
    ack("canceled", ActionKind.RESERVE_DESTINATION, OutcomeKind.ACCEPTED)
    fact("canceled", Canceled())
    ack("canceled", ActionKind.CANCEL_SOURCE, OutcomeKind.APPLIED)
    held("decode-lost")
    fact("decode-lost", EngineLost(Role.DESTINATION))
    held("settled", decode="decode-b")  # decode-b has no stream: its reservation waits
    fact("settled", Canceled())
    world.journal.commit_now()
    world.journal.close_now()

    expected = {
        "started": (Phase.ACTIVE, None),
        "destination-first": (Phase.ACTIVE, None),
        "scheduled": (Phase.ACTIVE, ActionKind.START_TRANSFER),
        "pulled": (Phase.ACTIVE, ActionKind.START_TRANSFER),
        "activated": (Phase.ACTIVE, ActionKind.ACTIVATE_DESTINATION),
        "canceled": (Phase.CLEANING_UP, ActionKind.CANCEL_SOURCE),
        "decode-lost": (Phase.CLEANING_UP, None),
        "settled": (Phase.CLEANING_UP, None),
        "abandoned": (Phase.CLEANING_UP, None),
    }
    recovered = {}
    for rebuilding in (False, True):
        journal = Journal.open(tmp_path)
        replay_clock = ReplayClock(clock)
        registry = Registry(SETTINGS, Metrics(), replay_clock)
        recovery = recover(journal, registry, replay_clock, rebuilding)
        journal.close_now()
        recovered[rebuilding] = internals(registry)
        assert recovery.skipped == 0
        for handoff_id, (phase, acknowledged) in expected.items():
            entry = registry.get(handoff_id)
            assert entry.core.phase is phase, handoff_id
            if acknowledged is not None:
                assert acknowledged not in {kind for _, kind, _ in entry.routed.values()}
        if rebuilding:
            assert recovery.rebuilt == len(expected) - 1  # the abandoned one is given back
    assert recovered[True] == recovered[False]
    deadlines = recovered[True]["entries"]
    assert deadlines["scheduled"][5] > deadlines["started"][5]  # the transfer moved it
