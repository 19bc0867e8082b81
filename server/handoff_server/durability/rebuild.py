"""An unfinished handoff rebuilt from its journal records through the core alone.

Recovery's fast path: replaying a record through the registry runs its whole
call path (checkpoint, delivery queues, a stand-in stream, timers, metrics)
for state the next record overwrites. Here each record runs through the pure
core and the Entry's own bookkeeping (Entry.acknowledge, stamp, route: the
registry's call path runs the same methods); what is kept beyond that is the
rebuild's own: which actions were written to which engine and which roles
they reached. :meth:`Registry.adopt` then installs the handoff once.

A record whose effect reaches beyond this one handoff (the server settling a
cleanup, an abandonment, a completion, a failure other than a rejection)
sets :attr:`Rebuild.needs_registry`, and recovery replays the handoff
through the registry instead; tests/durability/test_recovery.py proves both ways equal.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from handoff_server.domain.delivery import Dispatch
from handoff_server.domain.entries import Entry, StartRequest
from handoff_server.domain.model import (
    CLEANUP_KINDS,
    UNSPECIFIED_END,
    Action,
    ActionKind,
    EndReason,
    EngineLost,
    Fact,
    HandoffError,
    Outcome,
    Phase,
    Role,
)

Row = tuple[int, str, float, str]  # a journal row: seq, handoff id, time, body text


def numbered(seq: int) -> int:
    """The first dispatch sequence of journal record ``seq``: records issue
    their actions in journal order, a record's own in the order it routes them
    (Delivery.number_from gives the registry's replay the same numbers)."""
    return seq << 8


class Rebuild:
    """One unfinished handoff, rebuilt record by record (see the module doc)."""

    __slots__ = (
        "entry",
        "skipped",
        "needs_registry",
        "cleaning_since",
        "_written",
        "_reached",
    )

    def __init__(self, request: StartRequest, timeout_s: float, row: Row) -> None:
        seq, _, at, _ = row
        self.entry = Entry.started(request, timeout_s, at)
        self.skipped = 0  # records the core rejected (the registry's replay skips them too)
        self.needs_registry: str | None = None
        self.cleaning_since: float | None = None
        # Outstanding actions written to their engines, by (action id, engine id).
        self._written: dict[tuple[int, str], Dispatch] = {}
        # Roles any of whose actions reached their engine (a tuple: a set
        # costs four times the memory, times every unfinished handoff).
        self._reached: tuple[Role, ...] = ()
        self._after(
            seq, at, self._core_call(self.entry.core.start), Phase.ACTIVE, 0, UNSPECIFIED_END
        )

    @property
    def handoff_id(self) -> str:
        return self.entry.core.handoff_id

    @property
    def written(self) -> Iterator[Dispatch]:
        return iter(self._written.values())

    @property
    def reached(self) -> Iterator[tuple[str, Role]]:
        entry = self.entry
        return ((entry.engine_for(role)[0], role) for role in self._reached)

    # --- records --------------------------------------------------------------

    def outcome(self, seq: int, at: float, action_id: int, outcome: Outcome) -> None:
        core = self.entry.core
        acknowledging = core.is_outstanding(action_id)
        phase, events = core.phase, len(self.entry.lifecycle_at)
        reason = self.entry.reason_for((action_id, outcome))
        actions = self._core_call(core.apply_outcome, action_id, outcome)
        if actions is not None and acknowledging:
            self._acknowledge(action_id, outcome)
        self._after(seq, at, actions, phase, events, reason)

    def fact(self, seq: int, at: float, fact: Fact, reason: EndReason | None = None) -> None:
        """``reason``: the one its record kept, if the fact does not say it by itself."""
        entry = self.entry
        core = entry.core
        phase, events = core.phase, len(entry.lifecycle_at)
        actions = self._core_call(core.apply_fact, fact)
        reason = reason or entry.reason_for(fact)
        pending = self._after(seq, at, actions, phase, events, reason, take=False)
        if isinstance(fact, EngineLost) and actions is not None and not self.needs_registry:
            role = fact.role
            self.forsake(role, entry.engine_for(role)[0])
        self._take(pending)

    def forsake(self, role: Role, engine_id: str) -> None:
        """Nothing for ``role`` is owed to ``engine_id`` any more (Delivery.forsake)."""
        for key, dispatch in list(self._written.items()):
            if dispatch.target is role and dispatch.engine_id == engine_id:
                del self._written[key]

    # --- the call path, as its end state --------------------------------------

    def _core_call(
        self, call: Callable[..., tuple[Action, ...]], *args: object
    ) -> tuple[Action, ...] | None:
        """The core's answer; None if it rejected the call (skipped, as the
        registry's replay skips it) or failed otherwise (the registry's turn)."""
        try:
            return call(*args)
        except HandoffError:
            self.skipped += 1
        except Exception as error:  # the registry restores and answers INTERNAL
            self.needs_registry = f"the core failed: {type(error).__name__}"
        return None

    def _acknowledge(self, action_id: int, outcome: Outcome) -> None:
        (_, _, engines), _ = self.entry.acknowledge(action_id, outcome)
        for engine_id in engines:
            dispatch = self._written.pop((action_id, engine_id), None)
            if dispatch is not None:
                self._reach(dispatch.target)

    def _after(
        self,
        seq: int,
        at: float,
        actions: tuple[Action, ...] | None,
        phase_before: Phase,
        events_before: int,
        reason: EndReason,
        take: bool = True,
    ) -> list[Dispatch]:
        """What the registry does once the core accepted a call: lifecycle
        stamps, routing, the phase change; the stand-in's take unless the
        caller forsakes first. Returns the dispatches not yet taken."""
        if actions is None:
            return []
        entry = self.entry
        core = entry.core
        entry.stamp(events_before, at)
        entry.end(phase_before, None, reason)
        handoff_id, written = core.handoff_id, self._written
        pending: list[Dispatch] = []
        sequence = numbered(seq)
        for action in actions:
            kind = action.kind
            role, engines, _ = entry.route(action, at)
            if kind is ActionKind.COMPLETE:
                self.needs_registry = "it completed"
                return []
            # A guard: in a replay every earlier action of a side counts as
            # reached, and the core cleans up only a side it sent something.
            if kind in CLEANUP_KINDS and role not in self._reached:
                self.needs_registry = f"the server settled {kind.value}#{action.id} itself"
                return []
            for engine_id in engines:
                dispatch = Dispatch(handoff_id, action, role, engine_id, 1, sequence)
                sequence += 1
                written[(action.id, engine_id)] = dispatch
                pending.append(dispatch)
        phase = core.phase
        if phase is Phase.COMPLETE:
            self.needs_registry = "it completed"
        elif phase is not phase_before and phase is Phase.CLEANING_UP:
            self.cleaning_since = at
        if take:
            self._take(pending)
            return []
        return pending

    def _take(self, pending: list[Dispatch]) -> None:
        """The stand-in stream takes what is still owed: its roles are reached."""
        written = self._written
        for dispatch in pending:
            if written.get((dispatch.action.id, dispatch.engine_id)) is dispatch:
                self._reach(dispatch.target)

    def _reach(self, role: Role) -> None:
        if role not in self._reached:
            self._reached += (role,)
