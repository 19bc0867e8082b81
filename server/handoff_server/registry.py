"""The registry: the handoff table, the one path every call takes, timers and retention.

Synchronous and clock-injected: it never sleeps and never awaits. The gRPC
layer calls it, and calls :meth:`Registry.fire_due` when
:meth:`Registry.next_wakeup` says so; tests do the same with a fake clock and
no waiting at all. What happens to an action between its issue and its
acknowledgement (queues, streams, incarnations) is :mod:`handoff_server.delivery`'s.

Every call is atomic where the core is concerned: a call the core rejects,
or one that crashes inside the core, leaves the handoff exactly as it was.
The registry's own bookkeeping after the core accepted a call (routing,
timers, metrics) does not fail on valid state; a bug there is logged and
answered INTERNAL, and is not undone. What the server does on its own after a
call (an engine lost, a cleanup action settled for an engine that never
received anything) runs as calls of its own once the first is done.
"""

from __future__ import annotations

import functools
import itertools
import logging
import sys
from array import array
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import ClassVar

from handoff_server.config import Settings
from handoff_server.core import Completed, Handoff
from handoff_server.delivery import ROLE_OF, Delivery, Dispatch, Role, Subscription
from handoff_server.metrics import Metrics
from handoff_server.model import (
    CLEANUP_KINDS,
    Action,
    ActionKind,
    AlreadyExists,
    Canceled,
    Completion,
    EngineLost,
    Fact,
    HandoffError,
    Internal,
    LifecycleEvent,
    NotFound,
    Order,
    Outcome,
    OutcomeKind,
    Phase,
    ResourceExhausted,
    Side,
    TimedOut,
    Unavailable,
)
from handoff_server.timers import Timer, TimerHeap, TimerKind

log = logging.getLogger("handoff.registry")

Clock = Callable[[], float]  # seconds since the Unix epoch, never going backwards

MAX_REDELIVERY_DELAY_S = 30.0
MAX_EXTENSION_S = 365 * 24 * 3600.0
FACT_KIND = {
    "SourceHeld": "source_held",
    "DestinationReserved": "destination_reserved",
    "TransferCompleted": "transfer_completed",
    "Failed": "failed",
    "TimedOut": "timed_out",
    "Canceled": "canceled",
    "EngineLost": "engine_lost",
}
SIDE_OF = {Role.SOURCE: Side.SOURCE, Role.DESTINATION: Side.DESTINATION}
ROLE_OF_SIDE = {side: role for role, side in SIDE_OF.items()}
NOOP = Outcome(OutcomeKind.NOOP)


@dataclass(frozen=True, slots=True)
class StartRequest:
    handoff_id: str
    order: Order
    source_engine_id: str
    destination_engine_id: str
    fallback_transfer_delay_ms: float
    transfer_executor: Role = Role.SOURCE
    timeout_s: float | None = None


Routed = tuple[float, ActionKind, tuple[str, ...]]  # issued at, kind, engines it went to


class Entry:
    """A handoff in full: its core and what the registry knows beyond it.

    Unfinished handoffs are kept as these, and so are abandoned ones while
    retained (rare, and shown with what was left outstanding); completed
    ones are packed (Retained).
    """

    __slots__ = (
        "core",
        "source_engine_id",
        "destination_engine_id",
        "transfer_executor",
        "timeout_s",
        "started_at",
        "deadline",
        "completed_at",
        "abandoned_at",
        "lifecycle_at",
        "routed",
        "held_at",
        "cleanup_epoch",
        "redelivery_round",
        "encoding",
    )

    def __init__(
        self,
        core: Handoff,
        source_engine_id: str,
        destination_engine_id: str,
        transfer_executor: Role,
        timeout_s: float,
        started_at: float,
        deadline: float,
    ) -> None:
        self.core = core
        self.source_engine_id = source_engine_id
        self.destination_engine_id = destination_engine_id
        self.transfer_executor = transfer_executor
        self.timeout_s = timeout_s
        self.started_at = started_at
        self.deadline = deadline
        self.completed_at: float | None = None
        self.abandoned_at: float | None = None
        self.lifecycle_at: list[float] = []  # when each core.lifecycle event was proven
        self.routed: dict[int, Routed] = {}  # outstanding actions by id
        self.held_at: float | None = None
        # Renewed each time cleanup (re)starts, from the registry-wide counter:
        # it stales the timers of an earlier cleanup, even one of an earlier
        # handoff under the same id (evicted or expired, then reused).
        self.cleanup_epoch = 0
        self.redelivery_round = 0
        # Kept by convert.handoff, opaque here: the answer's encoding so far,
        # so that answering a report encodes only what the report changed.
        self.encoding: object = None

    @property
    def handoff_id(self) -> str:
        return self.core.handoff_id

    @property
    def ended_at(self) -> float | None:
        """When it was abandoned (the only Entry kept in retention)."""
        return self.abandoned_at

    @property
    def engines(self) -> set[str]:
        return {self.source_engine_id, self.destination_engine_id}

    def engine_for(self, role: Role) -> tuple[str, ...]:
        if role is Role.SOURCE:
            return (self.source_engine_id,)
        if role is Role.DESTINATION:
            return (self.destination_engine_id,)
        if self.source_engine_id == self.destination_engine_id:
            return (self.source_engine_id,)
        return (self.source_engine_id, self.destination_engine_id)

    def roles_of(self, engine_id: str) -> list[Role]:
        """The sides ``engine_id`` plays in this handoff (both if it is its own decode)."""
        return [r for r in (Role.SOURCE, Role.DESTINATION) if self.engine_for(r)[0] == engine_id]

    def role_of(self, kind: ActionKind) -> Role:
        return self.transfer_executor if kind is ActionKind.START_TRANSFER else ROLE_OF[kind]


