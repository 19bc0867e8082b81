"""The registry: one core per handoff id, delivery to engines, timers, limits.

Synchronous and clock-injected: it never sleeps and never awaits. The gRPC
layer calls it, awaits the delivery hooks it exposes, and calls
:meth:`Registry.fire_due` when :meth:`Registry.next_wakeup` says so; tests do
the same with a fake clock and no waiting at all.
"""

from __future__ import annotations

import enum
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
from handoff_server.core import Handoff
from handoff_server.logs import BurstLog
from handoff_server.metrics import Metrics
from handoff_server.model import (
    CLEANUP_KINDS,
    Action,
    ActionKind,
    AlreadyExists,
    Canceled,
    Completion,
    Fact,
    Failed,
    HandoffError,
    Internal,
    LifecycleEvent,
    NotFound,
    Order,
    Outcome,
    OutcomeKind,
    Phase,
    ResourceExhausted,
    TimedOut,
    Unavailable,
)
from handoff_server.packing import Completed, pack
from handoff_server.timers import Timer, TimerHeap
from handoff_server.tracing import OFF, Tracer

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


class Role(enum.Enum):
    # Identity hashing in C, as for ActionKind: Enum's default hashes the name
    # in Python, and roles are looked up on every action converted.
    __hash__ = object.__hash__

    SOURCE = "source"
    DESTINATION = "destination"
    BOTH = "both"  # Complete: a notice to both engines


# Who executes each action; START_TRANSFER goes to the handoff's executor.
ROLE_OF: dict[ActionKind, Role] = {
    ActionKind.SUBMIT_PREFILL: Role.SOURCE,
    ActionKind.RELEASE_SOURCE: Role.SOURCE,
    ActionKind.CANCEL_SOURCE: Role.SOURCE,
    ActionKind.RESERVE_DESTINATION: Role.DESTINATION,
    ActionKind.ACTIVATE_DESTINATION: Role.DESTINATION,
    ActionKind.CANCEL_DESTINATION: Role.DESTINATION,
    ActionKind.COMPLETE: Role.BOTH,
}


@dataclass(frozen=True, slots=True)
class StartRequest:
    handoff_id: str
    order: Order
    source_engine_id: str
    destination_engine_id: str
    fallback_transfer_delay_ms: float
    transfer_executor: Role = Role.SOURCE
    timeout_s: float | None = None
    traceparent: str = ""  # the caller's W3C trace context, from StartHandoff's metadata
    tracestate: str = ""


@dataclass(frozen=True, slots=True)
class Dispatch:
    """One action addressed to one engine; attempt counts writes to its streams."""

    handoff_id: str
    action: Action
    target: Role
    engine_id: str
    attempt: int = 0
    trace: tuple[str, str] | None = None  # the action span's traceparent and tracestate


Routed = tuple[float, ActionKind, tuple[str, ...]]  # issued at, kind, engines it went to


class Entry:
    """A handoff in full: its core and what the registry knows beyond it.

    Unfinished handoffs are kept as these; completed ones are packed (Retained).
    """

    __slots__ = (
        "core",
        "source_engine_id",
        "destination_engine_id",
        "transfer_executor",
        "started_at",
        "deadline",
        "completed_at",
        "lifecycle_at",
        "routed",
        "held_at",
        "cleanup_epoch",
        "redelivery_round",
        "encoding",
        "trace",
    )

    def __init__(
        self,
        core: Handoff,
        source_engine_id: str,
        destination_engine_id: str,
        transfer_executor: Role,
        started_at: float,
        deadline: float,
    ) -> None:
        self.core = core
        self.source_engine_id = source_engine_id
        self.destination_engine_id = destination_engine_id
        self.transfer_executor = transfer_executor
        self.started_at = started_at
        self.deadline = deadline
        self.completed_at: float | None = None
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
        self.trace: object = None  # tracing.HandoffTrace when tracing is on

    @property
    def handoff_id(self) -> str:
        return self.core.handoff_id

    def engine_for(self, role: Role) -> tuple[str, ...]:
        if role is Role.SOURCE:
            return (self.source_engine_id,)
        if role is Role.DESTINATION:
            return (self.destination_engine_id,)
        if self.source_engine_id == self.destination_engine_id:
            return (self.source_engine_id,)
        return (self.source_engine_id, self.destination_engine_id)

    def role_of(self, kind: ActionKind) -> Role:
        return self.transfer_executor if kind is ActionKind.START_TRANSFER else ROLE_OF[kind]


