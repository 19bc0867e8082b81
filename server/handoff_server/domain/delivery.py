"""Delivery: from "the core issued an action" to "the engine acknowledged it".

One channel per engine id holds what that engine is owed, in issue order:
actions waiting to be written, actions written and not yet acknowledged,
and which handoffs' actions reached the engine's current incarnation. A
live subscription (a StreamActions or Connect stream) takes from it;
another stream of the same sidecar replaces it and gets every unacknowledged
action again, still in issue order. Incarnations fence engines: a new one
means the old process's memory is gone (the registry then reports
EngineLost where its actions reached it), an older one is refused, and a
second sidecar under the same incarnation is refused while the first one's
stream is live.

Synchronous and clock-injected like the registry, which owns the handoff
table and calls in here; timers are the registry's (it dispatches every
kind in one place) and it asks this module whether an engine's timer still
matters.
"""

from __future__ import annotations

import enum
import itertools
import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from handoff_server.domain.model import Action, ActionKind, EndReason, FailedPrecondition, Role
from handoff_server.domain.timers import Timer, TimerKind
from handoff_server.ops.config import Settings
from handoff_server.ops.metrics import Metrics

log = logging.getLogger("handoff.delivery")

Clock = Callable[[], float]
Schedule = Callable[[float, TimerKind, str, object], None]
Key = tuple[str, int]  # (handoff id, action id)


class Fence(enum.Enum):
    """Why a subscription was refused; sent to the sidecar as ``handoff-fence`` metadata."""

    OLDER_INCARNATION = "older-incarnation"  # free what you hold and stop
    SESSION_CONFLICT = "session-conflict"  # another sidecar holds the stream: back off, retry


class Fenced(FailedPrecondition):
    """A subscription refused by incarnation fencing."""

    def __init__(self, fence: Fence, message: str) -> None:
        super().__init__(message)
        self.fence = fence


@dataclass(frozen=True, slots=True)
class Dispatch:
    """One action addressed to one engine; attempt counts writes to its streams.

    ``sequence`` orders an engine's dispatches by issue: a redelivered action
    goes out before anything issued after it.
    """

    handoff_id: str
    action: Action
    target: Role
    engine_id: str
    attempt: int = 0
    sequence: int = 0
    trace: tuple[str, str] | None = None  # the action span's traceparent and tracestate
    reason: EndReason | None = None  # COMPLETE only: why the handoff ended
    # The registry's clock at the call that issued it, if its engine had a
    # stream then: the coordinator's own share of the wait until its first write.
    issued_at: float | None = None


class Subscription:
    """One live engine stream. ``on_ready`` is called when there is work to take."""

    __slots__ = ("engine_id", "incarnation", "session_id", "on_ready", "closed")

    def __init__(
        self, engine_id: str, incarnation: str, session_id: str, on_ready: Callable[[], None]
    ) -> None:
        self.engine_id = engine_id
        self.incarnation = incarnation
        self.session_id = session_id
        self.on_ready = on_ready
        self.closed = False


class EngineChannel:
    __slots__ = (
        "engine_id",
        "queue",
        "unacked",
        "owed",
        "handoffs",
        "reached",
        "incarnation",
        "subscription",
        "epoch",
        "offline_since",
        "connected",
    )

    def __init__(self, engine_id: str, now: float, epoch: int) -> None:
        self.engine_id = engine_id
        # Waiting to be written, in issue order (Dispatch.sequence).
        self.queue: dict[Key, Dispatch] = {}
        # Every outstanding action of this engine, written or not (never Complete).
        self.unacked: dict[Key, Dispatch] = {}
        # The keys of ``unacked`` by handoff: forsaking a handoff's side costs its
        # own actions, so losing an engine is linear in its handoffs.
        self.owed: dict[str, set[Key]] = {}
        # Unfinished handoffs naming this engine: all are lost with it when it
        # goes unreachable, even those that owe it no action (a prefill that
        # died while running would otherwise hold its decode's memory).
        self.handoffs: set[str] = set()
        # Unfinished handoffs whose actions for these roles reached the current
        # incarnation: written to one of its streams, or acknowledged.
        self.reached: dict[str, set[Role]] = {}
        self.incarnation = ""  # the newest seen; empty until a fenced sidecar subscribes
        self.subscription: Subscription | None = None
        # Renewed on every (un)subscribe, so a timer armed for an earlier
        # stream, or a forgotten channel, never fires.
        self.epoch = epoch
        self.offline_since: float | None = now
        # Whether any stream ever subscribed while this channel was remembered.
        self.connected = False

    def owe(self, key: Key, dispatch: Dispatch) -> None:
        self.unacked[key] = dispatch
        self.owed.setdefault(key[0], set()).add(key)

    def settle(self, key: Key) -> Dispatch | None:
        """No longer owed (acknowledged, dropped, forsaken): out of every index."""
        dispatch = self.unacked.pop(key, None)
        self.queue.pop(key, None)
        keys = self.owed.get(key[0])
        if keys is not None:
            keys.discard(key)
            if not keys:
                del self.owed[key[0]]
        return dispatch

    def notify(self) -> None:
        if self.subscription is not None:
            self.subscription.on_ready()

    def requeue(self, dispatches: Iterable[Dispatch]) -> int:
        """Queue ``dispatches`` again, keeping the queue in issue order; how many."""
        again = {(d.handoff_id, d.action.id): d for d in dispatches}
        if again:
            merged = sorted((self.queue | again).items(), key=lambda item: item[1].sequence)
            self.queue = dict(merged)
        return len(again)