class Retained:
    """A completed handoff, kept for late reports, GetHandoff and id reuse checks.

    Up to max_retained of these live for retention_s each, so a retained
    handoff keeps a packed core, names shared with every other handoff of its
    engines, and its times as one bytes object: about a fifth of an Entry. A
    call that reaches it runs on an unpacked Entry (see unpack).
    """

    __slots__ = ("core", "source_engine_id", "destination_engine_id", "transfer_executor", "_times")

    # Nothing is outstanding once complete; read by security.authorize_report.
    routed: ClassVar[Mapping[int, Routed]] = MappingProxyType({})
    abandoned_at: ClassVar[None] = None

    def __init__(self, entry: Entry) -> None:
        assert entry.completed_at is not None
        self.core: Completed = entry.core.pack()
        self.source_engine_id = entry.source_engine_id
        self.destination_engine_id = entry.destination_engine_id
        self.transfer_executor = entry.transfer_executor
        times = (
            entry.started_at,
            entry.deadline,
            entry.completed_at,
            entry.timeout_s,
            *entry.lifecycle_at,
        )
        self._times = array("d", times).tobytes()

    @property
    def handoff_id(self) -> str:
        return self.core.handoff_id

    @property
    def started_at(self) -> float:
        return array("d", self._times)[0]

    @property
    def deadline(self) -> float:
        return array("d", self._times)[1]

    @property
    def completed_at(self) -> float:
        return array("d", self._times)[2]

    @property
    def timeout_s(self) -> float:
        return array("d", self._times)[3]

    @property
    def ended_at(self) -> float:
        return self.completed_at

    @property
    def lifecycle_at(self) -> list[float]:
        return array("d", self._times)[4:].tolist()

    def unpack(self) -> Entry:
        """The full Entry again, for a call that may change the handoff."""
        entry = Entry(
            self.core.unpack(),
            self.source_engine_id,
            self.destination_engine_id,
            self.transfer_executor,
            self.timeout_s,
            self.started_at,
            self.deadline,
        )
        entry.completed_at = self.completed_at
        entry.lifecycle_at = self.lifecycle_at
        return entry


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
    ) -> None:
        self.settings = settings
        self.metrics = metrics
        self.clock = clock
        self._on_earlier_timer = on_earlier_timer
        self._on_idle: list[Callable[[], None]] = []
        self.handoffs: dict[str, Entry | Retained] = {}
        # Oldest first: completed (Retained) and abandoned (Entry) handoffs. A
        # record stays here when its handoff is reopened (it is skipped once
        # it reaches the front), so leaving costs nothing.
        self._retained: deque[Entry | Retained] = deque()
        self._retained_count = 0
        self._timers = TimerHeap(self._timer_is_live)
        self.delivery = Delivery(settings, metrics, clock, self._schedule)
        # What the server does on its own after a call, each a call of its own.
        self._follow_ups: deque[Callable[[], None]] = deque()
        self._following_up = False
        self._epochs = itertools.count(1)
        self.draining = False

    # --- queries ------------------------------------------------------------

    @property
    def active_count(self) -> int:
        """Handoffs not complete: active or cleaning up."""
        return len(self.handoffs) - self._retained_count

    def get(self, handoff_id: str) -> Entry | Retained:
        entry = self.handoffs.get(handoff_id)
        if entry is None:
            raise NotFound("no such handoff (never started, or no longer retained)")
        return entry

    def next_wakeup(self) -> float | None:
        candidates = [t for t in (self._timers.next_at(), self._next_expiry()) if t is not None]
        return min(candidates, default=None)

    def on_idle(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` whenever the number of unfinished handoffs drops to zero."""
        self._on_idle.append(callback)

    # --- calls ------------------------------------------------------------

    def start(self, request: StartRequest) -> CallResult:
        now = self.clock()
        self._expire_retained(now)
        timeout = (
            self.settings.default_timeout_s if request.timeout_s is None else request.timeout_s
        )
        known = self.handoffs.get(request.handoff_id)
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
        core = Handoff(request.handoff_id, request.order, request.fallback_transfer_delay_ms)
        # Interned: every request parses its own copy of its engines' names,
        # and a retained handoff would otherwise keep both for retention_s.
        entry = Entry(
            core,
            sys.intern(request.source_engine_id),
            sys.intern(request.destination_engine_id),
            request.transfer_executor,
            timeout,
            now,
            now + timeout,
        )
        self.handoffs[request.handoff_id] = entry
        self.metrics.started.inc()
        self.metrics.handoffs_by[Phase.ACTIVE].inc()
        self._schedule(entry.deadline, TimerKind.DEADLINE, request.handoff_id, entry.deadline)
        self._engage(entry, now)
        return CallResult(entry, self._call(entry, Handoff.start))

    def report_fact(self, handoff_id: str, fact: Fact, origin: str = "engine") -> CallResult:
        entry = self._unpacked(handoff_id)
        dispatches = self._call(entry, lambda core: core.apply_fact(fact))
        self.metrics.facts_by[(FACT_KIND[type(fact).__name__], origin)].inc()
        if isinstance(fact, EngineLost):
            self._forsake(entry, ROLE_OF_SIDE[fact.role])
        return CallResult(entry, dispatches)

    def report_outcome(self, handoff_id: str, action_id: int, outcome: Outcome) -> CallResult:
        entry = self._unpacked(handoff_id)
        acknowledging = entry.core.is_outstanding(action_id)
        dispatches = self._call(
            entry,
            lambda core: core.apply_outcome(action_id, outcome),
            acknowledged=(action_id, outcome) if acknowledging else None,
        )
        return CallResult(entry, dispatches)

    def cancel_active(self, reason: str) -> int:
        """Report Canceled on every ACTIVE handoff (shutdown); how many there were."""
        active = [
            e
            for e in self.handoffs.values()
            if isinstance(e, Entry) and e.core.phase is Phase.ACTIVE
        ]
        for entry in active:
            log.warning("canceling handoff: %s", reason, extra={"handoff_id": entry.handoff_id})
            self._server_fact(entry, Canceled())
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
            self._lose(engine_id, lost, cause="restarted")
        return subscription

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
        self._expire_retained(now)
        self._timers.compact(self._live_timers_bound())

    def _fire(self, timer: Timer, now: float) -> None:
        """What each kind of timer does: the one place they are told apart."""
        kind, key = timer.kind, timer.key
        if kind is TimerKind.UNREACHABLE:
            self._engine_unreachable(key)
        elif kind is TimerKind.FORGET:
            self.delivery.forget(key)
        else:
            entry = self.handoffs[key]
            assert isinstance(entry, Entry), "only unfinished handoffs have live timers"
            if kind is TimerKind.DEADLINE:
                log.warning("handoff deadline passed", extra={"handoff_id": key})
                self.metrics.timed_out.inc()
                self._server_fact(entry, TimedOut())
            elif kind is TimerKind.REDELIVER:
                self._redeliver_cleanup(entry, now)
            else:
                assert kind is TimerKind.ABANDON
                self._abandon(entry, now)

    def _timer_is_live(self, timer: Timer) -> bool:
        kind = timer.kind
        if kind in ENGINE_TIMERS:
            return self.delivery.timer_is_live(timer)
        entry = self.handoffs.get(timer.key)
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
        call: Callable[[Handoff], tuple[Action, ...]],
        acknowledged: tuple[int, Outcome] | None = None,
    ) -> tuple[Dispatch, ...]:
        core = entry.core
        checkpoint = core.checkpoint()
        phase_before, completion_before = core.phase, core.completion
        events_before = len(entry.lifecycle_at)
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
        now = self.clock()
        if acknowledged is not None:
            self._acknowledge(entry, *acknowledged, now)
        self._stamp_lifecycle(entry, events_before, now)
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
        issued_at, kind, engines = entry.routed.pop(action_id)
        self.metrics.outcomes_by[outcome.kind].inc()
        self.metrics.latency_by[kind].observe(now - issued_at)
        if (
            kind in (ActionKind.RELEASE_SOURCE, ActionKind.CANCEL_SOURCE)
            and outcome.kind is not OutcomeKind.FAILED
            and entry.held_at is not None
        ):
            self.metrics.source_hold.observe(now - entry.held_at)
            entry.held_at = None
        self.delivery.acknowledge(entry.handoff_id, action_id, engines)

    def _stamp_lifecycle(self, entry: Entry, events_before: int, now: float) -> None:
        lifecycle = entry.core.lifecycle
        for event in lifecycle[events_before:]:
            entry.lifecycle_at.append(now)
            if event is LifecycleEvent.SOURCE_HELD:
                entry.held_at = now

    def _route(self, entry: Entry, action: Action, now: float) -> Dispatch:
        self.metrics.actions_by[action.kind].inc()
        role = entry.role_of(action.kind)
        engines = entry.engine_for(role)
        if action.kind is ActionKind.START_TRANSFER and action.delay_ms is not None:
            # The transfer's own duration is not the handoff's fault. A finite
            # but absurd delay is capped so the deadline stays a real date.
            entry.deadline = min(entry.deadline + action.delay_ms / 1000.0, now + MAX_EXTENSION_S)
            self._schedule(entry.deadline, TimerKind.DEADLINE, entry.handoff_id, entry.deadline)
        if action.kind is not ActionKind.COMPLETE:
            entry.routed[action.id] = (now, action.kind, engines)
        if (
            action.kind in CLEANUP_KINDS
            and entry.completed_at is None  # a success being reopened reached both sides
            and not self.delivery.reached(entry.handoff_id, role, engines[0])
        ):
            self._settle(entry, action, role, engines[0])
        else:
            self.delivery.send(entry.handoff_id, action, role, engines)
        # In a call's answer, a notice to both engines names neither.
        return Dispatch(entry.handoff_id, action, role, engines[0] if len(engines) == 1 else "")

    def _settle(self, entry: Entry, action: Action, role: Role, engine_id: str) -> None:
        """A cleanup action for a side none of whose actions reached its engine:
        there is nothing to free. Its queued actions are never sent, and the
        server reports the cleanup's outcome NOOP itself, rather than owe it."""
        self.delivery.forsake(entry.handoff_id, role, engine_id)
        handoff_id, action_id = entry.handoff_id, action.id

        def settle() -> None:
            settled = self.handoffs.get(handoff_id)
            if isinstance(settled, Entry) and settled.core.is_outstanding(action_id):
                log.info(
                    "%s#%d settled by the server: nothing was ever sent to engine %s",
                    action.kind.value,
                    action_id,
                    engine_id,
                    extra={"handoff_id": handoff_id},
                )
                self._call(
                    settled,
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
            self.handoffs[entry.handoff_id] = entry
            self._retained_count -= 1
            # A success was acknowledged by both sides: both were reached.
            self.delivery.engage(
                entry.handoff_id, entry.engines, reached=(Role.SOURCE, Role.DESTINATION)
            )
            log.info("successful handoff reopened", extra={"handoff_id": entry.handoff_id})
        if phase is Phase.CLEANING_UP:
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
        elif phase is Phase.COMPLETE:
            completion = entry.core.completion
            assert completion is not None
            entry.completed_at = now
            self.metrics.completed_by[completion].inc()
            self.metrics.duration_by[completion].observe(now - entry.started_at)
            # The core forgot its journal: nothing is outstanding any more.
            self._drop_routed(entry)
            self._retain(Retained(entry))
            log.info(
                "handoff complete: %s", completion.value, extra={"handoff_id": entry.handoff_id}
            )
            self._check_idle()

    def _server_fact(self, entry: Entry, fact: Fact) -> None:
        """A fact the server observed itself: a deadline, a lost engine, shutdown."""
        self._call(entry, lambda core: core.apply_fact(fact))
        self.metrics.facts_by[(FACT_KIND[type(fact).__name__], "server")].inc()
        if isinstance(fact, EngineLost):
            self._forsake(entry, ROLE_OF_SIDE[fact.role])

    # --- lost engines ---------------------------------------------------------

    def _engage(self, entry: Entry, now: float) -> None:
        """Tie a handoff to its engines; one already unreachable loses it at once."""
        self.delivery.engage(entry.handoff_id, entry.engines)
        for engine_id in entry.engines:
            if self.delivery.unreachable(engine_id, now):
                lost = {entry.handoff_id: set(entry.roles_of(engine_id))}
                self._follow_ups.append(functools.partial(self._lose, engine_id, lost, None))

    def _engine_unreachable(self, engine_id: str) -> None:
        handoffs = self.delivery.handoffs_of(engine_id)
        lost: dict[str, set[Role]] = {}
        for handoff_id in handoffs:
            entry = self.handoffs.get(handoff_id)
            if isinstance(entry, Entry):
                lost[handoff_id] = set(entry.roles_of(engine_id))
        self._lose(engine_id, lost, cause="unreachable")

    def _lose(self, engine_id: str, lost: dict[str, set[Role]], cause: str | None) -> None:
        """Report EngineLost for ``engine_id``'s roles in each unfinished handoff of
        ``lost``; ``cause`` counts it (None: the engine was counted already)."""
        affected = [
            entry
            for handoff_id in sorted(lost)
            if isinstance(entry := self.handoffs.get(handoff_id), Entry)
            and entry.abandoned_at is None
            and entry.core.phase is not Phase.COMPLETE
        ]
        if not affected:
            return
        if cause is not None:
            self.metrics.engines_lost_by[cause].inc()
            log.warning(
                "engine lost (%s): reporting EngineLost in its %d unfinished handoffs",
                "restarted under a new incarnation"
                if cause == "restarted"
                else f"no live stream for {self.settings.delivery_timeout_s:.1f} s",
                len(affected),
                extra={"engine_id": engine_id},
            )
        for entry in affected:
            for role in sorted(lost[entry.handoff_id], key=lambda r: r.value, reverse=True):
                if entry.core.phase is not Phase.COMPLETE:
                    log.warning(
                        "engine %s lost as %s",
                        engine_id,
                        role.value,
                        extra={"handoff_id": entry.handoff_id},
                    )
                    self._server_fact(entry, EngineLost(SIDE_OF[role]))

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

    def _abandon(self, entry: Entry, now: float) -> None:
        left = [
            f"{kind.value}#{action_id} to {engine_id}"
            for action_id, (_, kind, engines) in entry.routed.items()
            for engine_id in engines
        ]
        log.error(
            "abandoning handoff still cleaning up after %.0f s; outstanding: %s",
            self.settings.cleanup_timeout_s,
            ", ".join(left) or "none",
            extra={"handoff_id": entry.handoff_id},
        )
        self.metrics.abandoned.inc()
        self.metrics.handoffs_by[entry.core.phase].dec()
        # Kept while retained, so GetHandoff answers what happened; nothing
        # of it is delivered or redelivered any more.
        for action_id, (_, _, engines) in entry.routed.items():
            self.delivery.drop(entry.handoff_id, action_id, engines)
        self.delivery.disengage(entry.handoff_id, entry.engines)
        entry.abandoned_at = now
        self._retain(entry)
        self._check_idle()

    def _drop_routed(self, entry: Entry) -> None:
        for action_id, (_, _, engines) in entry.routed.items():
            self.delivery.drop(entry.handoff_id, action_id, engines)
        entry.routed.clear()
        self.delivery.disengage(entry.handoff_id, entry.engines)

    def _check_idle(self) -> None:
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

    def _retain(self, record: Entry | Retained) -> None:
        self.handoffs[record.handoff_id] = record
        self._retained.append(record)
        self._retained_count += 1
        if self._retained_count == 1:
            # The first expiry may come before the timer loop's next wake-up
            # (a deadline hours away): without this the loop slept through
            # retention, and stale timers were never compacted meanwhile.
            self._on_earlier_timer()
        while self._retained_count > self.settings.max_retained:
            self._forget_oldest()

    def _oldest(self) -> Entry | Retained | None:
        """The oldest retained handoff, dropping records of reopened ones on the way."""
        retained = self._retained
        while retained:
            record = retained[0]
            if self.handoffs.get(record.handoff_id) is record:
                return record
            retained.popleft()
        return None

    def _forget_oldest(self) -> None:
        oldest = self._oldest()
        assert oldest is not None
        self._retained.popleft()
        del self.handoffs[oldest.handoff_id]
        self._retained_count -= 1
        if isinstance(oldest, Retained):
            self.metrics.handoffs_by[Phase.COMPLETE].dec()

    def _next_expiry(self) -> float | None:
        # Completion times never decrease, so neither do expiries: the
        # oldest record expires first.
        oldest = self._oldest()
        ended = None if oldest is None else oldest.ended_at
        return None if ended is None else ended + self.settings.retention_s

    def _expire_retained(self, now: float) -> None:
        while (expiry := self._next_expiry()) is not None and expiry <= now:
            self._forget_oldest()


ENGINE_TIMERS = frozenset({TimerKind.UNREACHABLE, TimerKind.FORGET})


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
