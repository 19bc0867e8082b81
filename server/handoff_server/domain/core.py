"""The handoff state machine: the one module that owns every transition.

Pure in the sans-IO sense: no I/O, no clock, no asyncio. The registry feeds it
facts and outcomes and routes the actions it returns; packing for retention
lives in :mod:`handoff_server.domain.packing`.

A handoff is its phase (ACTIVE, CLEANING_UP, COMPLETE; docs/semantics.md) and four
small records, as in the seed's Rust core:

- ``source``: how far the prefill got (:class:`SourceStage`: submitted, held,
  released) and whether it still holds anything (:class:`Settlement`);
- ``destination``: the same for the decode (:class:`DestinationStage`:
  accepted, reserved, activated);
- ``transfer``: the KV transfer (:class:`TransferStage`) and its delay;
- ``journal``: every issued action and its outcome (:class:`ActionJournal`).

Facts and outcomes move one record each; the next action then reads off the
records, in :meth:`Handoff._advance_active` (the success path, in order) or
:meth:`Handoff._advance_cleanup` (cancel whatever a side may still hold).
A side that was lost (``EngineLost``, correction 7) is settled like one that
freed what it held: nothing is owed to it.

Every public call is atomic. All checks that can reject a call run before the
first attribute is written, so a rejected call leaves the handoff exactly as
it was (docs/semantics.md, correction 5).
"""

from __future__ import annotations

import enum
import math

from handoff_server.domain.model import (
    ALLOWED_OUTCOMES,
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
    Role,
    SourceHeld,
    TransferCompleted,
    TransferTiming,
    validate_delay_ms,
)

NO_ACTIONS: tuple[Action, ...] = ()


class SourceStage(enum.Enum):
    """How far the prefill got on the way to a success. It never goes back."""

    UNSUBMITTED = "unsubmitted"  # not asked to act yet
    SUBMITTING = "submitting"  # SubmitPrefill issued
    SUBMITTED = "submitted"  # ... and acknowledged
    HELD = "held"  # SourceHeld applied: it holds the KV for the transfer
    RELEASING = "releasing"  # ReleaseSource issued


class DestinationStage(enum.Enum):
    """How far the decode got on the way to a success. It never goes back."""

    UNRESERVED = "unreserved"  # not asked to act yet
    RESERVING = "reserving"  # ReserveDestination issued
    ACCEPTED = "accepted"  # ... and accepted
    RESERVED = "reserved"  # DestinationReserved applied
    ACTIVATING = "activating"  # ActivateDestination issued
    ACTIVATED = "activated"  # ... and applied: the decode owns the request


class TransferStage(enum.Enum):
    """How far the KV transfer got. It never goes back."""

    WAITING = "waiting"  # for the source to hold and the destination to reserve
    STARTING = "starting"  # StartTransfer issued
    SCHEDULED = "scheduled"  # ... and scheduled
    TRANSFERRED = "transferred"  # TransferCompleted applied: the destination has the KV


class Settlement(enum.Enum):
    """Whether a side may still hold something for the handoff."""

    OPEN = "open"  # it may, if it was ever asked to act
    CANCELING = "canceling"  # a cancel was issued to it
    FREED = "freed"  # it acknowledged a release or a cancel
    LOST = "lost"  # EngineLost: its memory for the handoff is gone


