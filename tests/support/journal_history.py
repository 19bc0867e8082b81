"""A seeded run of calls journaled by a registry: the history behind the
format-1 fixture (tests/fixtures/journal-v1/), written by the release before
snapshots with what its registry then held (expected.json).

Uses only what both formats' servers have, so the same module wrote the
fixture (``python -m tests.support.journal_history DIR`` with that release's server
on the path) and is read by tests/durability/test_recovery_formats.py.
"""

from __future__ import annotations

import contextlib
import json
import random
import sys
from pathlib import Path

from handoff_proto.v1 import coordinator_pb2 as pb
from handoff_server.domain.delivery import Subscription
from handoff_server.domain.entries import Entry, StartRequest
from handoff_server.domain.model import (
    Canceled,
    DestinationReserved,
    EngineLost,
    Fact,
    Failed,
    HandoffError,
    Order,
    Outcome,
    OutcomeKind,
    Role,
    SourceHeld,
    TimingMode,
    TransferCompleted,
    TransferTiming,
)
from handoff_server.domain.registry import Registry
from handoff_server.durability.journal import Journal
from handoff_server.durability.records import JournalRecorder
from handoff_server.durability.recovery import ReplayClock, recover
from handoff_server.ops.config import Settings
from handoff_server.ops.metrics import Metrics
from handoff_server.service import convert
from tests.support.fakes import FakeClock

START = 1_800_000_000.0
SETTINGS = Settings(
    default_timeout_s=20.0,
    delivery_timeout_s=15.0,
    cleanup_timeout_s=25.0,
    cleanup_redelivery_s=1.0,
    retention_s=300.0,
)
IDS = [f"h{i}" for i in range(60)]
ENGINES = ["prefill-a", "prefill-b", "decode-a", "decode-b"]
FACTS: list[Fact] = [
    SourceHeld(TransferTiming(TimingMode.FULL_PROMPT, 1000, 1_000_000, 1.0)),
    SourceHeld(TransferTiming(TimingMode.DESTINATION_MISSING, 500, 2048, 10.0, 64)),
    DestinationReserved(700),
    TransferCompleted(),
    Failed(),
    Canceled(),
    EngineLost(Role.SOURCE),
    EngineLost(Role.DESTINATION),
]
OUTCOMES = [Outcome(kind) for kind in OutcomeKind if kind is not OutcomeKind.FAILED] + [
    Outcome(OutcomeKind.FAILED, "engine said no")
]
ANSWER = {
    "submit_prefill": OutcomeKind.SUBMITTED,
    "reserve_destination": OutcomeKind.ACCEPTED,
    "start_transfer": OutcomeKind.SCHEDULED,
}
ANSWER.update((kind, OutcomeKind.APPLIED) for kind in ("activate_destination", "release_source"))
TRACE = (("traceparent", "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"),)


