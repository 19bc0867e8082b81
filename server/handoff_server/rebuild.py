"""An unfinished handoff rebuilt from its journal records through the core alone.

Recovery's fast path (recovery.py says when it is taken). Replaying a record
through the registry runs its whole call path for state the next record
overwrites: a checkpoint, routing, delivery queues, a stand-in stream
taking each action, timers, metrics. Here each record runs through the pure
core, and the registry's bookkeeping is kept only as the end state that path
leaves: the outstanding actions as routed, each written once to its engine
(a replay counts every issued action as written), the roles its actions
reached, the lifecycle times, the deadline with the transfer's extension,
and when cleanup began. :meth:`Registry.adopt` then installs the handoff once.

What follows the registry's call path step for step (registry.Registry._call):
an outcome acknowledges its action (routed, written, the source's hold),
then new lifecycle events are stamped, then the new actions are routed in
order, then a phase change is seen; a lost engine's side is forsaken after
the call, and only then does the stand-in stream take what is left.

Only the common case is rebuilt. A record whose effect depends on the
registry beyond this one handoff's bookkeeping sends the handoff back to the
registry's replay: the server settling a cleanup for a side none of whose
actions reached its engine (its own follow-up call), an abandonment, a
completion (a completed handoff is one ``retained`` record, never a
history), or a failure other than a rejected call.
:attr:`Rebuild.needs_registry` says which; recovery then replays the
handoff's records so far through the registry at once, and the rest as
they come. tests/test_recovery.py proves a registry recovered this way
equals one whose every record was replayed through the call path, delivery
state and timers included.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from handoff_server.delivery import Dispatch, Role
from handoff_server.entries import Entry, Routed, StartRequest
from handoff_server.model import (
    CLEANUP_KINDS,
    Action,
    ActionKind,
    EngineLost,
    Fact,
    HandoffError,
    LifecycleEvent,
    Outcome,
    OutcomeKind,
    Phase,
)
from handoff_server.registry import MAX_EXTENSION_S, ROLE_OF_SIDE

Row = tuple[int, str, float, str]  # a journal row: seq, handoff id, time, body text
SOURCE_RELEASES = (ActionKind.RELEASE_SOURCE, ActionKind.CANCEL_SOURCE)


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
        self._after(seq, at, self._core_call(self.entry.core.start), Phase.ACTIVE, 0)

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
        actions = self._core_call(core.apply_outcome, action_id, outcome)
        if actions is not None and acknowledging:
            self._acknowledge(action_id, outcome)
        self._after(seq, at, actions, phase, events)

    def fact(self, seq: int, at: float, fact: Fact) -> None:
        entry = self.entry
        core = entry.core
        phase, events = core.phase, len(entry.lifecycle_at)
        actions = self._core_call(core.apply_fact, fact)
        pending = self._after(seq, at, actions, phase, events, take=False)
        if isinstance(fact, EngineLost) and actions is not None and not self.needs_registry:
            role = ROLE_OF_SIDE[fact.role]
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
        entry = self.entry
        _, kind, engines = entry.routed.pop(action_id)
        if (
            kind in SOURCE_RELEASES
            and outcome.kind is not OutcomeKind.FAILED
            and entry.held_at is not None
        ):
            entry.held_at = None
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
        take: bool = True,
    ) -> list[Dispatch]:
        """What the registry does once the core accepted a call: lifecycle
        stamps, routing, the phase change; the stand-in's take unless the
        caller forsakes first. Returns the dispatches not yet taken."""
        if actions is None:
            return []
        entry = self.entry
        core = entry.core
        for event in core.lifecycle[events_before:]:
            entry.lifecycle_at.append(at)
            if event is LifecycleEvent.SOURCE_HELD:
                entry.held_at = at
        handoff_id, written = core.handoff_id, self._written
        pending: list[Dispatch] = []
        sequence = numbered(seq)
        for action in actions:
            kind = action.kind
            role = entry.role_of(kind)
            engines = entry.engine_for(role)
            if kind is ActionKind.START_TRANSFER and action.delay_ms is not None:
                extended = entry.deadline + action.delay_ms / 1000.0
                entry.deadline = min(extended, at + MAX_EXTENSION_S)
            if kind is ActionKind.COMPLETE:
                self.needs_registry = "it completed"
                return []
            entry.routed[action.id] = Routed(at, kind, engines)
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
