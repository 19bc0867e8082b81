"""Recovery: what a journal record means, and replaying a journal into a Registry.

The journal (journal.py) stores; this module says what is stored. The
registry hands each accepted call to a :class:`JournalRecorder` (its
``recorder``), which encodes it as a small JSON list. On start, :func:`recover`
replays the records in order, with the server's clock reading each record's
time, so deadlines, lifecycle times, retention and cleanup timers come back
as they were: through the registry itself, except for the two kinds of
handoff below that come back whole.

While replaying, each engine named by a handoff has a stand-in stream that
takes every action as it is issued: so every issued action counts as
written, and is redelivered when the engine subscribes again (at least
once, as after any reconnect). Each stand-in subscribes under its engine's
last journaled incarnation, so an engine that comes back under it
reconnects, and one under a newer incarnation restarted and is lost. The
stand-ins end when the replay does, so an engine that does not come back
within the delivery timeout, counted from recovery, is lost as usual. What
the server decided on its own (a deadline, a lost engine, a settled cleanup,
a shutdown's cancel, an abandonment) was journaled when it happened and
replays as a record: the replay never decides anything itself. One thing
is decided at the end: cleanup timeouts kept running while the server was
down, so no handoff still cleaning up is abandoned before the delivery
timeout (and a redelivery round) from recovery; by then its engines came
back and reported, or were lost, which settles what they owed.

A completed handoff is the exception to replaying calls (journal format 2):
when it completes, one ``retained`` record (:func:`encode_retained`: its
packed core, engines, times and the caller's trace context) replaces its
history in the same commit, and recovery puts it straight back into
retention. Why: a retained handoff was most of a full journal's records
(nine of the thirteen of a live and a retained one) and of its replay, and
nothing about it can change but a reopen, which replays from the restored
record like any later call. A format 1 journal has no snapshots and replays
as it always did.

An unfinished handoff started in the journal is the other exception: its
records run through the pure core alone and the registry adopts the end
state once (rebuild.py), instead of each record running the registry's
whole call path (checkpoint, routing, delivery queues, a stand-in stream
taking each action, timers, metrics) for state the next record overwrites.
That path was two thirds of a replay. The rebuild follows the call path's
bookkeeping only where it stays within the one handoff, and gives the
handoff back to the registry's replay where it does not (the server
settling a cleanup, an abandonment, a completion); with tracing on every
record replays through the registry, which builds the spans. Equality is
the proof: tests/test_recovery.py recovers random journals both ways and
compares every handoff, delivery channel, live timer and the retention
order, and recovers a journal with every kind of unfinished handoff both
ways. Delivery numbers every dispatch by its journal record
(rebuild.numbered), so what is rebuilt and what is replayed keep one issue
order per engine.

Replay CPU time is linear in the records. Measured (bench/RESULTS.md): a
journal of 100,000 unfinished + 100,000 retained handoffs (500,000 records)
recovers in about 6.6 s of CPU, against 10.7 to 11.7 s replaying every
record through the registry, in one run. Other cuts that stay: the cyclic
garbage collector is off during the replay (which only adds long-lived
objects), metrics discard what they are told (history is not news), the
registry's log is quiet, each distinct record body is decoded once (outcomes
and facts repeat a few ways across a journal; a start names its handoff and
never repeats), and a retained record is restored straight into its packed
form, its ending shared with every handoff that ended alike.
"""

from __future__ import annotations

import contextlib
import gc
import json
import logging
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from handoff_server import packing
from handoff_server.core import (
    Checkpoint,
    DestinationStage,
    Settlement,
    SourceStage,
    TransferStage,
)
from handoff_server.delivery import Role, Subscription
from handoff_server.entries import Entry, Retained, StartRequest
from handoff_server.journal import Journal
from handoff_server.metrics import discarding
from handoff_server.model import (
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
    TimedOut,
    TimingMode,
    TransferCompleted,
    TransferTiming,
)
from handoff_server.packing import Completed, Ending
from handoff_server.rebuild import Rebuild, Row, numbered
from handoff_server.registry import Recorded, Registry
from handoff_server.tracing import Tracing

log = logging.getLogger("handoff.recovery")