def run(registry: Registry, clock: FakeClock, journal: Journal | None, steps: int = 600) -> None:
    """The seeded calls; outcomes mostly answer what is outstanding, so most
    handoffs complete (some reopen, some are abandoned, many stay in flight)."""
    rng = random.Random(12)
    streams: dict[str, Subscription] = {}
    for i in range(20):  # successes, both orders, a few reopened by a decode-phase fact
        handoff_id = f"s{i}"
        order = Order.SOURCE_FIRST if i % 2 else Order.DESTINATION_FIRST
        registry.start(
            StartRequest(
                handoff_id, order, ENGINES[i % 2], ENGINES[2 + i % 2], 5.0, trace_context=TRACE
            )
        )
        facts = [FACTS[i % 2], FACTS[2], FACTS[3]]  # held, reserved, transferred
        for _ in range(12):
            entry = registry.handoffs[handoff_id]
            if not isinstance(entry, Entry) or not entry.core.outstanding:
                fact = [f for f in facts if _accepts(registry, handoff_id, f)]
                if not fact:
                    break
                facts.remove(fact[0])
                registry.report_fact(handoff_id, fact[0])
                continue
            action = entry.core.outstanding[0]
            registry.report_outcome(handoff_id, action.id, Outcome(ANSWER[action.kind.value]))
        clock.now += 0.25
        if i % 5 == 0:
            with contextlib.suppress(HandoffError):
                registry.report_fact(handoff_id, EngineLost(Role.DESTINATION))
    for _ in range(steps):
        op = rng.choices(
            ["start", "fact", "outcome", "stream", "take", "time"], [3, 4, 6, 1, 2, 1]
        )[0]
        handoff_id = rng.choice(IDS)
        try:
            if op == "start":
                registry.start(
                    StartRequest(
                        handoff_id,
                        rng.choice(list(Order)),
                        rng.choice(ENGINES),
                        rng.choice(ENGINES),
                        rng.choice([0.0, 5.0, 250.0]),
                        rng.choice([Role.SOURCE, Role.DESTINATION]),
                        rng.choice([None, 3.0, 60.0]),
                        rng.choice([(), TRACE]),
                    )
                )
            elif op == "fact":
                registry.report_fact(handoff_id, rng.choice(FACTS))
            elif op == "outcome":
                known = registry.handoffs.get(handoff_id)
                outstanding = (
                    [a.id for a in known.core.outstanding] if isinstance(known, Entry) else []
                )
                action_id = rng.choice(outstanding or [0, 7])
                registry.report_outcome(handoff_id, action_id, rng.choice(OUTCOMES))
            elif op == "stream":
                engine = rng.choice(ENGINES)
                if engine in streams:
                    registry.delivery.unsubscribe(streams.pop(engine))
                else:
                    incarnation = rng.choice(["", "a", "b"])
                    streams[engine] = registry.subscribe(engine, lambda: None, incarnation)
                    if incarnation and journal is not None:
                        journal.engine(engine, incarnation)
            elif op == "take":
                for stream in streams.values():
                    registry.delivery.take(stream)
            else:
                clock.now += rng.choice([0.05, 0.1, 0.5, 2.0, 16.0])
                registry.fire_due()
        except HandoffError:
            pass


def _accepts(registry: Registry, handoff_id: str, fact: Fact) -> bool:
    """Whether the core would take ``fact`` now (tried, then undone)."""
    entry = registry.handoffs[handoff_id]
    if not isinstance(entry, Entry):
        return False
    checkpoint = entry.core.checkpoint()
    try:
        entry.core.apply_fact(fact)
    except HandoffError:
        return False
    finally:
        entry.core.restore(checkpoint)
    return True


def answers(registry: Registry) -> dict[str, list[object]]:
    """Each handoff as GetHandoff answers it, its deadline and its outstanding
    actions: what recovery must bring back, as JSON. Without end_reasons: the
    format 1 fixture was written before them (their recovery is tested apart)."""
    return {
        handoff_id: [
            _without_reasons(convert.handoff(entry)).SerializeToString(deterministic=True).hex(),
            entry.deadline,
            sorted(entry.routed),
        ]
        for handoff_id, entry in sorted(registry.handoffs.items())
    }


def _without_reasons(message: pb.Handoff) -> pb.Handoff:
    message.ClearField("end_reasons")
    return message


def write(state_dir: Path) -> None:
    """The fixture: the run, journaled, committed, and the file closed; beside
    it, what the registry held (the run's order of equal-time timers follows
    set iteration, so only the process that wrote the file knows it)."""
    clock = FakeClock()
    journal = Journal.open(state_dir)
    replay_clock = ReplayClock(clock)
    registry = Registry(SETTINGS, Metrics(), replay_clock)
    recover(journal, registry, replay_clock)
    registry.recorder = JournalRecorder(journal)
    run(registry, clock, journal)
    journal.commit_now()
    journal.close_now()
    expected = {"now": clock.now, "handoffs": answers(registry)}
    (state_dir / "expected.json").write_text(json.dumps(expected, indent=0) + "\n")


if __name__ == "__main__":
    write(Path(sys.argv[1]))
