"""Recovery: replaying a journal into a Registry on start.

Records (records.py) replay in order through the registry in its replay mode
(:meth:`Registry.replaying`), with the server's clock reading each record's
time, so deadlines, lifecycle times, retention and cleanup timers come back
as they were. What the server decided on its own (a deadline, a lost engine,
a settled cleanup, an abandonment) was journaled when it happened: the replay
never decides anything itself, except that no cleanup is abandoned before its
engines had the delivery timeout from recovery to come back.

Each engine gets a stand-in stream that takes every action as it is issued
(so every action counts as written, and is redelivered on reconnect), under
its last journaled incarnation. Two kinds of handoff skip the call path: a
completed one is restored from its ``retained`` record, and an unfinished
one is rebuilt through the core alone (rebuild.py) and adopted once, which
tests/durability/test_recovery.py proves equal to replaying every record.
"""

from __future__ import annotations

import contextlib
import gc
import json
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from handoff_server.domain.delivery import Subscription
from handoff_server.domain.entries import Entry, StartRequest
from handoff_server.domain.model import (
    HandoffError,
    Phase,
    Role,
)
from handoff_server.domain.registry import Recorded, Registry
from handoff_server.durability.journal import Journal
from handoff_server.durability.rebuild import Rebuild, Row, numbered
from handoff_server.durability.records import (
    FORSAKEN,
    OWN_RECORDS,
    RETAINED,
    Explained,
    decode,
    decode_retained,
)
from handoff_server.ops.tracing import Tracing

log = logging.getLogger("handoff.recovery")

TAKE_ALL = 1 << 30
STAND_IN_SESSION = "journal-recovery"


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
    incarnations = journal.engine_incarnations()
    replay = Replay(journal, registry, clock, incarnations, rebuilding and not registry.tracer.on)
    with registry.replaying(), _no_cyclic_gc():
        for row in journal.rows():
            replay.row(row)
        replay.finish()
        clock.resume()
        replay.end_stand_ins()
        # An engine has the delivery timeout from now to come back, and a
        # redelivery round to report its cleanup, before a cleanup timeout
        # that ran out while the server was down abandons what it owes.
        settings = registry.settings
        registry.defer_abandonment(
            clock() + settings.delivery_timeout_s + settings.cleanup_redelivery_s
        )
    live_metrics = registry.metrics
    phases, abandoned = registry.census()
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


# A call, or the body of one of the server's own records.
Decoded = Recorded | Explained | list[Any]


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
        # few ways across a journal, so each is decoded once.
        self.calls: dict[str, Recorded | Explained] = {}
        self.endings: dict[str, int] = {}  # records.decode_retained's

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
        elif isinstance(call, Explained):
            rebuild.fact(seq, at, call.fact, call.reason)
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
            elif isinstance(call, Explained):
                registry.report_fact(handoff_id, call.fact, reason=call.reason)
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
        # A start names its handoff, an explained fact often its caller's
        # text: neither repeats, so neither is kept.
        if not isinstance(call, (StartRequest, Explained)):
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
    the growing table find nothing, and cost (bench/RESULTS.md). They are
    frozen after it (out of the collector's sight): else its first passes
    after recovery would walk the whole table, a stall of the event loop as
    long as a fraction of the replay."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        gc.freeze()
        if enabled:
            gc.enable()