class Retained:
    """A completed handoff, kept for late reports, GetHandoff and id reuse checks.

    Up to max_retained of these live for retention_s each, so a retained
    handoff keeps a packed core, names shared with every other handoff of its
    engines, and its timestamps as one bytes object: about a fifth of an
    Entry. A call that reaches it runs on an unpacked Entry (see unpack).
    """

    __slots__ = (
        "core",
        "source_engine_id",
        "destination_engine_id",
        "transfer_executor",
        "trace",
        "_times",
    )

    # Nothing is outstanding once complete; read by security.authorize_report.
    routed: ClassVar[Mapping[int, Routed]] = MappingProxyType({})

    def __init__(self, entry: Entry) -> None:
        assert entry.completed_at is not None
        self.core: Completed = pack(entry.core)
        self.source_engine_id = entry.source_engine_id
        self.destination_engine_id = entry.destination_engine_id
        self.transfer_executor = entry.transfer_executor
        self.trace = entry.trace
        times = (entry.started_at, entry.deadline, entry.completed_at, *entry.lifecycle_at)
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
    def lifecycle_at(self) -> list[float]:
        return array("d", self._times)[3:].tolist()

    def unpack(self) -> Entry:
        """The full Entry again, for a call that may change the handoff."""
        entry = Entry(
            self.core.unpack(),
            self.source_engine_id,
            self.destination_engine_id,
            self.transfer_executor,
            self.started_at,
            self.deadline,
        )
        entry.completed_at = self.completed_at
        entry.lifecycle_at = self.lifecycle_at
        entry.trace = self.trace
        return entry


@dataclass(frozen=True, slots=True)
class CallResult:
    entry: Entry
    actions: tuple[Dispatch, ...]


class Subscription:
    """One live engine stream. ``on_ready`` is called when there is work to take."""

    __slots__ = ("engine_id", "on_ready", "closed")

    def __init__(self, engine_id: str, on_ready: Callable[[], None]) -> None:
        self.engine_id = engine_id
        self.on_ready = on_ready
        self.closed = False


