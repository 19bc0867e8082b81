"""The registry: the handoff table, the one path every call takes, and what timers do.

Synchronous and clock-injected: it never sleeps and never awaits. The gRPC
layer calls it, and calls :meth:`Registry.fire_due` when
:meth:`Registry.next_wakeup` says so; tests do the same with a fake clock and
no waiting at all. What happens to an action between its issue and its
acknowledgement (queues, streams, incarnations) is :mod:`handoff_server.domain.delivery`'s;
keeping finished handoffs is :mod:`handoff_server.domain.retention`'s.

Every call is atomic where the core is concerned: a call the core rejects,
or one that crashes inside the core, leaves the handoff exactly as it was.
The registry's own bookkeeping after the core accepted a call (routing,
timers, metrics) does not fail on valid state; a bug there is logged and
answered INTERNAL, and is not undone. What the server does on its own after a
call (an engine lost, a cleanup action settled for an engine that never
received anything) runs as calls of its own once the first is done.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import itertools
import logging
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Protocol

from handoff_server.domain.core import Handoff
from handoff_server.domain.delivery import Delivery, Dispatch, Subscription
from handoff_server.domain.entries import Entry, StartRequest
from handoff_server.domain.model import (
    CLEANUP_KINDS,
    LOST_EVENT,
    Action,
    ActionKind,
    AlreadyExists,
    Canceled,
    Completion,
    EndCause,
    EndReason,
    EngineLost,
    Fact,
    HandoffError,
    Internal,
    LostCause,
    NotFound,
    Outcome,
    OutcomeKind,
    Phase,
    Release,
    ReleaseReason,
    ResourceExhausted,
    Role,
    TimedOut,
    Unavailable,
)
from handoff_server.domain.retained import Handoffs, Retained, RetainedRecord, readable
from handoff_server.domain.retention import Retention
from handoff_server.domain.timers import Timer, TimerHeap, TimerKind
from handoff_server.ops.config import Settings
from handoff_server.ops.logs import BurstLog
from handoff_server.ops.metrics import Metrics, discarding
from handoff_server.ops.tracing import OFF, Tracer

log = logging.getLogger("handoff.registry")

Clock = Callable[[], float]  # seconds since the Unix epoch, never going backwards

MAX_REDELIVERY_DELAY_S = 30.0
COMPLETE = ActionKind.COMPLETE
# Handoffs of a lost engine reported per turn of the event loop (see Registry._lose).
LOSS_CHUNK = 8
LOST_BECAUSE = {
    LostCause.RESTARTED: "restarted under a new incarnation",
    LostCause.RECONCILED: "its sidecar freed these sides on its own (lease or orphan)",
}
NOOP = Outcome(OutcomeKind.NOOP)


# What one accepted call changed, as the journal keeps it (durability/records.py).
Recorded = StartRequest | Fact | tuple[int, Outcome]


class Recorder(Protocol):
    """Where accepted calls go to be made durable: records.JournalRecorder."""

    def record(
        self, handoff_id: str, at: float, call: Recorded, reason: EndReason | None = None
    ) -> None:
        """``reason``: why the call would end the handoff, when the call does not
        say it by itself (a lost engine's cause, a drain, a caller's text)."""

    def abandoned(self, handoff_id: str, at: float) -> None: ...

    def completed(self, retained: Retained, at: float) -> None:
        """The handoff completed: one record of it as retained replaces its history."""

    def forsaken(self, handoff_id: str, at: float, role: Role, engine_id: str) -> None:
        """Nothing for ``role`` was ever sent to ``engine_id``: none of it is owed."""

    def drop(self, handoff_id: str) -> None:
        """The handoff left the registry (its retention expired, or it was evicted)."""


class NotRecording:
    """The recorder of a server without a journal: every record is dropped."""

    __slots__ = ()

    def record(
        self, handoff_id: str, at: float, call: Recorded, reason: EndReason | None = None
    ) -> None:
        pass

    def abandoned(self, handoff_id: str, at: float) -> None:
        pass

    def completed(self, retained: Retained, at: float) -> None:
        pass

    def forsaken(self, handoff_id: str, at: float, role: Role, engine_id: str) -> None:
        pass

    def drop(self, handoff_id: str) -> None:
        pass


NOT_RECORDING = NotRecording()


@dataclass(frozen=True, slots=True)
class CallResult:
    entry: Entry | Retained
    actions: tuple[Dispatch, ...]
    already_started: bool = False  # a StartHandoff retried with the same parameters


class Registry:
    def __init__(
        self,
        settings: Settings,
        metrics: Metrics,
        clock: Clock,
        on_earlier_timer: Callable[[], None] = lambda: None,
        tracer: Tracer = OFF,
    ) -> None:
        self.settings = settings
        self.tracer = tracer
        self.metrics = metrics
        self.clock = clock
        self._on_earlier_timer = on_earlier_timer
        self._on_idle: list[Callable[[], None]] = []
        self._on_finished: list[Callable[[str], None]] = []
        # A burst of abandonments (a crowd of handoffs whose engine vanished)
        # is one line a second, not one ERROR per handoff.
        self._abandoned = BurstLog(log, logging.ERROR, 1.0, "handoffs abandoned")
        # Every handoff it knows by id: unfinished and abandoned ones as
        # Entries, completed ones as records (retained.RetainedRecord); read
        # through self.handoffs, which gives those back as Retained.
        self._table: dict[str, Entry | RetainedRecord] = {}
        self.handoffs = Handoffs(self._table)
        self.retention = Retention(settings, metrics, self._table, lambda: self._on_earlier_timer())
        self._timers = TimerHeap(self._timer_is_live)
        self.delivery = Delivery(settings, metrics, clock, self._schedule)
        # What the server does on its own after a call, each a call of its own.
        self._follow_ups: deque[Callable[[], None]] = deque()
        self._following_up = False
        # Losses of a crashed engine's backlog still to report (engine, handoff, roles).
        # A lost backlog's completions are summed up, not one line each (_lose_queued).
        self._completion_level = logging.INFO
        self._losing: deque[
            tuple[str, Iterator[str], Mapping[str, set[Role] | None], LostCause | None]
        ] = deque()
        self._epochs = itertools.count(1)
        self.draining = False
        self.recorder: Recorder = NOT_RECORDING
        self.retention.on_forget = self._forgotten
        self.delivery.on_redelivered = self._redelivered

    @contextlib.contextmanager
    def replaying(self) -> Iterator[None]:
        """Replay mode, for recovery: history is not news. Metrics count into
        discarding series (the gauges are set from the result afterwards),
        traces are rebuilt but not exported again, per-handoff log lines are
        quiet, and nothing is journaled."""
        assert self.recorder is NOT_RECORDING, "a replay must not journal what it replays"
        live = self.metrics
        quiet = discarding()
        self.metrics = self.delivery.metrics = self.retention.metrics = quiet
        self.tracer.replaying = True
        level = log.level
        log.setLevel(logging.ERROR)
        try:
            yield
        finally:
            log.setLevel(level)
            self.tracer.replaying = False
            self.metrics = self.delivery.metrics = self.retention.metrics = live

    # --- queries ------------------------------------------------------------

    @property
    def active_count(self) -> int:
        """Handoffs not complete: active or cleaning up."""
        return len(self._table) - self.retention.count

    def get(self, handoff_id: str) -> Entry | Retained:
        entry = self._find(handoff_id)
        if entry is None:
            raise NotFound("no such handoff (never started, or no longer retained)")
        return entry

    def _find(self, handoff_id: str) -> Entry | Retained | None:
        kept = self._table.get(handoff_id)
        return None if kept is None else readable(kept)

    def census(self) -> tuple[dict[Phase, int], int]:
        """How many handoffs it holds in each phase, and how many abandoned
        ones it keeps for GetHandoff (counted in no phase)."""
        phases = dict.fromkeys(Phase, 0)
        abandoned = 0
        for kept in self._table.values():
            if not isinstance(kept, Entry):
                phases[Phase.COMPLETE] += 1  # a retained record
            elif kept.abandoned_at is not None:
                abandoned += 1
            else:
                phases[kept.core.phase] += 1
        return phases, abandoned

    def next_wakeup(self) -> float | None:
        if self._losing:
            return self.clock()
        candidates = [
            t
            for t in (self._timers.next_at(), self.retention.next_expiry(), self._abandoned.due())
            if t is not None
        ]
        return min(candidates, default=None)

    def on_idle(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` whenever the number of unfinished handoffs drops to zero."""
        self._on_idle.append(callback)

    def on_finished(self, callback: Callable[[str], None]) -> None:
        """Call ``callback(handoff_id)`` whenever a handoff leaves the active set
        (complete, or abandoned while cleaning up)."""
        self._on_finished.append(callback)

    # --- calls ------------------------------------------------------------

    def start(self, request: StartRequest) -> CallResult:
        now = self.clock()
        self.retention.expire(now)
        timeout = (
            self.settings.default_timeout_s if request.timeout_s is None else request.timeout_s
        )
        known = self._find(request.handoff_id)
        if known is not None:
            _same_start(known, request, timeout)
            return CallResult(known, (), already_started=True)
        if self.draining:
            raise Unavailable("the server is shutting down and takes no new handoffs")
        if self.active_count >= self.settings.max_active_handoffs:
            raise ResourceExhausted(
                f"{self.active_count} handoffs are active, the limit is "
                f"{self.settings.max_active_handoffs}"
            )
        for engine_id in {request.source_engine_id, request.destination_engine_id}:
            queued = self.delivery.queued(engine_id)
            if queued >= self.settings.max_queued_actions_per_engine:
                raise ResourceExhausted(
                    f"engine {engine_id} has {queued} undelivered actions, the limit "
                    f"is {self.settings.max_queued_actions_per_engine}"
                )
        entry = Entry.started(request, timeout, now)
        self._table[request.handoff_id] = entry
        self.metrics.started.inc()
        self.metrics.handoffs_by[Phase.ACTIVE].inc()
        self._schedule(entry.deadline, TimerKind.DEADLINE, request.handoff_id, entry.deadline)
        self._engage(entry, now)
        # From the journal too: a recovered handoff keeps its caller's trace.
        ctx = dict(request.trace_context)
        self.tracer.started(entry, ctx.get("traceparent", ""), ctx.get("tracestate", ""), now)
        return CallResult(entry, self._call(entry, request, Handoff.start, now=now))

    def report_fact(
        self,
        handoff_id: str,
        fact: Fact,
        origin: str = "engine",
        detail: str = "",
        reason: EndReason | None = None,
    ) -> CallResult:
        """``detail``: the caller's reason text (Canceled's or Failed's);
        ``reason``: the whole reason, as the journal kept it (recovery)."""
        entry = self._unpacked(handoff_id)
        if detail and reason is None:
            reason = dataclasses.replace(entry.reason_for(fact), detail=detail)
        dispatches = self._call(
            entry, fact, lambda core: core.apply_fact(fact), fact=(fact, origin), reason=reason
        )
        self.metrics.facts_by[(fact.kind, origin)].inc()
        if isinstance(fact, EngineLost):
            self._forsake(entry, fact.role)
        return CallResult(entry, dispatches)

    def report_outcome(self, handoff_id: str, action_id: int, outcome: Outcome) -> CallResult:
        entry = self._unpacked(handoff_id)
        acknowledging = entry.core.is_outstanding(action_id)
        dispatches = self._call(
            entry,
            (action_id, outcome),
            lambda core: core.apply_outcome(action_id, outcome),
            acknowledged=(action_id, outcome) if acknowledging else None,
        )
        return CallResult(entry, dispatches)

    def cancel_active(self, reason: str) -> int:
        """Report Canceled on every ACTIVE handoff (shutdown); how many there were."""
        active = [
            e for e in self._table.values() if isinstance(e, Entry) and e.core.phase is Phase.ACTIVE
        ]
        for entry in active:
            log.warning("canceling handoff: %s", reason, extra={"handoff_id": entry.handoff_id})
            self._server_fact(entry, Canceled(), EndReason(EndCause.DRAIN, detail=reason))
        return len(active)

    # --- engine streams ---------------------------------------------------

    def subscribe(
        self,
        engine_id: str,
        on_ready: Callable[[], None],
        incarnation: str = "",
        session_id: str = "",
    ) -> Subscription:
        """A new live stream for ``engine_id`` (see Delivery.subscribe); a new
        incarnation loses the old one's handoffs here, at once."""
        subscription, lost = self.delivery.subscribe(engine_id, on_ready, incarnation, session_id)
        if lost:
            self._lose(engine_id, lost, cause=LostCause.RESTARTED)
        return subscription

    def take(self, subscription: Subscription, limit: int) -> list[Dispatch] | None:
        """Up to ``limit`` dispatches for a stream to write; None once it was replaced."""
        return self.delivery.take(subscription, limit)

    def unsubscribe(self, subscription: Subscription) -> None:
        """The stream ended: its engine is offline until it subscribes again."""
        self.delivery.unsubscribe(subscription)

    def close_streams(self) -> None:
        """End every live stream cleanly (shutdown)."""
        self.delivery.close_streams()

    def reconcile(
        self,
        engine_id: str,
        held: Iterable[tuple[str, Role]],
        freed: Iterable[tuple[str, Role]],
        *,
        incarnation: str,
        session_id: str,
    ) -> tuple[list[Release], int]:
        """What ``engine_id``'s sidecar should stop holding, after telling it what it freed.

        Only from the engine's live stream (``incarnation`` and ``session_id``
        as on it; Delivery.current), else FailedPrecondition and nothing changes.

        For each ``held`` side: a :class:`Release` when the engine should free
        it (see :class:`ReleaseReason`); the others go on. For each ``freed``
        side of an unfinished handoff in which this engine plays that role:
        EngineLost, as a server fact (the engine's memory for it is gone, and
        nobody would report anything for it again). Returns the releases and
        how many EngineLost were reported. Freed sides are applied first, so
        a side both freed and held is answered as lost.
        """
        self.delivery.current(engine_id, incarnation, session_id)
        now = self.clock()
        self.retention.expire(now)
        lost: dict[str, set[Role]] = {}
        for handoff_id, role in freed:
            entry = self._table.get(handoff_id)
            if (
                isinstance(entry, Entry)
                and entry.abandoned_at is None
                and entry.core.phase is not Phase.COMPLETE
                and _engine_of(entry, role) == engine_id
                and LOST_EVENT[role] not in entry.core.lifecycle
            ):
                lost.setdefault(handoff_id, set()).add(role)
        self._lose(engine_id, lost, cause=LostCause.RECONCILED)
        releases = []
        for handoff_id, role in held:
            reason = self._release_reason(engine_id, handoff_id, role)
            if reason is not None:
                releases.append(Release(handoff_id, role, reason))
        return releases, sum(len(roles) for roles in lost.values())

    def _release_reason(self, engine_id: str, handoff_id: str, role: Role) -> ReleaseReason | None:
        entry = self._find(handoff_id)
        if entry is None or _engine_of(entry, role) != engine_id:
            return ReleaseReason.UNKNOWN_HANDOFF
        core = entry.core
        if LOST_EVENT[role] in core.lifecycle:
            return ReleaseReason.ENGINE_LOST
        if core.phase is Phase.COMPLETE:
            if core.completion is Completion.CANCELED:
                return ReleaseReason.CANCELED
            if role is Role.SOURCE:
                return ReleaseReason.SUCCEEDED_AS_SOURCE
        return None

    # --- time ---------------------------------------------------------------

    def fire_due(self) -> None:
        """Run every timer that is due now. A timer that fails is logged and
        counted, and the others still run: deadlines, redelivery and
        retention must not stop for one bad handoff."""
        now = self.clock()
        while (timer := self._timers.pop_due(now)) is not None:
            try:
                self._fire(timer, now)
            except Exception:
                self.metrics.timer_errors.inc()
                whose = "engine_id" if timer.kind in ENGINE_TIMERS else "handoff_id"
                log.exception("%s timer failed", timer.kind.value, extra={whose: timer.key})
        self._lose_queued()
        self.retention.expire(now)
        self._abandoned.flush(now)
        self._timers.compact(self._live_timers_bound())

    def _fire(self, timer: Timer, now: float) -> None:
        """What each kind of timer does: the one place they are told apart."""
        kind, key = timer.kind, timer.key
        if kind is TimerKind.UNREACHABLE:
            self._engine_unreachable(key)
        elif kind is TimerKind.FORGET:
            self.delivery.forget(key)
        else:
            entry = self._table[key]
            assert isinstance(entry, Entry), "only unfinished handoffs have live timers"
            if kind is TimerKind.DEADLINE:
                log.warning("handoff deadline passed", extra={"handoff_id": key})
                self.metrics.timed_out.inc()
                self._server_fact(entry, TimedOut(), EndReason(EndCause.DEADLINE))
            elif kind is TimerKind.REDELIVER:
                self._redeliver_cleanup(entry, now)
            else:
                assert kind is TimerKind.ABANDON
                self._abandon(entry, now)

    def _timer_is_live(self, timer: Timer) -> bool:
        kind = timer.kind
        if kind in ENGINE_TIMERS:
            return self.delivery.timer_is_live(timer)
        entry = self._table.get(timer.key)
        if not isinstance(entry, Entry) or entry.abandoned_at is not None:
            return False  # gone, retained or abandoned: no timers any more
        if kind is TimerKind.DEADLINE:
            return entry.deadline == timer.token and entry.core.phase is Phase.ACTIVE
        if entry.core.phase is not Phase.CLEANING_UP:
            return False
        if kind is TimerKind.REDELIVER:
            # Each round names itself: a chain never forks into two.
            return timer.token == (entry.cleanup_epoch, entry.redelivery_round)
        return entry.cleanup_epoch == timer.token

    def _live_timers_bound(self) -> int:
        """How many timers can matter: two per unfinished handoff (its deadline,
        or redelivery and abandonment) and two per engine channel. Retained
        handoffs have none, so their stale deadlines are not kept for them."""
        return 2 * self.active_count + 2 * len(self.delivery)

    def _schedule(self, when: float, kind: TimerKind, key: str, token: object) -> None:
        earliest = self._timers.next_at()
        self._timers.schedule(when, kind, key, token)
        # Here, not only when timers fire: the loop may sleep for hours while
        # every handoff leaves stale timers behind.
        self._timers.compact(self._live_timers_bound())
        if earliest is None or when < earliest:
            self._on_earlier_timer()

    # --- the one path every core call takes --------------------------------

    def _call(
        self,
        entry: Entry,
        recorded: Recorded,
        call: Callable[[Handoff], tuple[Action, ...]],
        acknowledged: tuple[int, Outcome] | None = None,
        now: float | None = None,
        fact: tuple[Fact, str] | None = None,
        reason: EndReason | None = None,
    ) -> tuple[Dispatch, ...]:
        """``reason``: why it ended, if the call ends it and says more than
        ``recorded`` does by itself (Entry.reason_for); the journal keeps it."""
        core = entry.core
        checkpoint = core.checkpoint()
        phase_before, completion_before = core.phase, core.completion
        events_before = len(entry.lifecycle_at)
        # Before the call: an answered action is still routed.
        said = entry.reason_for(recorded)
        if reason == said:
            reason = None
        try:
            actions = call(core)
        except HandoffError:
            raise  # the core rejects atomically: nothing changed
        except Exception as error:
            core.restore(checkpoint)
            log.exception(
                "unexpected failure; handoff restored", extra={"handoff_id": core.handoff_id}
            )
            raise Internal(
                f"unexpected {type(error).__name__}; the handoff is unchanged"
            ) from error
        if now is None:
            now = self.clock()
        # Recorded before anything the call sets off (an eviction, the
        # follow-ups), so the journal keeps the order it happened in.
        self.recorder.record(entry.handoff_id, now, recorded, reason)
        if acknowledged is not None:
            self._acknowledge(entry, *acknowledged, now)
        entry.stamp(events_before, now)
        entry.end(phase_before, completion_before, reason or said)
        self.tracer.called(entry, fact, phase_before, completion_before, now)
        dispatches = tuple(self._route(entry, action, now) for action in actions)
        self._after_transition(entry, phase_before, completion_before, now)
        self._follow_up()
        return dispatches

    def _follow_up(self) -> None:
        """Run what the server does on its own after a call, once the call is done."""
        if self._following_up:
            return
        self._following_up = True
        try:
            while self._follow_ups:
                self._follow_ups.popleft()()
        finally:
            self._following_up = False

    def _acknowledge(self, entry: Entry, action_id: int, outcome: Outcome, now: float) -> None:
        (issued_at, kind, engines), held_since = entry.acknowledge(action_id, outcome)
        metrics, tracer = self.metrics, self.tracer
        metrics.outcomes_by[outcome.kind].inc()
        handoff_id, delivery = entry.handoff_id, self.delivery
        tracer.outcome(
            entry,
            action_id,
            outcome,
            lambda: delivery.attempts(handoff_id, action_id, engines),
            now,
        )
        metrics.latency_by[kind].observe(now - issued_at, tracer.exemplar(entry))
        if held_since is not None:
            metrics.source_hold.observe(now - held_since)
        self.delivery.acknowledge(entry.handoff_id, action_id, engines)

    def _route(self, entry: Entry, action: Action, now: float) -> Dispatch:
        self.metrics.actions_by[action.kind].inc()
        role, engines, extended = entry.route(action, now)
        if extended:
            self._schedule(entry.deadline, TimerKind.DEADLINE, entry.handoff_id, entry.deadline)
        trace = self.tracer.issued(entry, action, engines, now)
        # The notice says why it ended: the call ended it, so its reason is in.
        reason = entry.reasons[-1] if action.kind is COMPLETE and entry.reasons else None
        if (
            action.kind in CLEANUP_KINDS
            and entry.completed_at is None  # a success being reopened reached both sides
            and not self.delivery.reached(entry.handoff_id, role, engines[0])
        ):
            self._settle(entry, action, role, engines[0])
        else:
            self.delivery.send(entry.handoff_id, action, role, engines, trace, reason, now)
        # In a call's answer, a notice to both engines names neither.
        engine_id = engines[0] if len(engines) == 1 else ""
        return Dispatch(entry.handoff_id, action, role, engine_id, trace=trace, reason=reason)

    def _settle(self, entry: Entry, action: Action, role: Role, engine_id: str) -> None:
        """A cleanup action for a side none of whose actions reached its engine:
        there is nothing to free. Its queued actions are never sent, and the
        server reports the cleanup's outcome NOOP itself, rather than owe it."""
        self.delivery.forsake(entry.handoff_id, role, engine_id)
        # A replay counts every action as written, so it would not settle:
        # the journal says what was never sent, and owed to no one.
        self.recorder.forsaken(entry.handoff_id, self.clock(), role, engine_id)
        handoff_id, action_id = entry.handoff_id, action.id

        def settle() -> None:
            settled = self._table.get(handoff_id)
            if isinstance(settled, Entry) and settled.core.is_outstanding(action_id):
                log.debug(
                    "%s#%d settled by the server: nothing was ever sent to engine %s",
                    action.kind.value,
                    action_id,
                    engine_id,
                    extra={"handoff_id": handoff_id},
                )
                self._call(
                    settled,
                    (action_id, NOOP),
                    lambda core: core.apply_outcome(action_id, NOOP),
                    acknowledged=(action_id, NOOP),
                )

        self._follow_ups.append(settle)

    def _after_transition(
        self, entry: Entry, phase_before: Phase, completion_before: Completion | None, now: float
    ) -> None:
        phase = entry.core.phase
        # A lost decode reopens a successful handoff and completes it again
        # within one call: COMPLETE to COMPLETE, but CANCELED now.
        if phase is phase_before and entry.core.completion is completion_before:
            return
        self.metrics.handoffs_by[phase_before].dec()
        self.metrics.handoffs_by[phase].inc()
        if phase_before is Phase.COMPLETE:
            # The call ran on an Entry unpacked from the retained record;
            # it replaces the record, which the retention queue skips.
            self.metrics.reopened.inc()
            self.retention.release(entry)
            # A success was acknowledged by both sides: both were reached.
            self.delivery.engage(
                entry.handoff_id, entry.engines, reached=(Role.SOURCE, Role.DESTINATION)
            )
            log.info("successful handoff reopened", extra={"handoff_id": entry.handoff_id})
        if phase is Phase.CLEANING_UP:
            self._begin_cleanup(entry, now)
        elif phase is Phase.COMPLETE:
            completion = entry.core.completion
            assert completion is not None
            entry.completed_at = now
            self.metrics.completed_by[completion].inc()
            if completion is Completion.CANCELED:
                self.metrics.cancellations_by[entry.reasons[-1].cause].inc()
            self.tracer.completed(entry, completion, now)
            duration = now - entry.started_at
            self.metrics.duration_by[completion].observe(duration, self.tracer.exemplar(entry))
            # The core forgot its journal: nothing is outstanding any more.
            self._drop_routed(entry)
            retained = Retained(entry)
            # Before keep(): an eviction of this very handoff drops the snapshot too.
            self.recorder.completed(retained, now)
            self.retention.keep(retained)
            if completion is Completion.SUCCESS:
                # The usual end: counted (handoff_completed_total) and
                # traced, not a log line each (hundreds a second per shard).
                log.debug("handoff complete: success", extra={"handoff_id": entry.handoff_id})
            else:
                log.log(
                    self._completion_level,
                    "handoff complete: canceled (%s)",
                    entry.reasons[-1].describe(),
                    extra={"handoff_id": entry.handoff_id},
                )
            self._finished(entry.handoff_id)

    def _begin_cleanup(self, entry: Entry, now: float) -> None:
        """Cleanup (re)started at ``now``: when to send its actions again, and
        when to give up on them."""
        entry.cleanup_epoch = next(self._epochs)
        entry.redelivery_round = 0
        key = entry.handoff_id
        self._schedule(
            now + self.settings.cleanup_timeout_s, TimerKind.ABANDON, key, entry.cleanup_epoch
        )
        self._schedule(
            now + self.settings.cleanup_redelivery_s,
            TimerKind.REDELIVER,
            key,
            (entry.cleanup_epoch, 0),
        )

    def _server_fact(self, entry: Entry, fact: Fact, reason: EndReason) -> None:
        """A fact the server observed itself: a deadline, a lost engine, shutdown."""
        self._call(
            entry, fact, lambda core: core.apply_fact(fact), fact=(fact, "server"), reason=reason
        )
        self.metrics.facts_by[(fact.kind, "server")].inc()
        if isinstance(fact, EngineLost):
            self._forsake(entry, fact.role)

    # --- lost engines ---------------------------------------------------------

    def _engage(self, entry: Entry, now: float) -> None:
        """Tie a handoff to its engines; one already unreachable loses it at once."""
        self.delivery.engage(entry.handoff_id, entry.engines)
        for engine_id in entry.engines:
            if self.delivery.unreachable(engine_id, now):
                lost = {entry.handoff_id: set(entry.roles_of(engine_id))}
                self._follow_ups.append(functools.partial(self._lose, engine_id, lost, None))

    def _engine_unreachable(self, engine_id: str) -> None:
        # Every role it plays in each: worked out as each is lost (see _lose).
        lost: dict[str, set[Role] | None] = dict.fromkeys(self.delivery.handoffs_of(engine_id))
        self._lose(engine_id, lost, cause=LostCause.UNREACHABLE)

    def _lose(
        self, engine_id: str, lost: Mapping[str, set[Role] | None], cause: LostCause | None
    ) -> None:
        """Report EngineLost for ``engine_id``'s roles in each unfinished handoff of
        ``lost`` (None: every role it plays there); ``cause`` counts it (None:
        the engine was counted already).

        One summary line; a loss of more than LOSS_CHUNK handoffs (an engine
        that crashed with a backlog) is queued and reported a chunk per turn
        of the event loop (see fire_due), so health and every other call keep
        being answered while it goes on."""
        if len(lost) > LOSS_CHUNK:
            self._count_lost(engine_id, len(lost), cause)
            self._losing.append((engine_id, iter(sorted(lost)), lost, cause))
            self._on_earlier_timer()
            return
        affected = [
            entry
            for handoff_id in sorted(lost)
            if isinstance(entry := self._table.get(handoff_id), Entry)
            and entry.abandoned_at is None
            and entry.core.phase is not Phase.COMPLETE
        ]
        if affected:
            self._count_lost(engine_id, len(affected), cause)
        for entry in affected:
            self._lose_one(engine_id, entry, lost[entry.handoff_id], cause)

    def _count_lost(self, engine_id: str, handoffs: int, cause: LostCause | None) -> None:
        if cause is not None:
            self.metrics.engines_lost_by[cause].inc()
            log.warning(
                "engine lost (%s): reporting EngineLost in its %d unfinished handoffs",
                LOST_BECAUSE.get(cause)
                or f"no live stream for {self.settings.delivery_timeout_s:.1f} s",
                handoffs,
                extra={"engine_id": engine_id},
            )

    def _lose_queued(self) -> None:
        """Report the next LOSS_CHUNK queued losses (see _lose); the handoffs
        they complete are summed up in one line per engine, not logged each."""
        budget = LOSS_CHUNK
        self._completion_level = logging.DEBUG
        try:
            while self._losing and budget:
                engine_id, handoff_ids, lost, cause = self._losing[0]
                for handoff_id in itertools.islice(handoff_ids, budget):
                    budget -= 1
                    entry = self._table.get(handoff_id)
                    if isinstance(entry, Entry) and entry.abandoned_at is None:
                        self._lose_one(engine_id, entry, lost[handoff_id], cause)
                if budget:
                    self._losing.popleft()
                    log.info(
                        "engine lost: EngineLost reported in all %d of its handoffs",
                        len(lost),
                        extra={"engine_id": engine_id},
                    )
        finally:
            self._completion_level = logging.INFO

    def _lose_one(
        self, engine_id: str, entry: Entry, roles: set[Role] | None, cause: LostCause | None
    ) -> None:
        if roles is None:
            roles = set(entry.roles_of(engine_id))
        # None: the engine was found unreachable when the handoff started.
        why_lost = cause or LostCause.UNREACHABLE
        for role in sorted(roles, key=lambda r: r.value, reverse=True):
            if entry.core.phase is not Phase.COMPLETE:
                log.debug(
                    "engine %s lost as %s",
                    engine_id,
                    role.value,
                    extra={"handoff_id": entry.handoff_id},
                )
                why = EndReason(EndCause.ENGINE_LOST, role, engine_id, why_lost)
                self._server_fact(entry, EngineLost(role), why)

    def _forsake(self, entry: Entry, role: Role) -> None:
        """Nothing for ``role`` is owed to its engine any more (it was lost)."""
        if entry.abandoned_at is None and entry.core.phase is not Phase.COMPLETE:
            self.delivery.forsake(entry.handoff_id, role, entry.engine_for(role)[0])

    # --- cleanup --------------------------------------------------------------

    def _redeliver_cleanup(self, entry: Entry, now: float) -> None:
        for action_id, (_, kind, engines) in entry.routed.items():
            if kind in CLEANUP_KINDS:
                self.delivery.redeliver(entry.handoff_id, action_id, engines)
        entry.redelivery_round += 1
        delay = min(
            self.settings.cleanup_redelivery_s * 2**entry.redelivery_round, MAX_REDELIVERY_DELAY_S
        )
        self._schedule(
            now + delay,
            TimerKind.REDELIVER,
            entry.handoff_id,
            (entry.cleanup_epoch, entry.redelivery_round),
        )

    def _redelivered(self, dispatch: Dispatch) -> None:
        """An unacknowledged action goes out again."""
        entry = self._find(dispatch.handoff_id)
        if entry is not None:
            self.tracer.redelivered(entry, dispatch)

    def _abandon(self, entry: Entry, now: float) -> None:
        left = [
            f"{kind.value}#{action_id} to {engine_id}"
            for action_id, (_, kind, engines) in entry.routed.items()
            for engine_id in engines
        ]
        self._abandoned.note(
            now,
            entry.handoff_id,
            "abandoning handoff still cleaning up after %.0f s; outstanding: %s",
            self.settings.cleanup_timeout_s,
            ", ".join(left) or "none",
            handoff_id=entry.handoff_id,
        )
        self.metrics.abandoned.inc()
        self.tracer.abandoned(entry, now)
        self.metrics.handoffs_by[entry.core.phase].dec()
        # Kept while retained, so GetHandoff answers what happened; nothing
        # of it is delivered or redelivered any more.
        for action_id, (_, _, engines) in entry.routed.items():
            self.delivery.drop(entry.handoff_id, action_id, engines)
        self.delivery.disengage(entry.handoff_id, entry.engines)
        entry.abandoned_at = now
        self.recorder.abandoned(entry.handoff_id, now)
        self.retention.keep(entry)
        self._finished(entry.handoff_id)

    def abandon(self, handoff_id: str) -> None:
        """Abandon a handoff still cleaning up now, as its cleanup timer would
        (recovery replays an abandonment with it)."""
        entry = self._table[handoff_id]
        assert isinstance(entry, Entry), "only a handoff still cleaning up is abandoned"
        self._abandon(entry, self.clock())

    def defer_abandonment(self, not_before: float) -> None:
        """Abandon no handoff still cleaning up before ``not_before``, keeping
        later times. Recovery sets it: cleanup timeouts ran on while the server
        was down, and an engine that owes a cleanup gets the chance to come
        back and report it (or be lost, which settles it) before its handoff
        is given up."""
        self._timers.defer(TimerKind.ABANDON, not_before)

    def adopt(
        self,
        entry: Entry,
        written: Iterable[Dispatch],
        reached: Iterable[tuple[str, Role]],
        cleaning_since: float | None,
    ) -> None:
        """Take in an unfinished handoff rebuilt from its journal records
        (recovery, rebuild.py) as this call path would have left it: its
        deadline timer while active, or its cleanup's timers from when cleanup
        began; its outstanding actions ``written`` once to their engines, and
        the (engine, role) pairs its actions ``reached``."""
        handoff_id = entry.handoff_id
        assert handoff_id not in self._table, "recovery adopts each handoff once"
        self._table[handoff_id] = entry
        if entry.core.phase is Phase.ACTIVE:
            self._schedule(entry.deadline, TimerKind.DEADLINE, handoff_id, entry.deadline)
        else:
            assert cleaning_since is not None, "a handoff cleaning up began cleaning up"
            self._begin_cleanup(entry, cleaning_since)
        self.delivery.adopt(handoff_id, entry.engines, written, reached)

    def restore(self, retained: Retained) -> bool:
        """Keep a completed handoff as a journal snapshot brought it back
        (recovery); False if its id is taken, and nothing changed."""
        if retained.handoff_id in self._table:
            return False
        self.metrics.handoffs_by[Phase.COMPLETE].inc()
        self.retention.keep(retained)
        return True

    def _forgotten(self, handoff_id: str) -> None:
        self.recorder.drop(handoff_id)

    def _drop_routed(self, entry: Entry) -> None:
        for action_id, (_, _, engines) in entry.routed.items():
            self.delivery.drop(entry.handoff_id, action_id, engines)
        entry.routed.clear()
        self.delivery.disengage(entry.handoff_id, entry.engines)

    def _finished(self, handoff_id: str) -> None:
        for finished in self._on_finished:
            finished(handoff_id)
        if self.active_count == 0:
            for callback in self._on_idle:
                callback()

    # --- retention -----------------------------------------------------------

    def _unpacked(self, handoff_id: str) -> Entry:
        """The handoff as an Entry a call can run on; a retained one stays
        retained unless the call reopens it (see _after_transition)."""
        entry = self.get(handoff_id)
        if isinstance(entry, Retained):
            return entry.unpack()
        if entry.abandoned_at is not None:
            raise NotFound(
                "abandoned: still cleaning up after cleanup_timeout; GetHandoff shows "
                "what was left outstanding"
            )
        return entry


ENGINE_TIMERS = frozenset({TimerKind.UNREACHABLE, TimerKind.FORGET})


def _engine_of(entry: Entry | Retained, role: Role) -> str:
    return entry.source_engine_id if role is Role.SOURCE else entry.destination_engine_id


def _same_start(known: Entry | Retained, request: StartRequest, timeout_s: float) -> None:
    """A StartHandoff for a known id is a retry only if every parameter matches."""
    fields = (
        ("order", known.core.order.value, request.order.value),
        ("source_engine_id", known.source_engine_id, request.source_engine_id),
        ("destination_engine_id", known.destination_engine_id, request.destination_engine_id),
        (
            "fallback_transfer_delay_ms",
            known.core.fallback_transfer_delay_ms,
            request.fallback_transfer_delay_ms,
        ),
        ("transfer_executor", known.transfer_executor.value, request.transfer_executor.value),
        ("timeout_s", known.timeout_s, timeout_s),
    )
    for name, then, now in fields:
        if then != now:
            raise AlreadyExists(
                f"this id was already started with another {name} ({then!r}, now {now!r}); "
                "a retry must repeat the original request"
            )
