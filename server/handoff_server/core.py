"""The handoff state machine: the one module that owns every transition.

Pure in the sans-IO sense: no I/O, no clock, no asyncio. The registry feeds it
facts and outcomes and routes the actions it returns.

Every public call is atomic. All checks that can reject a call run before the
first attribute is written, so a rejected call leaves the handoff exactly as
it was (DESIGN.md, correction 5).
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass

from handoff_server.model import (
    ALLOWED_OUTCOMES,
    CLEANUP_KINDS,
    TERMINAL_FACTS,
    Action,
    ActionKind,
    Completion,
    DestinationReserved,
    EngineLost,
    Fact,
    FailedPrecondition,
    InvalidArgument,
    LifecycleEvent,
    NotFound,
    Order,
    Outcome,
    OutcomeKind,
    Phase,
    Side,
    SourceHeld,
    TransferCompleted,
    TransferTiming,
    validate_delay_ms,
)

NO_ACTIONS: tuple[Action, ...] = ()

# Enum members bound once: a class-attribute lookup on an Enum costs about ten
# times a global lookup, and the hot paths test members on every call.
ACTIVE, CLEANING_UP, COMPLETE = Phase.ACTIVE, Phase.CLEANING_UP, Phase.COMPLETE
SUCCESS, CANCELED = Completion.SUCCESS, Completion.CANCELED
SOURCE_FIRST, DESTINATION_FIRST = Order.SOURCE_FIRST, Order.DESTINATION_FIRST
FAILED = OutcomeKind.FAILED
DO_SUBMIT_PREFILL = ActionKind.SUBMIT_PREFILL
DO_RESERVE_DESTINATION = ActionKind.RESERVE_DESTINATION
DO_START_TRANSFER = ActionKind.START_TRANSFER
DO_ACTIVATE_DESTINATION = ActionKind.ACTIVATE_DESTINATION
DO_RELEASE_SOURCE = ActionKind.RELEASE_SOURCE
DO_CANCEL_SOURCE = ActionKind.CANCEL_SOURCE
DO_CANCEL_DESTINATION = ActionKind.CANCEL_DESTINATION
DO_COMPLETE = ActionKind.COMPLETE
EV_SOURCE_HELD = LifecycleEvent.SOURCE_HELD
EV_DESTINATION_ACCEPTED = LifecycleEvent.DESTINATION_ACCEPTED
EV_DESTINATION_RESERVED = LifecycleEvent.DESTINATION_RESERVED
EV_DESTINATION_ACTIVATED = LifecycleEvent.DESTINATION_ACTIVATED
EV_SOURCE_RELEASED = LifecycleEvent.SOURCE_RELEASED
EV_COMPLETED = LifecycleEvent.COMPLETED
EV_SOURCE_LOST = LifecycleEvent.SOURCE_LOST
EV_DESTINATION_LOST = LifecycleEvent.DESTINATION_LOST


class Handoff:
    """One prefill-to-decode ownership handoff."""

    __slots__ = (
        "handoff_id",
        "order",
        "fallback_transfer_delay_ms",
        "_phase",
        "_completion",
        "_started",
        "_next_action_id",
        "_issued",
        "_outcomes",
        "_lifecycle",
        # source side
        "_submit_issued",
        "_submitted",
        "_held",
        "_transfer_timing",
        "_release_issued",
        "_source_cancel_issued",
        "_source_done",
        "_source_lost",
        # destination side
        "_reserve_issued",
        "_accepted",
        "_reserved",
        "_transferable_tokens",
        "_activation_issued",
        "_activation_applied",
        "_destination_cancel_issued",
        "_destination_done",
        "_destination_lost",
        # transfer
        "_transfer_delay_ms",
        "_transfer_issued",
        "_transfer_scheduled",
        "_transfer_completed",
    )

    def __init__(self, handoff_id: str, order: Order, fallback_transfer_delay_ms: float) -> None:
        if not (math.isfinite(fallback_transfer_delay_ms) and fallback_transfer_delay_ms >= 0.0):
            raise InvalidArgument("invalid fallback transfer delay")
        self.handoff_id = handoff_id
        self.order = order
        self.fallback_transfer_delay_ms = fallback_transfer_delay_ms
        self._phase = ACTIVE
        self._completion: Completion | None = None
        self._started = False
        self._next_action_id = 0
        # The journal: issued actions awaiting or holding their outcome. Cleared
        # on completion, after which outcomes are acknowledged without checks.
        self._issued: dict[int, Action] = {}
        self._outcomes: dict[int, Outcome] = {}
        self._lifecycle: list[LifecycleEvent] = []
        self._submit_issued = False
        self._submitted = False
        self._held = False
        self._transfer_timing: TransferTiming | None = None
        self._release_issued = False
        self._source_cancel_issued = False
        self._source_done = False
        self._source_lost = False
        self._reserve_issued = False
        self._accepted = False
        self._reserved = False
        self._transferable_tokens = 0
        self._activation_issued = False
        self._activation_applied = False
        self._destination_cancel_issued = False
        self._destination_done = False
        self._destination_lost = False
        self._transfer_delay_ms = 0.0
        self._transfer_issued = False
        self._transfer_scheduled = False
        self._transfer_completed = False

    # --- what callers may read ------------------------------------------

    @property
    def phase(self) -> Phase:
        return self._phase

    @property
    def completion(self) -> Completion | None:
        return self._completion

    @property
    def lifecycle(self) -> tuple[LifecycleEvent, ...]:
        return tuple(self._lifecycle)

    @property
    def outstanding(self) -> tuple[Action, ...]:
        """Issued actions still waiting for their outcome, in issue order."""
        if len(self._outcomes) == len(self._issued):
            return NO_ACTIONS  # outcomes are kept only for issued actions: all are in
        return tuple(a for i, a in self._issued.items() if i not in self._outcomes)

    def is_outstanding(self, action_id: int) -> bool:
        return action_id in self._issued and action_id not in self._outcomes

    def snapshot(self) -> tuple[object, ...]:
        """Every piece of state, as comparable values: two equal snapshots are one state."""
        values: list[object] = []
        for name in self.__slots__:
            value = getattr(self, name)
            if isinstance(value, dict):
                value = tuple(value.items())
            elif isinstance(value, list):
                value = tuple(value)
            values.append(value)
        return tuple(values)

    def pack(self) -> Completed:
        """This completed handoff in a few words, for as long as it is retained."""
        assert self._phase is COMPLETE, "only a completed handoff is packed"
        completion = self._completion
        assert completion is not None
        ending = Ending(self.order, completion, tuple(self._lifecycle), _rest_of(self))
        return Completed(
            self.handoff_id, self.fallback_transfer_delay_ms, _ENDINGS.setdefault(ending, ending)
        )

    def checkpoint(self) -> Checkpoint:
        """Enough for :meth:`restore` to undo what later calls change, for callers
        that must undo a call that crashed. Taken before every call, so it reads
        the slots in one C call and copies only the containers (a whole copy of
        the handoff cost three times as much)."""
        return _state_of(self), self._issued.copy(), self._outcomes.copy(), self._lifecycle.copy()

    def restore(self, checkpoint: Checkpoint) -> None:
        state, issued, outcomes, lifecycle = checkpoint
        for name, value in zip(self.__slots__, state, strict=True):
            setattr(self, name, value)
        self._issued, self._outcomes, self._lifecycle = issued, outcomes, lifecycle

    # --- calls ------------------------------------------------------------

    def start(self) -> tuple[Action, ...]:
        # A terminal fact before start completes the handoff with nothing
        # issued; starting it then would issue work nothing can ever retire.
        if self._started or self._phase is not ACTIVE:
            return NO_ACTIONS
        self._started = True
        if self.order is SOURCE_FIRST:
            return (self._issue_submit_prefill(),)
        return (self._issue_reserve_destination(),)

    def apply_fact(self, fact: Fact) -> tuple[Action, ...]:
        # Payloads are validated whatever the phase, so a malformed report is
        # always answered as malformed rather than silently absorbed.
        if isinstance(fact, SourceHeld):
            fact.transfer_timing.validate()
        elif isinstance(fact, DestinationReserved) and fact.transferable_prompt_tokens < 0:
            raise InvalidArgument(
                f"invalid transferable prompt tokens {fact.transferable_prompt_tokens}"
            )
        elif isinstance(fact, EngineLost):
            return self._on_engine_lost(fact.role)

        if self._phase is not ACTIVE:
            if (
                self._phase is COMPLETE
                and self._completion is SUCCESS
                and isinstance(fact, TERMINAL_FACTS)
            ):
                # A terminal fact after success: the destination owns the
                # request and is still decoding, so it must be canceled.
                self._phase = CLEANING_UP
                return self._advance_cleanup()
            return NO_ACTIONS

        if isinstance(fact, SourceHeld):
            return self._on_source_held(fact.transfer_timing)
        if isinstance(fact, DestinationReserved):
            return self._on_destination_reserved(fact.transferable_prompt_tokens)
        if isinstance(fact, TransferCompleted):
            if self._transfer_completed:
                return NO_ACTIONS
            if not self._transfer_scheduled:
                raise FailedPrecondition("transfer completed before it was scheduled")
            self._transfer_completed = True
            return self._advance_active()
        self._phase = CLEANING_UP
        return self._advance_cleanup()

    def apply_outcome(self, action_id: int, outcome: Outcome) -> tuple[Action, ...]:
        if self._phase is COMPLETE:
            return NO_ACTIONS
        action = self._issued.get(action_id)
        if action is None:
            raise NotFound(f"unknown handoff action {action_id}")
        previous = self._outcomes.get(action_id)
        if previous is not None:
            if previous != outcome:
                raise FailedPrecondition(f"conflicting outcome for handoff action {action_id}")
            return NO_ACTIONS
        kind = action.kind

        if outcome.kind is FAILED:
            if kind is DO_CANCEL_SOURCE or kind is DO_CANCEL_DESTINATION:
                raise FailedPrecondition(f"handoff cleanup action {action_id} failed")
            self._outcomes[action_id] = outcome
            self._phase = CLEANING_UP
            return self._advance_cleanup()

        if outcome.kind not in ALLOWED_OUTCOMES[kind]:
            raise InvalidArgument(f"invalid handoff action outcome {outcome.describe()}")
        self._outcomes[action_id] = outcome

        if kind is DO_SUBMIT_PREFILL:
            self._submitted = True
        elif kind is DO_RESERVE_DESTINATION:
            self._accepted = True
            self._lifecycle.append(EV_DESTINATION_ACCEPTED)
        elif kind is DO_START_TRANSFER:
            self._transfer_scheduled = True
        elif kind is DO_ACTIVATE_DESTINATION:
            self._activation_applied = True
            self._lifecycle.append(EV_DESTINATION_ACTIVATED)
        elif kind is DO_CANCEL_DESTINATION:
            self._destination_done = True
        else:
            assert kind in CLEANUP_KINDS
            if kind is DO_RELEASE_SOURCE:
                self._lifecycle.append(EV_SOURCE_RELEASED)
            self._source_done = True

        if self._phase is ACTIVE:
            return self._advance_active()
        return self._advance_cleanup()

    # --- transitions ------------------------------------------------------

    def _on_source_held(self, timing: TransferTiming) -> tuple[Action, ...]:
        if self._held:
            return NO_ACTIONS
        if not self._submitted:
            raise FailedPrecondition("source held before prefill submission was acknowledged")
        if self._reserved and not self._transfer_issued:
            self._transfer_delay_ms = self._scheduled_delay(timing, self._transferable_tokens)
        self._held = True
        self._transfer_timing = timing
        self._lifecycle.append(EV_SOURCE_HELD)
        return self._advance_active()

    def _on_destination_reserved(self, tokens: int) -> tuple[Action, ...]:
        if self._reserved:
            return NO_ACTIONS
        if not self._accepted:
            raise FailedPrecondition("destination reserved before ownership was accepted")
        timing = self._transfer_timing
        if timing is not None and not self._transfer_issued:
            self._transfer_delay_ms = self._scheduled_delay(timing, tokens)
        self._reserved = True
        self._transferable_tokens = tokens
        self._lifecycle.append(EV_DESTINATION_RESERVED)
        return self._advance_active()

    def _on_engine_lost(self, side: Side) -> tuple[Action, ...]:
        # Never rejected (DESIGN.md, correction 7): the lost side is settled,
        # and nothing is owed to it from now on.
        # A side that freed what it held, or was lost already, owes nothing
        # either way; after CANCELED nothing is owed to anyone. (So a source
        # lost after SUCCESS changes nothing: it released or was lost.)
        if self._completion is CANCELED:
            return NO_ACTIONS
        if side is Side.SOURCE:
            if self._source_lost or self._source_done:
                return NO_ACTIONS
            self._source_lost = True
            self._lifecycle.append(EV_SOURCE_LOST)
            if self._phase is ACTIVE and self._transfer_completed:
                # The destination has the KV: it no longer needs the source.
                return self._advance_active()
        else:
            if self._destination_lost or self._destination_done:
                return NO_ACTIONS
            # After SUCCESS this reopens the handoff: the decode that owned the
            # request died, and nothing is owed to it, so it completes CANCELED.
            self._destination_lost = True
            self._lifecycle.append(EV_DESTINATION_LOST)
        self._phase = CLEANING_UP
        return self._advance_cleanup()

    def _scheduled_delay(self, timing: TransferTiming, tokens: int) -> float:
        # Validated where it is computed: in DESTINATION_MISSING mode the
        # token count comes from the destination and is bounded by nothing.
        delay = timing.delay_ms(tokens)
        if delay is None:
            delay = self.fallback_transfer_delay_ms
        validate_delay_ms(delay)
        return delay

    def _advance_active(self) -> tuple[Action, ...]:
        if self.order is SOURCE_FIRST and self._held and not self._reserve_issued:
            return (self._issue_reserve_destination(),)
        if self.order is DESTINATION_FIRST and self._reserved and not self._submit_issued:
            return (self._issue_submit_prefill(),)
        if self._held and self._reserved and not self._transfer_issued:
            self._transfer_issued = True
            return (self._issue(DO_START_TRANSFER, self._transfer_delay_ms),)
        if self._transfer_completed and not self._activation_issued:
            self._activation_issued = True
            return (self._issue(DO_ACTIVATE_DESTINATION),)
        if self._activation_applied and self._source_lost:
            return (self._complete(),)  # an outstanding ReleaseSource stops mattering
        if self._activation_applied and not self._release_issued:
            self._release_issued = True
            return (self._issue(DO_RELEASE_SOURCE),)
        if self._source_done:
            return (self._complete(),)
        return NO_ACTIONS

    def _advance_cleanup(self) -> tuple[Action, ...]:
        # A side is owed cleanup once it was asked to act, until it acknowledged
        # a release or cancel or was lost.
        source_owed = self._submit_issued and not self._source_done and not self._source_lost
        destination_owed = (
            self._reserve_issued and not self._destination_done and not self._destination_lost
        )
        actions: list[Action] = []
        if source_owed and not self._source_cancel_issued:
            self._source_cancel_issued = True
            actions.append(self._issue(DO_CANCEL_SOURCE))
        if destination_owed and not self._destination_cancel_issued:
            self._destination_cancel_issued = True
            actions.append(self._issue(DO_CANCEL_DESTINATION))
        if not source_owed and not destination_owed:
            actions.append(self._complete())
        return tuple(actions)

    def _issue_submit_prefill(self) -> Action:
        self._submit_issued = True
        return self._issue(DO_SUBMIT_PREFILL)

    def _issue_reserve_destination(self) -> Action:
        self._reserve_issued = True
        return self._issue(DO_RESERVE_DESTINATION)

    def _complete(self) -> Action:
        completion = self._completion = CANCELED if self._phase is CLEANING_UP else SUCCESS
        self._phase = COMPLETE
        action = self._issue(DO_COMPLETE, completion=completion)
        self._issued.clear()
        self._outcomes.clear()
        # Read only while ACTIVE, which a handoff never is again. Forgotten so
        # that every completed core is one of a few states (see Ending).
        self._transfer_timing = None
        self._transferable_tokens = 0
        self._transfer_delay_ms = 0.0
        self._lifecycle.append(EV_COMPLETED)
        return action

    def _issue(
        self,
        kind: ActionKind,
        delay_ms: float | None = None,
        completion: Completion | None = None,
    ) -> Action:
        action = Action(self._next_action_id, kind, delay_ms, completion)
        self._next_action_id += 1
        self._issued[action.id] = action
        return action


_state_of = operator.attrgetter(*Handoff.__slots__)
# Every slot's value, then copies of the three containers (the journal and the lifecycle).
Checkpoint = tuple[tuple[object, ...], dict[int, Action], dict[int, Outcome], list[LifecycleEvent]]

# Every slot a completed core keeps but its identity, its journal (empty once
# complete) and what Ending names on its own.
_REST_SLOTS = tuple(
    name
    for name in Handoff.__slots__
    if name
    not in (
        "handoff_id",
        "fallback_transfer_delay_ms",
        "order",
        "_completion",
        "_lifecycle",
        "_issued",
        "_outcomes",
    )
)
_rest_of = operator.attrgetter(*_REST_SLOTS)


@dataclass(frozen=True, slots=True)
class Ending:
    """How a handoff ended: all of a completed core but its id and fallback delay.

    Every value in it comes from a small finite set (enums, flags, an action
    counter below ten, at most seven lifecycle events; the transfer's sizes
    are forgotten on completion), so few distinct endings exist and the
    handoffs that ended alike share one.
    """

    order: Order
    completion: Completion
    lifecycle: tuple[LifecycleEvent, ...]
    rest: tuple[object, ...]  # the other slots' values, in _REST_SLOTS order


_ENDINGS: dict[Ending, Ending] = {}  # each distinct ending once, shared by all that end so


class Completed:
    """A completed handoff as :meth:`Handoff.pack` packs it: reads like one, and
    :meth:`unpack` gives back exactly the core it was packed from."""

    __slots__ = ("handoff_id", "fallback_transfer_delay_ms", "ending")

    def __init__(self, handoff_id: str, fallback_transfer_delay_ms: float, ending: Ending) -> None:
        self.handoff_id = handoff_id
        self.fallback_transfer_delay_ms = fallback_transfer_delay_ms
        self.ending = ending

    @property
    def order(self) -> Order:
        return self.ending.order

    @property
    def phase(self) -> Phase:
        return COMPLETE

    @property
    def completion(self) -> Completion:
        return self.ending.completion

    @property
    def lifecycle(self) -> tuple[LifecycleEvent, ...]:
        return self.ending.lifecycle

    def snapshot(self) -> tuple[object, ...]:
        """The snapshot of the core it was packed from."""
        return self.unpack().snapshot()

    def unpack(self) -> Handoff:
        core = object.__new__(Handoff)
        for name, value in zip(_REST_SLOTS, self.ending.rest, strict=True):
            setattr(core, name, value)
        core.handoff_id = self.handoff_id
        core.fallback_transfer_delay_ms = self.fallback_transfer_delay_ms
        core.order = self.ending.order
        core._completion = self.ending.completion
        core._lifecycle = list(self.ending.lifecycle)
        core._issued = {}
        core._outcomes = {}
        return core