class EngineChannel:
    __slots__ = (
        "engine_id",
        "queue",
        "unacked",
        "handoffs",
        "subscription",
        "epoch",
        "offline_since",
    )

    def __init__(self, engine_id: str, now: float, epoch: int) -> None:
        self.engine_id = engine_id
        # Waiting to be written, in order. Keyed (handoff id, action id).
        self.queue: dict[tuple[str, int], Dispatch] = {}
        # Every outstanding action of this engine, written or not (never Complete).
        self.unacked: dict[tuple[str, int], Dispatch] = {}
        # Unfinished handoffs naming this engine. They fail when it goes
        # unreachable even if it owes no action: a prefill that died while
        # running would otherwise hold its decode's memory until the deadline.
        self.handoffs: set[str] = set()
        self.subscription: Subscription | None = None
        # Renewed on every (un)subscribe from a registry-wide counter, so a
        # timer armed for an earlier stream, or a forgotten channel, never fires.
        self.epoch = epoch
        self.offline_since: float | None = now

    def notify(self) -> None:
        if self.subscription is not None:
            self.subscription.on_ready()

    def unreachable(self, now: float, delivery_timeout_s: float) -> bool:
        return self.offline_since is not None and now - self.offline_since >= delivery_timeout_s


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
        self.handoffs: dict[str, Entry | Retained] = {}
        # Oldest first. A record stays here when its handoff is reopened (it is
        # skipped once it reaches the front), so leaving costs nothing.
        self._retained: deque[Retained] = deque()
        self._retained_count = 0
        self._channels: dict[str, EngineChannel] = {}
        self._timers = TimerHeap(self._timer_is_live)
        self._doomed: dict[str, None] = {}  # handoffs routed to an unreachable engine
        self._epochs = itertools.count()
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
        candidates = [
            t
            for t in (self._timers.next_at(), self._next_expiry(), self._abandoned.due())
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
        if self.draining:
            raise Unavailable("the server is shutting down and takes no new handoffs")
        self._expire_retained(self.clock())
        if request.handoff_id in self.handoffs:
            raise AlreadyExists("this id is already in use (active or retained)")
        if self.active_count >= self.settings.max_active_handoffs:
            raise ResourceExhausted(
                f"{self.active_count} handoffs are active, the limit is "
                f"{self.settings.max_active_handoffs}"
            )
        for engine_id in {request.source_engine_id, request.destination_engine_id}:
            channel = self._channels.get(engine_id)
            if channel and len(channel.queue) >= self.settings.max_queued_actions_per_engine:
                raise ResourceExhausted(
                    f"engine {engine_id} has {len(channel.queue)} undelivered actions, the limit "
                    f"is {self.settings.max_queued_actions_per_engine}"
                )
        core = Handoff(request.handoff_id, request.order, request.fallback_transfer_delay_ms)
        now = self.clock()
        timeout = (
            self.settings.default_timeout_s if request.timeout_s is None else request.timeout_s
        )
        # Interned: every request parses its own copy of its engines' names,
        # and a retained handoff would otherwise keep both for retention_s.
        entry = Entry(
            core,
            sys.intern(request.source_engine_id),
            sys.intern(request.destination_engine_id),
            request.transfer_executor,
            now,
            now + timeout,
        )
        self.handoffs[request.handoff_id] = entry
        self.metrics.started.inc()
        self.metrics.handoffs_by[Phase.ACTIVE].inc()
        self._schedule(entry.deadline, ("deadline", request.handoff_id), entry.deadline)
        self._engage(entry, now)
        if self.tracer.on:
            self.tracer.started(entry, request.traceparent, request.tracestate, now)
        return CallResult(entry, self._call(entry, Handoff.start))

    def report_fact(self, handoff_id: str, fact: Fact, origin: str = "engine") -> CallResult:
        entry = self._unpacked(handoff_id)
        dispatches = self._call(entry, lambda core: core.apply_fact(fact), fact=(fact, origin))
        self.metrics.facts_by[(FACT_KIND[type(fact).__name__], origin)].inc()
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

    def subscribe(self, engine_id: str, on_ready: Callable[[], None]) -> Subscription:
        """A new live stream for ``engine_id``; it replaces any previous one."""
        channel = self._channel(engine_id)
        previous = channel.subscription
        if previous is not None:
            previous.closed = True
            previous.on_ready()  # wakes it so it sees it is closed and ends
        else:
            self.metrics.engine_streams.inc()
        subscription = Subscription(engine_id, on_ready)
        channel.subscription = subscription
        channel.epoch = next(self._epochs)
        channel.offline_since = None
        # At least once: whatever was written to an earlier stream and not
        # acknowledged goes out again.
        for key, dispatch in channel.unacked.items():
            if key not in channel.queue and dispatch.attempt > 0:
                channel.queue[key] = dispatch
                self.metrics.redeliveries_by[dispatch.action.kind].inc()
                if self.tracer.on:
                    self.tracer.redelivered(self.handoffs[key[0]], dispatch)
        if channel.queue:
            on_ready()
        return subscription

    def close_streams(self) -> None:
        """End every live stream cleanly (shutdown); engines see a normal end."""
        for channel in self._channels.values():
            if channel.subscription is not None:
                channel.subscription.closed = True
                channel.subscription.on_ready()

    def unsubscribe(self, subscription: Subscription) -> None:
        channel = self._channels.get(subscription.engine_id)
        subscription.closed = True
        if channel is None or channel.subscription is not subscription:
            return  # already replaced
        channel.subscription = None
        self.metrics.engine_streams.dec()
        if not (channel.queue or channel.unacked or channel.handoffs):
            # Nothing hangs on it: forget it now, so that streams opened under
            # ever-new engine ids cannot pile up remembered channels.
            del self._channels[channel.engine_id]
            return
        now = self.clock()
        channel.epoch = next(self._epochs)
        channel.offline_since = now
        self._arm_offline_timers(channel, now)

    def take(self, subscription: Subscription, limit: int = 256) -> list[Dispatch] | None:
        """Pop up to ``limit`` dispatches to write; None once the stream was replaced."""
        if subscription.closed:
            return None
        channel = self._channels[subscription.engine_id]
        queue = channel.queue
        batch: list[Dispatch] = []
        while queue and len(batch) < limit:
            key = next(iter(queue))
            dispatch = queue.pop(key)
            # Built directly: dataclasses.replace introspects the fields on every call.
            dispatch = Dispatch(
                dispatch.handoff_id,
                dispatch.action,
                dispatch.target,
                dispatch.engine_id,
                dispatch.attempt + 1,
                dispatch.trace,
            )
            if dispatch.action.kind is not ActionKind.COMPLETE:
                channel.unacked[key] = dispatch
            batch.append(dispatch)
        return batch

    # --- time ---------------------------------------------------------------

    def fire_due(self) -> None:
        """Run every timer that is due now."""
        now = self.clock()
        for timer in self._timers.pop_due(now):
            kind, key = timer.key
            if kind == "unreachable":
                self._engine_unreachable(self._channels[key])
                continue
            if kind == "forget":
                self._forget_channel(self._channels[key], now)
                continue
            entry = self.handoffs[key]
            assert isinstance(entry, Entry), "only unfinished handoffs have live timers"
            if kind == "deadline":
                log.warning("handoff deadline passed", extra={"handoff_id": key})
                self.metrics.timed_out.inc()
                self._server_fact(entry, TimedOut())
            elif kind == "redeliver":
                self._redeliver_cleanup(entry, now)
            elif kind == "abandon":
                self._abandon(entry)
        self._expire_retained(now)
        self._abandoned.flush(now)
        self._timers.compact(self._live_timers_bound())

    def _live_timers_bound(self) -> int:
        """How many timers can matter: two per unfinished handoff (its deadline,
        or redelivery and abandonment) and two per engine channel. Retained
        handoffs have none, so their stale deadlines are not kept for them."""
        return 2 * self.active_count + 2 * len(self._channels)

    def _timer_is_live(self, timer: Timer) -> bool:
        kind, key = timer.key
        if kind in ("unreachable", "forget"):
            channel = self._channels.get(key)
            return (
                channel is not None
                and channel.epoch == timer.token
                and channel.subscription is None
            )
        entry = self.handoffs.get(key)
        if not isinstance(entry, Entry):
            return False  # gone, or retained: a completed handoff has no timers
        if kind == "deadline":
            return entry.deadline == timer.token and entry.core.phase is Phase.ACTIVE
        return entry.cleanup_epoch == timer.token and entry.core.phase is Phase.CLEANING_UP

    def _schedule(self, when: float, key: tuple[str, str], token: object) -> None:
        earliest = self._timers.next_at()
        self._timers.schedule(when, key, token)
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
        fact: tuple[Fact, str] | None = None,
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
        if self.tracer.on:
            self.tracer.called(entry, fact, phase_before, completion_before, now)
        dispatches = tuple(self._route(entry, action, now) for action in actions)
        self._after_transition(entry, phase_before, completion_before, now)
        self._fail_doomed()
        return dispatches

    def _acknowledge(self, entry: Entry, action_id: int, outcome: Outcome, now: float) -> None:
        issued_at, kind, engines = entry.routed.pop(action_id)
        self.metrics.outcomes_by[outcome.kind].inc()
        if self.tracer.on:
            attempts = self._attempts(entry.handoff_id, action_id, engines)
            self.tracer.outcome(entry, action_id, outcome, attempts, now)
            self.metrics.latency_by[kind].observe(now - issued_at, self.tracer.exemplar(entry))
        else:
            self.metrics.latency_by[kind].observe(now - issued_at)
        if (
            kind in (ActionKind.RELEASE_SOURCE, ActionKind.CANCEL_SOURCE)
            and outcome.kind is not OutcomeKind.FAILED
            and entry.held_at is not None
        ):
            self.metrics.source_hold.observe(now - entry.held_at)
            entry.held_at = None
        self._drop_deliveries(entry.handoff_id, action_id, engines)

    def _attempts(self, handoff_id: str, action_id: int, engines: tuple[str, ...]) -> int:
        """How many times an action was written to its engines' streams, at most."""
        key = (handoff_id, action_id)
        return max(
            (
                dispatch.attempt
                for engine_id in engines
                if (channel := self._channels.get(engine_id)) is not None
                and (dispatch := channel.unacked.get(key)) is not None
            ),
            default=0,
        )

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
            self._schedule(entry.deadline, ("deadline", entry.handoff_id), entry.deadline)
        if action.kind is not ActionKind.COMPLETE:
            entry.routed[action.id] = (now, action.kind, engines)
        trace = self.tracer.issued(entry, action, engines, now) if self.tracer.on else None
        for engine_id in engines:
            channel = self._channel(engine_id)
            dispatch = Dispatch(entry.handoff_id, action, role, engine_id, trace=trace)
            key = (entry.handoff_id, action.id)
            channel.queue[key] = dispatch
            if action.kind is not ActionKind.COMPLETE:
                channel.unacked[key] = dispatch
                if channel.unreachable(now, self.settings.delivery_timeout_s):
                    self._doomed[entry.handoff_id] = None
            channel.notify()
        # In a call's answer, a notice to both engines names neither.
        engine_id = engines[0] if len(engines) == 1 else ""
        return Dispatch(entry.handoff_id, action, role, engine_id, trace=trace)

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
            self._engage(entry, now)
            log.info("successful handoff reopened", extra={"handoff_id": entry.handoff_id})
        if phase is Phase.CLEANING_UP:
            entry.cleanup_epoch = next(self._epochs)
            entry.redelivery_round = 0
            key = entry.handoff_id
            self._schedule(
                now + self.settings.cleanup_timeout_s, ("abandon", key), entry.cleanup_epoch
            )
            self._schedule(
                now + self.settings.cleanup_redelivery_s, ("redeliver", key), entry.cleanup_epoch
            )
        elif phase is Phase.COMPLETE:
            completion = entry.core.completion
            assert completion is not None
            entry.completed_at = now
            self.metrics.completed_by[completion].inc()
            if self.tracer.on:
                self.tracer.completed(entry, completion, now)
                duration = now - entry.started_at
                self.metrics.duration_by[completion].observe(duration, self.tracer.exemplar(entry))
            else:
                self.metrics.duration_by[completion].observe(now - entry.started_at)
            # The core forgot its journal: nothing is outstanding any more.
            for action_id, (_, _, engines) in entry.routed.items():
                self._drop_deliveries(entry.handoff_id, action_id, engines)
            entry.routed.clear()
            self._disengage(entry)
            self._retain(Retained(entry))
            log.info(
                "handoff complete: %s", completion.value, extra={"handoff_id": entry.handoff_id}
            )
            for finished in self._on_finished:
                finished(entry.handoff_id)
            if self.active_count == 0:
                for callback in self._on_idle:
                    callback()

    def _server_fact(self, entry: Entry, fact: Fact) -> None:
        """A fact the server observed itself: a deadline, an unreachable engine, shutdown."""
        self._call(entry, lambda core: core.apply_fact(fact), fact=(fact, "server"))
        self.metrics.facts_by[(FACT_KIND[type(fact).__name__], "server")].inc()

    def _fail_doomed(self) -> None:
        while self._doomed:
            handoff_id = next(iter(self._doomed))
            del self._doomed[handoff_id]
            entry = self.handoffs.get(handoff_id)
            if isinstance(entry, Entry) and entry.core.phase is Phase.ACTIVE:
                log.warning(
                    "action routed to an unreachable engine; failing the handoff",
                    extra={"handoff_id": handoff_id},
                )
                self._server_fact(entry, Failed())

    # --- delivery bookkeeping ------------------------------------------------

    def _channel(self, engine_id: str) -> EngineChannel:
        channel = self._channels.get(engine_id)
        if channel is None:
            now = self.clock()
            channel = self._channels[engine_id] = EngineChannel(engine_id, now, next(self._epochs))
            self._arm_offline_timers(channel, now)
        return channel

    def _arm_offline_timers(self, channel: EngineChannel, now: float) -> None:
        """An engine just went (or started) without a stream: when to give up on it."""
        self._schedule(
            now + self.settings.delivery_timeout_s,
            ("unreachable", channel.engine_id),
            channel.epoch,
        )
        # Remember a dead engine for a while, so that work for it fails at
        # once instead of waiting out another delivery timeout.
        self._schedule(
            now + max(self.settings.retention_s, self.settings.delivery_timeout_s),
            ("forget", channel.engine_id),
            channel.epoch,
        )

    def _engage(self, entry: Entry, now: float) -> None:
        """Tie a handoff to its engines; one gone for delivery_timeout dooms it at once."""
        for engine_id in {entry.source_engine_id, entry.destination_engine_id}:
            channel = self._channel(engine_id)
            channel.handoffs.add(entry.handoff_id)
            if channel.unreachable(now, self.settings.delivery_timeout_s):
                self._doomed[entry.handoff_id] = None

    def _disengage(self, entry: Entry) -> None:
        for engine_id in {entry.source_engine_id, entry.destination_engine_id}:
            channel = self._channels.get(engine_id)
            if channel is not None:
                channel.handoffs.discard(entry.handoff_id)

    def _drop_deliveries(self, handoff_id: str, action_id: int, engines: tuple[str, ...]) -> None:
        key = (handoff_id, action_id)
        for engine_id in engines:
            channel = self._channels.get(engine_id)
            if channel is not None:
                channel.unacked.pop(key, None)
                channel.queue.pop(key, None)

    def _forget_channel(self, channel: EngineChannel, now: float) -> None:
        """Engines come and go: one long offline with nothing owed is forgotten."""
        if channel.queue or channel.unacked or channel.handoffs:
            self._schedule(
                now + max(self.settings.retention_s, self.settings.delivery_timeout_s),
                ("forget", channel.engine_id),
                channel.epoch,
            )
            return
        del self._channels[channel.engine_id]

    def _engine_unreachable(self, channel: EngineChannel) -> None:
        owed = {handoff_id for handoff_id, _ in channel.unacked} | channel.handoffs
        if not owed:
            return
        self.metrics.engine_unreachable.inc()
        log.warning(
            "engine has had no live stream for %.1f s; failing its %d handoffs",
            self.settings.delivery_timeout_s,
            len(owed),
            extra={"engine_id": channel.engine_id},
        )
        for handoff_id in sorted(owed):
            entry = self.handoffs.get(handoff_id)
            if isinstance(entry, Entry) and entry.core.phase is Phase.ACTIVE:
                self._server_fact(entry, Failed())

    def _redeliver_cleanup(self, entry: Entry, now: float) -> None:
        for action_id, (_, kind, engines) in entry.routed.items():
            if kind not in CLEANUP_KINDS:
                continue
            key = (entry.handoff_id, action_id)
            for engine_id in engines:
                channel = self._channels.get(engine_id)
                dispatch = channel.unacked.get(key) if channel else None
                if (
                    channel is not None
                    and dispatch is not None
                    and dispatch.attempt > 0
                    and key not in channel.queue
                ):
                    channel.queue[key] = dispatch
                    self.metrics.redeliveries_by[dispatch.action.kind].inc()
                    if self.tracer.on:
                        self.tracer.redelivered(entry, dispatch)
                    channel.notify()
        entry.redelivery_round += 1
        delay = min(
            self.settings.cleanup_redelivery_s * 2**entry.redelivery_round, MAX_REDELIVERY_DELAY_S
        )
        self._schedule(now + delay, ("redeliver", entry.handoff_id), entry.cleanup_epoch)

    def _abandon(self, entry: Entry) -> None:
        left = [
            f"{kind.value}#{action_id} to {engine_id}"
            for action_id, (_, kind, engines) in entry.routed.items()
            for engine_id in engines
        ]
        self._abandoned.note(
            self.clock(),
            entry.handoff_id,
            "abandoning handoff still cleaning up after %.0f s; outstanding: %s",
            self.settings.cleanup_timeout_s,
            ", ".join(left) or "none",
            handoff_id=entry.handoff_id,
        )
        self.metrics.abandoned.inc()
        if self.tracer.on:
            self.tracer.abandoned(entry, self.clock())
        self._remove(entry)
        for finished in self._on_finished:
            finished(entry.handoff_id)
        if self.active_count == 0:
            for callback in self._on_idle:
                callback()

    def _remove(self, entry: Entry) -> None:
        for action_id, (_, _, engines) in entry.routed.items():
            self._drop_deliveries(entry.handoff_id, action_id, engines)
        self._disengage(entry)
        del self.handoffs[entry.handoff_id]
        self.metrics.handoffs_by[entry.core.phase].dec()

    # --- retention -----------------------------------------------------------

    def _unpacked(self, handoff_id: str) -> Entry:
        """The handoff as an Entry a call can run on; a retained one stays
        retained unless the call reopens it (see _after_transition)."""
        entry = self.get(handoff_id)
        return entry if isinstance(entry, Entry) else entry.unpack()

    def _retain(self, record: Retained) -> None:
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

    def _oldest(self) -> Retained | None:
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
        self.metrics.handoffs_by[Phase.COMPLETE].dec()

    def _next_expiry(self) -> float | None:
        # Completion times never decrease, so neither do expiries: the
        # oldest record expires first.
        oldest = self._oldest()
        return None if oldest is None else oldest.completed_at + self.settings.retention_s

    def _expire_retained(self, now: float) -> None:
        while (expiry := self._next_expiry()) is not None and expiry <= now:
            self._forget_oldest()