# CPython 3.11 looks an Enum member up through EnumType.__getattr__, about
# twenty times the cost of a global (3.12 dropped it), and the transitions
# test members on every call: bench/core.py runs at half the speed without
# these bindings (bench/RESULTS.md).
ACTIVE, CLEANING_UP, COMPLETE = Phase.ACTIVE, Phase.CLEANING_UP, Phase.COMPLETE
SUCCESS, CANCELED = Completion.SUCCESS, Completion.CANCELED
SOURCE_FIRST, DESTINATION_FIRST = Order.SOURCE_FIRST, Order.DESTINATION_FIRST
FAILED = OutcomeKind.FAILED
UNSUBMITTED, SUBMITTING, SUBMITTED = (
    SourceStage.UNSUBMITTED,
    SourceStage.SUBMITTING,
    SourceStage.SUBMITTED,
)
HELD, RELEASING = SourceStage.HELD, SourceStage.RELEASING
UNRESERVED, RESERVING, ACCEPTED = (
    DestinationStage.UNRESERVED,
    DestinationStage.RESERVING,
    DestinationStage.ACCEPTED,
)
RESERVED, ACTIVATING, ACTIVATED = (
    DestinationStage.RESERVED,
    DestinationStage.ACTIVATING,
    DestinationStage.ACTIVATED,
)
WAITING, STARTING = TransferStage.WAITING, TransferStage.STARTING
SCHEDULED, TRANSFERRED = TransferStage.SCHEDULED, TransferStage.TRANSFERRED
OPEN, CANCELING, FREED, LOST = (
    Settlement.OPEN,
    Settlement.CANCELING,
    Settlement.FREED,
    Settlement.LOST,
)
SUBMIT_PREFILL, RESERVE_DESTINATION = ActionKind.SUBMIT_PREFILL, ActionKind.RESERVE_DESTINATION
START_TRANSFER, ACTIVATE_DESTINATION = ActionKind.START_TRANSFER, ActionKind.ACTIVATE_DESTINATION
RELEASE_SOURCE, CANCEL_SOURCE = ActionKind.RELEASE_SOURCE, ActionKind.CANCEL_SOURCE
CANCEL_DESTINATION, NOTIFY_COMPLETE = ActionKind.CANCEL_DESTINATION, ActionKind.COMPLETE
SOURCE_HELD, DESTINATION_RESERVED = LifecycleEvent.SOURCE_HELD, LifecycleEvent.DESTINATION_RESERVED
DESTINATION_ACCEPTED = LifecycleEvent.DESTINATION_ACCEPTED
DESTINATION_ACTIVATED = LifecycleEvent.DESTINATION_ACTIVATED
SOURCE_RELEASED, COMPLETED = LifecycleEvent.SOURCE_RELEASED, LifecycleEvent.COMPLETED


class SourceProgress:
    """The prefill engine's side. ``timing`` is set once it holds the KV."""

    __slots__ = ("stage", "settlement", "timing")

    def __init__(self) -> None:
        self.stage = UNSUBMITTED
        self.settlement = OPEN
        self.timing: TransferTiming | None = None

    @property
    def owed_cleanup(self) -> bool:
        """Asked to act, and neither freed what it holds nor lost."""
        settlement = self.settlement
        return self.stage is not UNSUBMITTED and (settlement is OPEN or settlement is CANCELING)


class DestinationProgress:
    """The decode engine's side. ``tokens`` is what it reserved room for."""

    __slots__ = ("stage", "settlement", "tokens")

    def __init__(self) -> None:
        self.stage = UNRESERVED
        self.settlement = OPEN
        self.tokens = 0

    @property
    def owed_cleanup(self) -> bool:
        """Asked to act, and neither freed what it holds nor lost."""
        settlement = self.settlement
        return self.stage is not UNRESERVED and (settlement is OPEN or settlement is CANCELING)


class TransferProgress:
    """The KV transfer. ``delay_ms`` is set once both sides have reported."""

    __slots__ = ("stage", "delay_ms")

    def __init__(self) -> None:
        self.stage = WAITING
        self.delay_ms = 0.0


class ActionJournal:
    """Every action issued, by id (0, 1, 2, ... in issue order), and the outcomes
    reported for them. Forgotten on completion but for the next id: outcomes
    are then acknowledged without checks, and a reopened handoff numbers on."""

    __slots__ = ("next_id", "issued", "outcomes")

    def __init__(self) -> None:
        self.next_id = 0
        self.issued: dict[int, Action] = {}
        self.outcomes: dict[int, Outcome] = {}

    def issue(
        self, kind: ActionKind, delay_ms: float | None = None, completion: Completion | None = None
    ) -> Action:
        action = Action(self.next_id, kind, delay_ms, completion)
        self.next_id += 1
        self.issued[action.id] = action
        return action

    def outstanding(self) -> tuple[Action, ...]:
        if len(self.outcomes) == len(self.issued):
            return NO_ACTIONS  # outcomes are kept only for issued actions: all are in
        return tuple(a for i, a in self.issued.items() if i not in self.outcomes)

    def forget(self) -> None:
        self.issued.clear()
        self.outcomes.clear()