TAKE_ALL = 1 << 30
STAND_IN_SESSION = "journal-recovery"
ABANDONED = "abandoned"  # a record of its own: the cleanup timer's doing, not a call's
RETAINED = "retained"  # a completed handoff whole: it replaced the handoff's history
FORSAKEN = "forsaken"  # a side's actions that never reached its engine, owed no more
OWN_RECORDS = frozenset({RETAINED, FORSAKEN, ABANDONED})  # the server's doing, not a call's
SIMPLE_FACTS: dict[str, Fact] = {
    "transfer_completed": TransferCompleted(),
    "failed": Failed(),
    "timed_out": TimedOut(),
    "canceled": Canceled(),
}
SIMPLE_NAMES = {type(fact): name for name, fact in SIMPLE_FACTS.items()}


# --- what a record says ------------------------------------------------------


def encode(call: Recorded) -> list[object]:
    if isinstance(call, tuple):
        action_id, outcome = call
        return ["outcome", action_id, outcome.kind.value, outcome.reason]
    if isinstance(call, StartRequest):
        return [
            "start",
            call.order.value,
            call.source_engine_id,
            call.destination_engine_id,
            call.fallback_transfer_delay_ms,
            call.transfer_executor.value,
            call.timeout_s,
            [list(pair) for pair in call.trace_context],
        ]
    if isinstance(call, SourceHeld):
        t = call.transfer_timing
        return [
            "source_held",
            t.mode.value,
            t.full_prompt_tokens,
            t.kv_bytes_per_token,
            t.bandwidth_gb_s,
            t.state_bytes,
        ]
    if isinstance(call, DestinationReserved):
        return ["destination_reserved", call.transferable_prompt_tokens]
    if isinstance(call, EngineLost):
        return ["engine_lost", call.role.value]
    return [SIMPLE_NAMES[type(call)]]


def encode_retained(retained: Retained) -> list[object]:
    """A completed handoff whole, as :meth:`Registry.restore` takes it back.

    Its packed core (Completed) is all but constant: stages and settlements,
    the lifecycle, the next action id; the action journal is empty once
    complete (the core forgot it). The times are the registry's, as kept.
    """
    core = retained.core
    _, completion, lifecycle, source, destination, transfer, (next_id, issued, outcomes) = (
        core.ending.state
    )
    assert completion is not None, "only a completed core"
    assert not issued, "a completed core forgot its actions"
    assert not outcomes, "a completed core forgot its actions"
    timing = source[2]
    return [
        RETAINED,
        core.order.value,
        retained.source_engine_id,
        retained.destination_engine_id,
        core.fallback_transfer_delay_ms,
        retained.transfer_executor.value,
        [list(pair) for pair in retained.trace_context],
        [retained.started_at, retained.deadline, retained.completed_at, retained.timeout_s],
        retained.lifecycle_at,
        completion.value,
        [event.value for event in lifecycle],
        [
            source[0].value,
            source[1].value,
            None
            if timing is None
            else [
                timing.mode.value,
                timing.full_prompt_tokens,
                timing.kv_bytes_per_token,
                timing.bandwidth_gb_s,
                timing.state_bytes,
            ],
        ],
        [destination[0].value, destination[1].value, destination[2]],
        [transfer[0].value, transfer[1]],
        next_id,
    ]


def decode_retained(handoff_id: str, body: list[Any], endings: dict[str, Ending]) -> Retained:
    """The retained handoff a ``retained`` record was written from.

    ``endings`` caches each distinct ending by its text: a hundred thousand
    retained handoffs end in a few dozen ways, and building the enums again
    for each was a third of restoring one.
    """
    (_, order, source_id, destination_id, fallback, executor, trace, times, lifecycle_at, *end) = (
        body
    )
    key = f"{order} {end!r}"
    shared = endings.get(key)
    if shared is None:
        shared = endings[key] = packing.ending(Order(order), _ending(*end))
    return Retained.restored(
        Completed(handoff_id, fallback, shared),
        sys.intern(source_id),
        sys.intern(destination_id),
        Role(executor),
        tuple((name, value) for name, value in trace),
        times + lifecycle_at,
    )


def _ending(
    completion: str,
    lifecycle: list[str],
    source: list[Any],
    destination: list[Any],
    transfer: list[Any],
    next_id: int,
) -> Checkpoint:
    source_stage, source_settlement, timing = source
    destination_stage, destination_settlement, tokens = destination
    return (
        Phase.COMPLETE,
        Completion(completion),
        tuple(LifecycleEvent(event) for event in lifecycle),
        (
            SourceStage(source_stage),
            Settlement(source_settlement),
            None if timing is None else TransferTiming(TimingMode(timing[0]), *timing[1:]),
        ),
        (DestinationStage(destination_stage), Settlement(destination_settlement), tokens),
        (TransferStage(transfer[0]), transfer[1]),
        (next_id, (), ()),
    )