def short(session_id: str) -> str:
    return session_id[:8]


class Delivery:
    def __init__(
        self, settings: Settings, metrics: Metrics, clock: Clock, schedule: Schedule
    ) -> None:
        self.settings = settings
        self.metrics = metrics
        self.clock = clock
        self._schedule = schedule
        self._channels: dict[str, EngineChannel] = {}
        self._epochs = itertools.count()
        self._sequence = itertools.count(1)
        # Told of each unacknowledged action that goes out again (tracing).
        self.on_redelivered: Callable[[Dispatch], None] | None = None

    def __len__(self) -> int:
        """Engines remembered: live, or offline with something hanging on them."""
        return len(self._channels)

    def __contains__(self, engine_id: str) -> bool:
        return engine_id in self._channels

    # --- engine streams ---------------------------------------------------

    def subscribe(
        self,
        engine_id: str,
        on_ready: Callable[[], None],
        incarnation: str = "",
        session_id: str = "",
    ) -> tuple[Subscription, dict[str, set[Role]]]:
        """A new live stream for ``engine_id``, replacing the previous one.

        Also returns what a new incarnation lost: the handoffs (and roles)
        whose actions reached the previous one. Raises :class:`Fenced` for an
        older incarnation, or another session while the incarnation's stream
        is live; nothing changes then.
        """
        channel = self._channel(engine_id)
        previous = channel.subscription
        lost: dict[str, set[Role]] = {}
        if incarnation:
            known = channel.incarnation
            if known and incarnation < known:
                raise Fenced(
                    Fence.OLDER_INCARNATION,
                    f"engine {engine_id}: incarnation {incarnation} is older than {known}, "
                    "which replaced it; this sidecar must free what it holds and stop",
                )
            if incarnation == known and previous is not None and session_id != previous.session_id:
                raise Fenced(
                    Fence.SESSION_CONFLICT,
                    f"engine {engine_id}: another sidecar (session {short(previous.session_id)}) "
                    f"holds this engine's stream under incarnation {incarnation}; session "
                    f"{short(session_id)} may subscribe once that stream is gone",
                )
            if known and incarnation > known:
                lost, channel.reached = channel.reached, {}
                for key, dispatch in list(channel.unacked.items()):
                    if dispatch.target in lost.get(dispatch.handoff_id, ()):
                        channel.settle(key)
            channel.incarnation = incarnation
        if previous is not None:
            previous.closed = True
            previous.on_ready()  # wakes it so it sees it is closed and ends
        else:
            self.metrics.engine_streams.inc()
        subscription = Subscription(engine_id, incarnation, session_id, on_ready)
        channel.subscription = subscription
        channel.epoch = next(self._epochs)
        channel.offline_since = None
        channel.connected = True
        # At least once: whatever was written to an earlier stream and not
        # acknowledged goes out again, before anything issued after it.
        again = [d for key, d in channel.unacked.items() if d.attempt and key not in channel.queue]
        for dispatch in again:
            self._redelivered(dispatch)
        channel.requeue(again)
        if channel.queue:
            on_ready()
        return subscription, lost

    def unsubscribe(self, subscription: Subscription) -> None:
        channel = self._channels.get(subscription.engine_id)
        subscription.closed = True
        if channel is None or channel.subscription is not subscription:
            return  # already replaced
        channel.subscription = None
        self.metrics.engine_streams.dec()
        if not (channel.queue or channel.unacked or channel.handoffs):
            # Nothing hangs on it: forget it now, so that streams opened under
            # ever-new engine ids cannot pile up remembered channels. Its
            # incarnation is forgotten too: with nothing in flight, a later
            # one has nothing to lose and an earlier one nothing to fence.
            del self._channels[channel.engine_id]
            return
        now = self.clock()
        channel.epoch = next(self._epochs)
        channel.offline_since = now
        self._arm_offline_timers(channel, now)

    def current(self, engine_id: str, incarnation: str, session_id: str) -> None:
        """Raise :class:`FailedPrecondition` unless ``incarnation`` and ``session_id``
        are those of ``engine_id``'s live stream.

        A reconcile says what the engine's memory holds now, and frees or
        loses sides on that word: only the sidecar holding the engine's live
        stream knows it. A fenced incarnation (whose stream is refused), or a
        caller with no stream at all, would free what the live engine uses.
        """
        channel = self._channels.get(engine_id)
        live = channel.subscription if channel is not None else None
        if live is None:
            raise FailedPrecondition(
                f"engine {engine_id} has no live stream: Reconcile comes from the sidecar "
                "holding its StreamActions or Connect stream, after that subscription"
            )
        if incarnation != live.incarnation:
            fenced = " (an older one, fenced out)" if incarnation < live.incarnation else ""
            raise FailedPrecondition(
                f"engine {engine_id}: Reconcile from incarnation {incarnation or '(none)'}"
                f"{fenced}, but its live stream is incarnation {live.incarnation or '(none)'}: "
                "only the engine's current subscription reconciles"
            )
        if session_id != live.session_id:
            raise FailedPrecondition(
                f"engine {engine_id}: Reconcile from session {short(session_id) or '(none)'}, "
                f"but its live stream under incarnation {incarnation or '(none)'} is session "
                f"{short(live.session_id) or '(none)'}: only the engine's current "
                "subscription reconciles"
            )

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
                dispatch.sequence,
                dispatch.trace,
                dispatch.reason,
                dispatch.issued_at,
            )
            if dispatch.action.kind is not ActionKind.COMPLETE:
                channel.owe(key, dispatch)
                channel.reached.setdefault(dispatch.handoff_id, set()).add(dispatch.target)
            batch.append(dispatch)
        return batch

    def close_streams(self) -> None:
        """End every live stream cleanly (shutdown); engines see a normal end."""
        for channel in self._channels.values():
            if channel.subscription is not None:
                channel.subscription.closed = True
                channel.subscription.on_ready()

    # --- what the registry routes ---------------------------------------------

    def queued(self, engine_id: str) -> int:
        channel = self._channels.get(engine_id)
        return 0 if channel is None else len(channel.queue)

    def engage(self, handoff_id: str, engines: Iterable[str], reached: Iterable[Role] = ()) -> None:
        """Tie an unfinished handoff to its engines (``reached``: roles its actions
        already reached, for a completed handoff that is reopened)."""
        roles = set(reached)
        for engine_id in engines:
            channel = self._channel(engine_id)
            channel.handoffs.add(handoff_id)
            if roles:
                channel.reached.setdefault(handoff_id, set()).update(roles)

    def disengage(self, handoff_id: str, engines: Iterable[str]) -> None:
        """The handoff finished (its actions are dropped one by one, see drop)."""
        for engine_id in engines:
            channel = self._channels.get(engine_id)
            if channel is None:
                continue
            channel.handoffs.discard(handoff_id)
            channel.reached.pop(handoff_id, None)

    def unreachable(self, engine_id: str, now: float) -> bool:
        """Whether ``engine_id`` has had no live stream for delivery_timeout."""
        channel = self._channels.get(engine_id)
        return (
            channel is not None
            and channel.offline_since is not None
            and now - channel.offline_since >= self.settings.delivery_timeout_s
        )

    def send(
        self,
        handoff_id: str,
        action: Action,
        role: Role,
        engines: Iterable[str],
        trace: tuple[str, str] | None = None,
        reason: EndReason | None = None,
        issued_at: float | None = None,
    ) -> None:
        for engine_id in engines:
            channel = self._channel(engine_id)
            if action.kind is ActionKind.COMPLETE and self._never_came(channel):
                continue
            sequence = next(self._sequence)
            streamed = issued_at if channel.subscription is not None else None
            dispatch = Dispatch(
                handoff_id, action, role, engine_id, 0, sequence, trace, reason, streamed
            )
            key = (handoff_id, action.id)
            channel.queue[key] = dispatch
            if action.kind is not ActionKind.COMPLETE:
                channel.owe(key, dispatch)
            channel.notify()

    def _never_came(self, channel: EngineChannel) -> bool:
        """An engine declared lost before any stream of it subscribed: a notice
        queued for it would reach a later engine under that id, one that never
        took part in the handoff."""
        return not channel.connected and self.unreachable(channel.engine_id, self.clock())

    def acknowledge(self, handoff_id: str, action_id: int, engines: Iterable[str]) -> None:
        """The action's outcome is in: its engine had it, written to a stream or not."""
        key = (handoff_id, action_id)
        for engine_id in engines:
            channel = self._channels.get(engine_id)
            if channel is None:
                continue
            dispatch = channel.settle(key)
            if dispatch is not None and handoff_id in channel.handoffs:
                channel.reached.setdefault(handoff_id, set()).add(dispatch.target)

    def drop(self, handoff_id: str, action_id: int, engines: Iterable[str]) -> None:
        """The action no longer matters (its handoff finished): never send it."""
        key = (handoff_id, action_id)
        for engine_id in engines:
            channel = self._channels.get(engine_id)
            if channel is not None:
                channel.settle(key)

    def reached(self, handoff_id: str, role: Role, engine_id: str) -> bool:
        """Whether any action of the handoff for ``role`` reached ``engine_id``."""
        channel = self._channels.get(engine_id)
        return channel is not None and role in channel.reached.get(handoff_id, ())

    def forsake(self, handoff_id: str, role: Role, engine_id: str) -> None:
        """Nothing for ``role`` of this handoff is owed to ``engine_id`` any more:
        what waits for it is never delivered, what it had is not redelivered."""
        channel = self._channels.get(engine_id)
        if channel is None:
            return
        for key in list(channel.owed.get(handoff_id, ())):
            if channel.unacked[key].target is role:
                channel.settle(key)

    def adopt(
        self,
        handoff_id: str,
        engines: Iterable[str],
        written: Iterable[Dispatch],
        reached: Iterable[tuple[str, Role]],
    ) -> None:
        """Tie an unfinished handoff rebuilt from the journal to its engines
        (recovery): ``written`` are its outstanding actions as they stood, each
        written to its engine's stream and unacknowledged; ``reached`` the
        (engine, role) pairs any of its actions reached."""
        self.engage(handoff_id, engines)
        for dispatch in written:
            channel = self._channels[dispatch.engine_id]
            channel.owe((handoff_id, dispatch.action.id), dispatch)
        for engine_id, role in reached:
            self._channels[engine_id].reached.setdefault(handoff_id, set()).add(role)

    def number_from(self, sequence: int) -> None:
        """Number the dispatches sent from now on from ``sequence`` up. Recovery
        numbers them by journal record, so what it replays and what it rebuilds
        keep one issue order per engine."""
        self._sequence = itertools.count(sequence)

    def redeliver(self, handoff_id: str, action_id: int, engines: Iterable[str]) -> None:
        """Send an action again to each engine it was written to and not yet re-queued."""
        key = (handoff_id, action_id)
        for engine_id in engines:
            channel = self._channels.get(engine_id)
            dispatch = channel.unacked.get(key) if channel else None
            if channel is None or dispatch is None or not dispatch.attempt or key in channel.queue:
                continue
            channel.requeue((dispatch,))
            self._redelivered(dispatch)
            channel.notify()

    def attempts(self, handoff_id: str, action_id: int, engines: Iterable[str]) -> int:
        """How many times an unacknowledged action was written to its engines' streams, at most."""
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

    def _redelivered(self, dispatch: Dispatch) -> None:
        self.metrics.redeliveries_by[dispatch.action.kind].inc()
        if self.on_redelivered is not None:
            self.on_redelivered(dispatch)

    # --- time ---------------------------------------------------------------

    def timer_is_live(self, timer: Timer) -> bool:
        channel = self._channels.get(timer.key)
        return channel is not None and channel.epoch == timer.token and channel.subscription is None

    def handoffs_of(self, engine_id: str) -> set[str]:
        """Unfinished handoffs naming ``engine_id`` (all are lost when it is)."""
        return set(self._channels[engine_id].handoffs)

    def forget(self, engine_id: str) -> None:
        """Engines come and go: one long offline with nothing owed is forgotten."""
        channel = self._channels[engine_id]
        # Complete notices alone do not keep it: they are owed nothing back.
        if channel.unacked or channel.handoffs:
            self._schedule(
                self.clock() + self._remembered_s(), TimerKind.FORGET, engine_id, channel.epoch
            )
            return
        del self._channels[engine_id]

    def _channel(self, engine_id: str) -> EngineChannel:
        channel = self._channels.get(engine_id)
        if channel is None:
            now = self.clock()
            channel = self._channels[engine_id] = EngineChannel(engine_id, now, next(self._epochs))
            self._arm_offline_timers(channel, now)
        return channel

    def _remembered_s(self) -> float:
        # Remember a dead engine for a while, so that work for it is lost at
        # once instead of waiting out another delivery timeout.
        return max(self.settings.retention_s, self.settings.delivery_timeout_s)

    def _arm_offline_timers(self, channel: EngineChannel, now: float) -> None:
        """An engine just went (or started) without a stream: when to give up on it."""
        self._schedule(
            now + self.settings.delivery_timeout_s,
            TimerKind.UNREACHABLE,
            channel.engine_id,
            channel.epoch,
        )
        self._schedule(
            now + self._remembered_s(), TimerKind.FORGET, channel.engine_id, channel.epoch
        )