# Every piece of a handoff's state but its identity (id, order, fallback delay),
# as immutable values: the phase, the completion, the lifecycle, each record.
Checkpoint = tuple[
    Phase,
    Completion | None,
    tuple[LifecycleEvent, ...],
    tuple[SourceStage, Settlement, TransferTiming | None],
    tuple[DestinationStage, Settlement, int],
    tuple[TransferStage, float],
    tuple[int, tuple[tuple[int, Action], ...], tuple[tuple[int, Outcome], ...]],
]


class Handoff:
    """One prefill-to-decode ownership handoff.

    Callers read ``phase``, ``completion``, ``lifecycle``, ``outstanding`` and
    may read the four records; every write to them is a transition here.
    """

    __slots__ = (
        "handoff_id",
        "order",
        "fallback_transfer_delay_ms",
        "source",
        "destination",
        "transfer",
        "journal",
        "_phase",
        "_completion",
        "_lifecycle",
    )

    def __init__(self, handoff_id: str, order: Order, fallback_transfer_delay_ms: float) -> None:
        if not (math.isfinite(fallback_transfer_delay_ms) and fallback_transfer_delay_ms >= 0.0):
            raise InvalidArgument("invalid fallback transfer delay")
        self.handoff_id = handoff_id
        self.order = order
        self.fallback_transfer_delay_ms = fallback_transfer_delay_ms
        self.source = SourceProgress()
        self.destination = DestinationProgress()
        self.transfer = TransferProgress()
        self.journal = ActionJournal()
        self._phase = ACTIVE
        self._completion: Completion | None = None
        self._lifecycle: list[LifecycleEvent] = []

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
        return self.journal.outstanding()

    def is_outstanding(self, action_id: int) -> bool:
        journal = self.journal
        return action_id in journal.issued and action_id not in journal.outcomes

    def checkpoint(self) -> Checkpoint:
        """All the state a call may change, as immutable values: :meth:`restore`
        undoes later calls with it (the registry's undo of a call that crashed),
        and :mod:`handoff_server.domain.packing` keeps a completed handoff as one."""
        source, destination, transfer, journal = (
            self.source,
            self.destination,
            self.transfer,
            self.journal,
        )
        return (
            self._phase,
            self._completion,
            tuple(self._lifecycle),
            (source.stage, source.settlement, source.timing),
            (destination.stage, destination.settlement, destination.tokens),
            (transfer.stage, transfer.delay_ms),
            (journal.next_id, tuple(journal.issued.items()), tuple(journal.outcomes.items())),
        )

    def restore(self, checkpoint: Checkpoint) -> None:
        phase, completion, lifecycle, source, destination, transfer, journal = checkpoint
        self._phase, self._completion, self._lifecycle = phase, completion, list(lifecycle)
        self.source.stage, self.source.settlement, self.source.timing = source
        self.destination.stage, self.destination.settlement, self.destination.tokens = destination
        self.transfer.stage, self.transfer.delay_ms = transfer
        next_id, issued, outcomes = journal
        self.journal.next_id, self.journal.issued, self.journal.outcomes = (
            next_id,
            dict(issued),
            dict(outcomes),
        )

    def snapshot(self) -> tuple[object, ...]:
        """Every piece of state, as comparable values: two equal snapshots are one state."""
        return (self.handoff_id, self.order, self.fallback_transfer_delay_ms, self.checkpoint())

    # --- calls ------------------------------------------------------------

    def start(self) -> tuple[Action, ...]:
        # Started once its first action is issued. A terminal fact before
        # start completes the handoff with nothing issued; starting it then
        # would issue work nothing can ever retire.
        if self.journal.next_id or self._phase is not ACTIVE:
            return NO_ACTIONS
        if self.order is SOURCE_FIRST:
            self.source.stage = SUBMITTING
            return (self.journal.issue(SUBMIT_PREFILL),)
        self.destination.stage = RESERVING
        return (self.journal.issue(RESERVE_DESTINATION),)

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
            return self._on_transfer_completed()
        self._phase = CLEANING_UP
        return self._advance_cleanup()

    def apply_outcome(self, action_id: int, outcome: Outcome) -> tuple[Action, ...]:
        if self._phase is COMPLETE:
            return NO_ACTIONS
        journal = self.journal
        action = journal.issued.get(action_id)
        if action is None:
            raise NotFound(f"unknown handoff action {action_id}")
        previous = journal.outcomes.get(action_id)
        if previous is not None:
            if previous != outcome:
                raise FailedPrecondition(f"conflicting outcome for handoff action {action_id}")
            return NO_ACTIONS
        kind = action.kind

        if outcome.kind is FAILED:
            if kind is CANCEL_SOURCE or kind is CANCEL_DESTINATION:
                raise FailedPrecondition(f"handoff cleanup action {action_id} failed")
            journal.outcomes[action_id] = outcome
            self._phase = CLEANING_UP
            return self._advance_cleanup()

        if outcome.kind not in ALLOWED_OUTCOMES[kind]:
            raise InvalidArgument(f"invalid handoff action outcome {outcome.describe()}")
        journal.outcomes[action_id] = outcome

        # Each acknowledged action moves the side it was addressed to one stage
        # on; a release or cancel settles that side (a lost one stays lost).
        if kind is SUBMIT_PREFILL:
            self.source.stage = SUBMITTED
        elif kind is RESERVE_DESTINATION:
            self.destination.stage = ACCEPTED
            self._lifecycle.append(DESTINATION_ACCEPTED)
        elif kind is START_TRANSFER:
            self.transfer.stage = SCHEDULED
        elif kind is ACTIVATE_DESTINATION:
            self.destination.stage = ACTIVATED
            self._lifecycle.append(DESTINATION_ACTIVATED)
        elif kind is CANCEL_DESTINATION:
            if self.destination.settlement is not LOST:
                self.destination.settlement = FREED
        else:  # RELEASE_SOURCE or CANCEL_SOURCE
            if kind is RELEASE_SOURCE:
                self._lifecycle.append(SOURCE_RELEASED)
            if self.source.settlement is not LOST:
                self.source.settlement = FREED

        if self._phase is ACTIVE:
            return self._advance_active()
        return self._advance_cleanup()

    # --- transitions ------------------------------------------------------

    def _on_source_held(self, timing: TransferTiming) -> tuple[Action, ...]:
        source = self.source
        if source.stage is not SUBMITTED:
            if source.stage is UNSUBMITTED or source.stage is SUBMITTING:
                raise FailedPrecondition("source held before prefill submission was acknowledged")
            return NO_ACTIONS  # held already
        if self.destination.stage is RESERVED:
            # Both sides have reported: the transfer can be sized.
            self.transfer.delay_ms = self._scheduled_delay(timing, self.destination.tokens)
        source.stage = HELD
        source.timing = timing
        self._lifecycle.append(SOURCE_HELD)
        return self._advance_active()

    def _on_destination_reserved(self, tokens: int) -> tuple[Action, ...]:
        destination = self.destination
        if destination.stage is not ACCEPTED:
            if destination.stage is UNRESERVED or destination.stage is RESERVING:
                raise FailedPrecondition("destination reserved before ownership was accepted")
            return NO_ACTIONS  # reserved already
        timing = self.source.timing
        if timing is not None:
            # Both sides have reported: the transfer can be sized.
            self.transfer.delay_ms = self._scheduled_delay(timing, tokens)
        destination.stage = RESERVED
        destination.tokens = tokens
        self._lifecycle.append(DESTINATION_RESERVED)
        return self._advance_active()

    def _on_transfer_completed(self) -> tuple[Action, ...]:
        transfer = self.transfer
        if transfer.stage is not SCHEDULED:
            if transfer.stage is TRANSFERRED:
                return NO_ACTIONS
            raise FailedPrecondition("transfer completed before it was scheduled")
        transfer.stage = TRANSFERRED
        return self._advance_active()

    def _on_engine_lost(self, side: Role) -> tuple[Action, ...]:
        # Never rejected (docs/semantics.md, correction 7). A side that freed what it
        # held, or was lost already, has nothing left to lose; after CANCELED
        # nothing is owed to anyone. (So a source lost after SUCCESS changes
        # nothing: it released or was lost.)
        progress = self.source if side is Role.SOURCE else self.destination
        settlement = progress.settlement
        if self._completion is CANCELED or settlement is FREED or settlement is LOST:
            return NO_ACTIONS
        progress.settlement = LOST
        if side is Role.SOURCE:
            self._lifecycle.append(LifecycleEvent.SOURCE_LOST)
            if self._phase is ACTIVE and self.transfer.stage is TRANSFERRED:
                # The destination has the KV: it no longer needs the source.
                return self._advance_active()
        else:
            # After SUCCESS this reopens the handoff: the decode that owned the
            # request is gone, nothing is owed to it, so it completes CANCELED.
            self._lifecycle.append(LifecycleEvent.DESTINATION_LOST)
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
        """The success path: the next action, read off the records in order."""
        source, destination, transfer = self.source, self.destination, self.transfer
        if self.order is SOURCE_FIRST and source.stage is HELD and destination.stage is UNRESERVED:
            destination.stage = RESERVING
            return (self.journal.issue(RESERVE_DESTINATION),)
        if (
            self.order is DESTINATION_FIRST
            and destination.stage is RESERVED
            and source.stage is UNSUBMITTED
        ):
            source.stage = SUBMITTING
            return (self.journal.issue(SUBMIT_PREFILL),)
        if transfer.stage is WAITING and source.stage is HELD and destination.stage is RESERVED:
            transfer.stage = STARTING
            return (self.journal.issue(START_TRANSFER, transfer.delay_ms),)
        if transfer.stage is TRANSFERRED and destination.stage is RESERVED:
            destination.stage = ACTIVATING
            return (self.journal.issue(ACTIVATE_DESTINATION),)
        if destination.stage is ACTIVATED:
            if source.settlement is not OPEN:
                # Released, or lost once the destination had the KV (an
                # outstanding ReleaseSource then stops mattering).
                return (self._complete(),)
            if source.stage is HELD:
                source.stage = RELEASING
                return (self.journal.issue(RELEASE_SOURCE),)
        return NO_ACTIONS

    def _advance_cleanup(self) -> tuple[Action, ...]:
        """Cancel each side that may still hold something; complete once none does."""
        source, destination = self.source, self.destination
        source_owed, destination_owed = source.owed_cleanup, destination.owed_cleanup
        actions: list[Action] = []
        if source_owed and source.settlement is OPEN:
            source.settlement = CANCELING
            actions.append(self.journal.issue(CANCEL_SOURCE))
        if destination_owed and destination.settlement is OPEN:
            destination.settlement = CANCELING
            actions.append(self.journal.issue(CANCEL_DESTINATION))
        if not source_owed and not destination_owed:
            actions.append(self._complete())
        return tuple(actions)

    def _complete(self) -> Action:
        completion = self._completion = CANCELED if self._phase is CLEANING_UP else SUCCESS
        self._phase = COMPLETE
        action = self.journal.issue(NOTIFY_COMPLETE, completion=completion)
        self.journal.forget()
        # Read only while ACTIVE, which a handoff never is again. Forgotten so
        # that every completed core is one of a few states (see packing).
        self.source.timing = None
        self.destination.tokens = 0
        self.transfer.delay_ms = 0.0
        self._lifecycle.append(COMPLETED)
        return action