def decode(handoff_id: str, body: list[Any]) -> Recorded:
    kind = body[0]
    if kind == "outcome":
        _, action_id, outcome_kind, reason = body
        return action_id, Outcome(OutcomeKind(outcome_kind), reason)
    if kind == "start":
        _, order, source, destination, fallback, executor, timeout_s, trace = body
        return StartRequest(
            handoff_id,
            Order(order),
            source,
            destination,
            fallback,
            Role(executor),
            timeout_s,
            tuple((key, value) for key, value in trace),
        )
    if kind == "source_held":
        _, mode, tokens, kv_bytes, bandwidth, state_bytes = body
        return SourceHeld(
            TransferTiming(TimingMode(mode), tokens, kv_bytes, bandwidth, state_bytes)
        )
    if kind == "destination_reserved":
        return DestinationReserved(body[1])
    if kind == "engine_lost":
        return EngineLost(Side(body[1]))
    return SIMPLE_FACTS[kind]


class JournalRecorder:
    """The registry's recorder: encodes each accepted call into the journal."""

    __slots__ = ("journal",)

    def __init__(self, journal: Journal) -> None:
        self.journal = journal

    def record(self, handoff_id: str, at: float, call: Recorded) -> None:
        self.journal.append(handoff_id, at, encode(call))

    def abandoned(self, handoff_id: str, at: float) -> None:
        self.journal.append(handoff_id, at, [ABANDONED])

    def completed(self, retained: Retained, at: float) -> None:
        self.journal.replace(retained.handoff_id, at, encode_retained(retained))

    def forsaken(self, handoff_id: str, at: float, role: Role, engine_id: str) -> None:
        self.journal.append(handoff_id, at, [FORSAKEN, role.value, engine_id])

    def drop(self, handoff_id: str) -> None:
        self.journal.drop(handoff_id)


# --- replay --------------------------------------------------------------------


class ReplayClock:
    """The server's clock, reading a record's time while the journal is replayed.

    After the replay it never reads earlier than the last record, even if the
    machine's clock went back across the restart: the registry relies on time
    never going backwards.
    """

    __slots__ = ("_clock", "_at", "_offset")

    def __init__(self, clock: Callable[[], float]) -> None:
        self._clock = clock
        self._at: float | None = None
        self._offset = 0.0

    def __call__(self) -> float:
        at = self._at
        return at if at is not None else self._clock() + self._offset

    def replaying(self, at: float) -> None:
        self._at = at

    def resume(self) -> None:
        last, self._at = self._at, None
        if last is not None:
            self._offset = max(0.0, last - self._clock())


@dataclass(frozen=True, slots=True)
class Recovery:
    """What a replay brought back."""

    handoffs: dict[Phase, int]  # by phase, the abandoned apart
    abandoned: int
    records: int
    skipped: int  # records the registry no longer accepted (see recover)
    seconds: float
    engine_incarnations: dict[str, str]
    rebuilt: int = 0  # unfinished handoffs rebuilt through the core alone (rebuild.py)

    @property
    def total(self) -> int:
        return sum(self.handoffs.values()) + self.abandoned


def recover(
    journal: Journal, registry: Registry, clock: ReplayClock, rebuilding: bool = True
) -> Recovery:
    """Replay ``journal`` into ``registry`` (new, built on ``clock``); then it serves.

    A record is skipped, never fatal, if the registry refuses it: the live
    registry read its clock a few microseconds apart within one call, the
    replay reads one time per record, and a retained handoff whose expiry
    fell in between expires a call earlier. Skips are counted and logged.
    ``rebuilding`` off replays every unfinished handoff through the registry
    (tests compare the two; tracing always does, its spans are built there).
    """
    began = time.monotonic()
    assert registry.recorder is None, "replay must not journal what it replays"
    live_metrics, registry.metrics = registry.metrics, discarding()  # history is not news
    delivery = registry.delivery
    delivery.metrics = registry.metrics
    incarnations = journal.engine_incarnations()
    tracer = registry.tracer
    if tracer.on:
        tracer.replaying = True  # history is not news to the trace collector either
    replay = Replay(journal, registry, clock, incarnations, rebuilding and not tracer.on)
    with _quiet("handoff.registry"), _no_cyclic_gc():
        for row in journal.rows():
            replay.row(row)
        replay.finish()
        clock.resume()
        if tracer.on:
            tracer.replaying = False
        replay.end_stand_ins()
        # An engine has the delivery timeout from now to come back, and a
        # redelivery round to report its cleanup, before a cleanup timeout
        # that ran out while the server was down abandons what it owes.
        settings = registry.settings
        registry.defer_abandonment(
            clock() + settings.delivery_timeout_s + settings.cleanup_redelivery_s
        )
    registry.metrics = delivery.metrics = live_metrics
    phases = dict.fromkeys(Phase, 0)
    abandoned = 0
    for entry in registry.handoffs.values():
        if isinstance(entry, Entry) and entry.abandoned_at is not None:
            abandoned += 1  # kept for GetHandoff, counted in no phase
        else:
            phases[entry.core.phase] += 1
    for phase, count in phases.items():
        live_metrics.handoffs_by[phase].set(count)
    recovery = Recovery(
        phases,
        abandoned,
        replay.records,
        replay.skipped,
        time.monotonic() - began,
        incarnations,
        replay.rebuilt,
    )
    live_metrics.recovered_handoffs.set(recovery.total)
    live_metrics.recovery_seconds.set(recovery.seconds)
    log.info(
        "recovered %d handoffs (%d active, %d cleaning up, %d retained, %d abandoned) from "
        "%d journal records in %.2f s",
        recovery.total,
        phases[Phase.ACTIVE],
        phases[Phase.CLEANING_UP],
        phases[Phase.COMPLETE],
        abandoned,
        recovery.records,
        recovery.seconds,
    )
    if replay.skipped:
        log.warning("%d journal records no longer applied and were skipped", replay.skipped)
    return recovery


