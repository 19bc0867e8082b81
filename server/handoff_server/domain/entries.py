"""What the registry keeps per unfinished handoff: an Entry in full while it
can change, and the request that started it (a completed one is retained.py's).

The Entry's methods are the bookkeeping after the core accepted a call
(acknowledge, stamp, route): the registry's call path and recovery's
rebuild (durability/rebuild.py) both run them, so the two cannot drift.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import NamedTuple

from handoff_server.domain.core import Handoff
from handoff_server.domain.model import (
    ROLE_OF,
    SIDES,
    SOURCE_RELEASES,
    SUCCEEDED_END,
    UNSPECIFIED_END,
    Action,
    ActionKind,
    Canceled,
    Completion,
    EndCause,
    EndReason,
    EngineLost,
    Failed,
    LifecycleEvent,
    Order,
    Outcome,
    OutcomeKind,
    Phase,
    Role,
    TimedOut,
)

# A transfer's modelled duration extends the deadline, capped so that it
# stays a representable date however absurd the delay.
MAX_EXTENSION_S = 365 * 24 * 3600.0
ONLY_SUCCEEDED = (SUCCEEDED_END,)


@dataclass(frozen=True, slots=True)
class StartRequest:
    handoff_id: str
    order: Order
    source_engine_id: str
    destination_engine_id: str
    fallback_transfer_delay_ms: float
    transfer_executor: Role = Role.SOURCE
    timeout_s: float | None = None
    # The caller's W3C trace context (traceparent, tracestate), kept in the journal.
    trace_context: tuple[tuple[str, str], ...] = ()


class Routed(NamedTuple):
    """An outstanding action as the registry routed it."""

    issued_at: float
    kind: ActionKind
    engines: tuple[str, ...]  # the engines it went to


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
        "trace",
        "trace_context",
        "reasons",
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
        self.trace: object = None  # tracing.HandoffTrace when tracing is on
        # The caller's, as StartHandoff brought it: a journal snapshot keeps it.
        self.trace_context: tuple[tuple[str, str], ...] = ()
        # Why it ended, one per completion (a reopened handoff has two), newest last.
        self.reasons: tuple[EndReason, ...] = ()

    @classmethod
    def started(cls, request: StartRequest, timeout_s: float, now: float) -> Entry:
        """A new handoff as ``request`` starts it at ``now``, not yet started in its core."""
        core = Handoff(request.handoff_id, request.order, request.fallback_transfer_delay_ms)
        # Interned: every request parses its own copy of its engines' names,
        # and a retained handoff would otherwise keep both for retention_s.
        entry = cls(
            core,
            sys.intern(request.source_engine_id),
            sys.intern(request.destination_engine_id),
            request.transfer_executor,
            timeout_s,
            now,
            now + timeout_s,
        )
        entry.trace_context = request.trace_context
        return entry

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
        return [r for r in SIDES if self.engine_for(r)[0] == engine_id]

    def role_of(self, kind: ActionKind) -> Role:
        return self.transfer_executor if kind is ActionKind.START_TRANSFER else ROLE_OF[kind]

    # --- the bookkeeping after the core accepted a call, in this order -----------

    def acknowledge(self, action_id: int, outcome: Outcome) -> tuple[Routed, float | None]:
        """An outstanding action answered: its routing, and since when the
        source held its KV if this answer freed it (else None)."""
        routed = self.routed.pop(action_id)
        held_since = self.held_at
        if (
            routed.kind in SOURCE_RELEASES
            and outcome.kind is not OutcomeKind.FAILED
            and held_since is not None
        ):
            self.held_at = None
            return routed, held_since
        return routed, None

    def stamp(self, events_before: int, now: float) -> None:
        """The times of the lifecycle events the call proved (those past ``events_before``)."""
        for event in self.core.lifecycle[events_before:]:
            self.lifecycle_at.append(now)
            if event is LifecycleEvent.SOURCE_HELD:
                self.held_at = now

    def end(
        self, phase_before: Phase, completion_before: Completion | None, reason: EndReason
    ) -> None:
        """Note why, if the call just ended the handoff (it left ACTIVE, or a
        success was reopened); a success is its own reason."""
        core = self.core
        if phase_before is Phase.ACTIVE and core.phase is Phase.ACTIVE:
            return
        if phase_before is not Phase.ACTIVE and not (
            phase_before is Phase.COMPLETE
            and (core.phase is not Phase.COMPLETE or core.completion is not completion_before)
        ):
            return
        if core.phase is Phase.COMPLETE and core.completion is Completion.SUCCESS:
            reason = SUCCEEDED_END
        # Shared: most retained handoffs simply succeeded.
        self.reasons = (
            ONLY_SUCCEEDED
            if reason is SUCCEEDED_END and not self.reasons
            else (
                *self.reasons,
                reason,
            )
        )

    def reason_for(self, recorded: object) -> EndReason:
        """The reason a journaled call gives by itself (recovery; the live path
        adds what the journal does not keep, such as why an engine was lost)."""
        if isinstance(recorded, TimedOut):
            return EndReason(EndCause.DEADLINE)
        if isinstance(recorded, Canceled):
            return EndReason(EndCause.FRONTEND_CANCELED)
        if isinstance(recorded, Failed):
            return EndReason(EndCause.FAILED)
        if isinstance(recorded, EngineLost):
            return EndReason(EndCause.ENGINE_LOST, recorded.role, self.engine_for(recorded.role)[0])
        if isinstance(recorded, tuple):
            action_id, outcome = recorded
            routed = self.routed.get(action_id)
            if outcome.kind is OutcomeKind.FAILED and routed is not None:
                return EndReason(
                    EndCause.ACTION_FAILED,
                    self.role_of(routed.kind),
                    routed.engines[0],
                    action=routed.kind,
                    detail=outcome.reason,
                )
        return UNSPECIFIED_END

    def route(self, action: Action, now: float) -> tuple[Role, tuple[str, ...], bool]:
        """Where a new action goes (its role and engines), kept as outstanding
        unless it is the final notice; True if it moved the deadline."""
        kind = action.kind
        role = self.transfer_executor if kind is ActionKind.START_TRANSFER else ROLE_OF[kind]
        engines = self.engine_for(role)
        extended = False
        if kind is ActionKind.START_TRANSFER and action.delay_ms is not None:
            # The transfer's own duration is not the handoff's fault.
            self.deadline = min(self.deadline + action.delay_ms / 1000.0, now + MAX_EXTENSION_S)
            extended = True
        if kind is not ActionKind.COMPLETE:
            self.routed[action.id] = Routed(now, kind, engines)
        return role, engines, extended