Decoded = Recorded | list[Any]  # a call, or the body of one of the server's own records


class Replay:
    """One journal's rows, in order, into a registry (see the module doc).

    An unfinished handoff whose first record is its start is rebuilt through
    the core alone (rebuild.py) and adopted by the registry at the end, in the
    order of the starts; everything else replays through the registry as it
    comes. A handoff the rebuild gives back replays its records so far through
    the registry at once, and from then on as they come.
    """

    def __init__(
        self,
        journal: Journal,
        registry: Registry,
        clock: ReplayClock,
        incarnations: dict[str, str],
        rebuilding: bool,
    ) -> None:
        self.journal = journal
        self.registry = registry
        self.clock = clock
        self.incarnations = incarnations
        self.rebuilding = rebuilding
        self.records = self.skipped = self.rebuilt = 0
        self.last_seq = 0
        self.streams: dict[str, Subscription] = {}
        self.ready: set[str] = set()
        self.rebuilds: dict[str, Rebuild] = {}
        # Each distinct body's call, by its text: outcomes and facts repeat a
        # few ways across a journal, so each is decoded once (a start names
        # its handoff, which its text does not: never shared).
        self.calls: dict[str, Recorded] = {}
        self.endings: dict[str, Ending] = {}

    def row(self, row: Row) -> None:
        seq, handoff_id, at, text = row
        self.records += 1
        self.last_seq = seq
        rebuild = self.rebuilds.get(handoff_id)
        if rebuild is not None:
            self._rebuild(rebuild, row)
            return
        call = self._decoded(handoff_id, text)
        if self.rebuilding and isinstance(call, StartRequest):
            registry = self.registry
            registry.retention.expire(at)  # as the registry's start does first
            if handoff_id not in registry.handoffs:
                self._stand_in(call.source_engine_id)
                self._stand_in(call.destination_engine_id)
                settings = registry.settings
                timeout = settings.default_timeout_s if call.timeout_s is None else call.timeout_s
                self.rebuilds[handoff_id] = Rebuild(call, timeout, row)
                return
        self._replay(row, call)

    def finish(self) -> None:
        """Adopt the rebuilt handoffs, in the order they started."""
        for rebuild in self.rebuilds.values():
            self.registry.adopt(
                rebuild.entry, rebuild.written, rebuild.reached, rebuild.cleaning_since
            )
            self.skipped += rebuild.skipped
        self.rebuilt = len(self.rebuilds)
        self.rebuilds.clear()
        self.registry.delivery.number_from(numbered(self.last_seq + 1))

    def end_stand_ins(self) -> None:
        """The stand-in streams end: each engine is offline from now on, as
        after any disconnect, with everything it was sent outstanding."""
        delivery = self.registry.delivery
        for stream in self.streams.values():
            delivery.take(stream, TAKE_ALL)
            delivery.unsubscribe(stream)

    def _rebuild(self, rebuild: Rebuild, row: Row) -> None:
        seq, handoff_id, at, text = row
        call = self._decoded(handoff_id, text)
        if isinstance(call, tuple):
            rebuild.outcome(seq, at, *call)
        elif isinstance(call, list):
            if call[0] == FORSAKEN:
                rebuild.forsake(Role(call[1]), call[2])
            else:
                rebuild.needs_registry = f"a record of its own: {call[0]}"
        elif isinstance(call, StartRequest):
            rebuild.needs_registry = "a second start"
        else:
            rebuild.fact(seq, at, call)
        if rebuild.needs_registry is not None:
            # Given back at once: from this record on (the one that needs the
            # registry included) the handoff replays in journal order, so what
            # it does beyond itself (retention, above all) happens in order.
            # Its records so far are read again (rare; kept, they would double
            # the replay's memory).
            log.debug(
                "replayed through the registry: %s",
                rebuild.needs_registry,
                extra={"handoff_id": handoff_id},
            )
            del self.rebuilds[handoff_id]
            for earlier in self.journal.rows_of(handoff_id, seq):
                self._replay(earlier, self._decoded(handoff_id, earlier[3]))

    def _replay(self, row: Row, call: Decoded) -> None:
        """One record through the registry's own call path."""
        seq, handoff_id, at, _ = row
        registry = self.registry
        self.clock.replaying(at)
        if isinstance(call, list):
            kind = call[0]
            if kind == RETAINED:
                retained = decode_retained(handoff_id, call, self.endings)
                self._stand_in(retained.source_engine_id)
                self._stand_in(retained.destination_engine_id)
                if registry.tracer.on:
                    retained.trace = _trace_again(registry.tracer, retained.unpack())
                if not registry.restore(retained):
                    self.skipped += 1
            elif kind == FORSAKEN:
                registry.delivery.forsake(handoff_id, Role(call[1]), call[2])
            elif isinstance(registry.handoffs.get(handoff_id), Entry):
                registry.abandon(handoff_id)  # ABANDONED
            else:
                self.skipped += 1
            return
        registry.delivery.number_from(numbered(seq))
        try:
            if isinstance(call, StartRequest):
                self._stand_in(call.source_engine_id)
                self._stand_in(call.destination_engine_id)
                registry.start(call)
            elif isinstance(call, tuple):
                registry.report_outcome(handoff_id, *call)
            else:
                registry.report_fact(handoff_id, call)
        except HandoffError as error:
            self.skipped += 1
            log.debug("record %d skipped: %s", seq, error.message)
        # Taken at once, as a live stream would have: whether an engine was
        # reached is part of the state (what is redelivered; who is owed).
        ready, streams, delivery = self.ready, self.streams, registry.delivery
        while ready:
            delivery.take(streams[ready.pop()], TAKE_ALL)

    def _decoded(self, handoff_id: str, text: str) -> Decoded:
        known = self.calls.get(text)
        if known is not None:
            return known
        body: list[Any] = json.loads(text)
        if body[0] in OWN_RECORDS:
            return body
        call = decode(handoff_id, body)
        if not isinstance(call, StartRequest):
            self.calls[text] = call
        return call

    def _stand_in(self, engine_id: str) -> None:
        # Under the engine's last incarnation: the engine that comes back
        # under it reconnects; one under a newer one restarted, and is lost.
        if engine_id not in self.streams:
            ready = self.ready
            self.streams[engine_id] = self.registry.subscribe(
                engine_id,
                lambda: ready.add(engine_id),
                self.incarnations.get(engine_id, ""),
                STAND_IN_SESSION,
            )


def _trace_again(tracer: Tracing, entry: Entry) -> object:
    """A retained handoff's trace from its caller's context, its span ended
    (and not exported again: the tracer is replaying), as a replay leaves it."""
    context = dict(entry.trace_context)
    traceparent, tracestate = context.get("traceparent", ""), context.get("tracestate", "")
    tracer.started(entry, traceparent, tracestate, entry.started_at)
    completion = entry.core.completion
    assert completion is not None, "only a completed handoff is retained"
    tracer.completed(entry, completion, entry.completed_at or entry.started_at)
    return entry.trace


@contextlib.contextmanager
def _no_cyclic_gc() -> Iterator[None]:
    """Replay only adds long-lived objects: the cyclic collector's passes over
    the growing table find nothing (3 to 6 % of a replay's CPU, measured).
    They are frozen after it (out of the collector's sight): else its first
    passes after recovery would walk the whole table, a stall of the event
    loop as long as a fraction of the replay."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        gc.freeze()
        if enabled:
            gc.enable()


@contextlib.contextmanager
def _quiet(name: str) -> Iterator[None]:
    """Silence a logger's per-handoff lines while history replays."""
    logger = logging.getLogger(name)
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)
