"""State-machine helpers shared by the core tests (plain and packed)."""

from __future__ import annotations

import math

from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from handoff_server.domain.core import Handoff
from handoff_server.domain.model import (
    ALLOWED_OUTCOMES,
    Action,
    ActionKind,
    Canceled,
    Completion,
    DestinationReserved,
    EngineLost,
    Fact,
    Failed,
    HandoffError,
    LifecycleEvent,
    Order,
    Outcome,
    OutcomeKind,
    Phase,
    Role,
    SourceHeld,
    TimedOut,
    TimingMode,
    TransferCompleted,
    TransferTiming,
)

HANDOFF_ID = "00000000-0000-4000-8000-000000000001"
SUBMITTED = Outcome(OutcomeKind.SUBMITTED)
ACCEPTED = Outcome(OutcomeKind.ACCEPTED)
SCHEDULED = Outcome(OutcomeKind.SCHEDULED)
APPLIED = Outcome(OutcomeKind.APPLIED)
NOOP = Outcome(OutcomeKind.NOOP)
NO_MODEL = TransferTiming(TimingMode.DESTINATION_MISSING, full_prompt_tokens=4)


# What a handoff that succeeds records, in order (docs/semantics.md).
EXPECTED_LIFECYCLE: dict[Order, tuple[LifecycleEvent, ...]] = {
    Order.SOURCE_FIRST: (
        LifecycleEvent.SOURCE_HELD,
        LifecycleEvent.DESTINATION_ACCEPTED,
        LifecycleEvent.DESTINATION_RESERVED,
        LifecycleEvent.DESTINATION_ACTIVATED,
        LifecycleEvent.SOURCE_RELEASED,
        LifecycleEvent.COMPLETED,
    ),
    Order.DESTINATION_FIRST: (
        LifecycleEvent.DESTINATION_ACCEPTED,
        LifecycleEvent.DESTINATION_RESERVED,
        LifecycleEvent.SOURCE_HELD,
        LifecycleEvent.DESTINATION_ACTIVATED,
        LifecycleEvent.SOURCE_RELEASED,
        LifecycleEvent.COMPLETED,
    ),
}


def kinds(actions: tuple[Action, ...]) -> list[ActionKind]:
    return [a.kind for a in actions]


def only(actions: tuple[Action, ...]) -> Action:
    assert len(actions) == 1, actions
    return actions[0]


def held_and_reserved(order: Order, timing: TransferTiming = NO_MODEL, tokens: int = 4) -> Handoff:
    """A handoff up to (not including) the fact that schedules the transfer."""
    handoff = Handoff(HANDOFF_ID, order, fallback_transfer_delay_ms=7.5)
    first = only(handoff.start())
    if order is Order.SOURCE_FIRST:
        handoff.apply_outcome(first.id, SUBMITTED)
        reserve = only(handoff.apply_fact(SourceHeld(timing)))
        handoff.apply_outcome(reserve.id, ACCEPTED)
    else:
        handoff.apply_outcome(first.id, ACCEPTED)
        submit = only(handoff.apply_fact(DestinationReserved(tokens)))
        handoff.apply_outcome(submit.id, SUBMITTED)
    return handoff


def schedule_transfer(handoff: Handoff, timing: TransferTiming = NO_MODEL) -> Action:
    if handoff.order is Order.SOURCE_FIRST:
        return only(handoff.apply_fact(DestinationReserved(4)))
    return only(handoff.apply_fact(SourceHeld(timing)))


def completed(order: Order) -> Handoff:
    handoff = held_and_reserved(order)
    transfer = schedule_transfer(handoff)
    handoff.apply_outcome(transfer.id, SCHEDULED)
    activate = only(handoff.apply_fact(TransferCompleted()))
    release = only(handoff.apply_outcome(activate.id, APPLIED))
    complete = only(handoff.apply_outcome(release.id, APPLIED))
    assert complete.kind is ActionKind.COMPLETE
    return handoff


def transferred(order: Order) -> tuple[Handoff, Action]:
    """A handoff whose KV reached the destination; returns ActivateDestination."""
    handoff = held_and_reserved(order)
    transfer = schedule_transfer(handoff)
    handoff.apply_outcome(transfer.id, SCHEDULED)
    activate = only(handoff.apply_fact(TransferCompleted()))
    assert activate.kind is ActionKind.ACTIVATE_DESTINATION
    return handoff, activate


bandwidths = st.one_of(
    st.none(),
    st.sampled_from([0.0, 1.0, 100.0, -1.0, math.inf, -math.inf, math.nan, 1e-300]),
    st.floats(min_value=0.0, max_value=1e3),
)
timings = st.builds(
    TransferTiming,
    mode=st.sampled_from(list(TimingMode)),
    full_prompt_tokens=st.integers(0, 1 << 62),
    kv_bytes_per_token=st.one_of(st.none(), st.integers(0, 1 << 20)),
    bandwidth_gb_s=bandwidths,
    state_bytes=st.integers(0, 1 << 30),
)
facts: st.SearchStrategy[Fact] = st.one_of(
    st.builds(SourceHeld, timings),
    st.builds(DestinationReserved, st.integers(0, 1 << 62)),
    st.just(TransferCompleted()),
    st.sampled_from([Failed(), TimedOut(), Canceled()]),
    # EngineLost names one side: convert refuses ROLE_BOTH, so the core never sees it.
    st.builds(EngineLost, st.sampled_from([Role.SOURCE, Role.DESTINATION])),
)
LOST_EVENT = {
    Role.SOURCE: LifecycleEvent.SOURCE_LOST,
    Role.DESTINATION: LifecycleEvent.DESTINATION_LOST,
}
# Every action but the Complete notice goes to one side (StartTransfer: whichever
# executes it, so neither may be lost when it is issued).
SIDES_OF = {
    ActionKind.SUBMIT_PREFILL: {Role.SOURCE},
    ActionKind.RELEASE_SOURCE: {Role.SOURCE},
    ActionKind.CANCEL_SOURCE: {Role.SOURCE},
    ActionKind.RESERVE_DESTINATION: {Role.DESTINATION},
    ActionKind.ACTIVATE_DESTINATION: {Role.DESTINATION},
    ActionKind.CANCEL_DESTINATION: {Role.DESTINATION},
    ActionKind.START_TRANSFER: {Role.SOURCE, Role.DESTINATION},
    ActionKind.COMPLETE: set(),
}


def lost_sides(handoff: Handoff) -> set[Role]:
    return {side for side, event in LOST_EVENT.items() if event in handoff.lifecycle}


outcomes = st.builds(
    Outcome,
    kind=st.sampled_from(list(OutcomeKind)),
    reason=st.sampled_from(["", "engine error"]),
)


class HandoffMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.handoff = Handoff("00000000-0000-4000-8000-000000000002", Order.SOURCE_FIRST, 0.0)
        self.issued: list[Action] = []
        self.acknowledged: dict[int, Outcome] = {}
        self.completions: list[Completion] = []

    @initialize(order=st.sampled_from(list(Order)), fallback=st.sampled_from([0.0, 7.5]))
    def create(self, order: Order, fallback: float) -> None:
        self.handoff = Handoff("00000000-0000-4000-8000-000000000002", order, fallback)

    def call(self, apply: object, *args: object) -> None:
        """Run one core call; a rejection must leave every bit of state as it was."""
        before = self.handoff.snapshot()
        phase_before = self.handoff.phase
        try:
            actions: tuple[Action, ...] = apply(*args)  # type: ignore[operator]
        except HandoffError:
            assert self.handoff.snapshot() == before
            assert not any(isinstance(arg, EngineLost) for arg in args), "EngineLost rejected"
            return
        self.issued.extend(actions)
        # Nothing is owed to a lost side: no action goes to it once it is lost,
        # including in the call that lost it.
        lost = lost_sides(self.handoff)
        for action in actions:
            assert not SIDES_OF[action.kind] & lost, f"{action} issued to a lost side"
            if action.kind is ActionKind.COMPLETE:
                assert action.completion is self.handoff.completion
        completes = [a for a in actions if a.kind is ActionKind.COMPLETE]
        assert len(completes) <= 1
        if completes:
            if phase_before is Phase.COMPLETE:  # only a lost decode completes twice in one call
                assert args == (EngineLost(Role.DESTINATION),)
            assert self.handoff.phase is Phase.COMPLETE
            assert self.handoff.completion is not None
            self.completions.append(self.handoff.completion)
        elif self.handoff.phase is Phase.COMPLETE:
            assert phase_before is Phase.COMPLETE, "completed without issuing Complete"

    @rule()
    def start(self) -> None:
        self.call(self.handoff.start)

    @rule(fact=facts)
    def fact(self, fact: Fact) -> None:
        self.call(self.handoff.apply_fact, fact)

    @rule(data=st.data())
    def random_outcome(self, data: st.DataObject) -> None:
        action_id = data.draw(st.integers(0, len(self.issued) + 1))
        outcome = data.draw(outcomes)
        self.record_outcome(action_id, outcome)

    @rule(data=st.data())
    def right_outcome(self, data: st.DataObject) -> None:
        """Acknowledge an outstanding action correctly, so runs reach the end."""
        outstanding = self.handoff.outstanding
        if not outstanding:
            return
        action = data.draw(st.sampled_from(outstanding))
        kind = data.draw(st.sampled_from(sorted(ALLOWED_OUTCOMES[action.kind], key=str)))
        self.record_outcome(action.id, Outcome(kind))

    @rule()
    def drive(self) -> None:
        """Report the fact the handoff is waiting for, if any."""
        seen = {a.kind for a in self.issued}
        if ActionKind.START_TRANSFER in seen:
            self.fact(TransferCompleted())
        elif ActionKind.SUBMIT_PREFILL in seen:
            self.fact(SourceHeld(TransferTiming(TimingMode.FULL_PROMPT, 16, 64, 10.0)))
        if ActionKind.RESERVE_DESTINATION in seen:
            self.fact(DestinationReserved(16))

    def record_outcome(self, action_id: int, outcome: Outcome) -> None:
        was_outstanding = self.handoff.is_outstanding(action_id)
        before = self.handoff.snapshot()
        self.call(self.handoff.apply_outcome, action_id, outcome)
        if was_outstanding and self.handoff.snapshot() != before:
            self.acknowledged[action_id] = outcome

    @invariant()
    def every_handoff_can_complete(self) -> None:
        """Losing both engines completes any handoff at once: nothing can hang."""
        handoff = self.handoff
        if handoff.phase is Phase.COMPLETE:
            return
        before = handoff.snapshot()
        checkpoint = handoff.checkpoint()
        handoff.apply_fact(EngineLost(Role.SOURCE))
        handoff.apply_fact(EngineLost(Role.DESTINATION))
        assert (handoff.phase, handoff.completion) == (Phase.COMPLETE, Completion.CANCELED)
        handoff.restore(checkpoint)
        assert handoff.snapshot() == before

    @invariant()
    def each_side_is_lost_at_most_once(self) -> None:
        lifecycle = self.handoff.lifecycle
        assert all(lifecycle.count(event) <= 1 for event in LOST_EVENT.values())

    @invariant()
    def action_ids_have_no_gaps(self) -> None:
        assert [a.id for a in self.issued] == list(range(len(self.issued)))

    @invariant()
    def exactly_one_complete_per_completion(self) -> None:
        completes = [a for a in self.issued if a.kind is ActionKind.COMPLETE]
        assert len(completes) == len(self.completions)
        assert len(self.completions) <= 2
        if len(self.completions) == 2:  # only a reopened success completes twice
            assert self.completions == [Completion.SUCCESS, Completion.CANCELED]

    @invariant()
    def success_only_after_the_full_lifecycle(self) -> None:
        if self.handoff.completion is not Completion.SUCCESS:
            return
        if self.handoff.phase is not Phase.COMPLETE:
            return
        expected = EXPECTED_LIFECYCLE[self.handoff.order]
        lifecycle = self.handoff.lifecycle
        if LifecycleEvent.SOURCE_LOST in lifecycle:
            # The source was lost once the destination had the KV: no release.
            expected = tuple(e for e in expected if e is not LifecycleEvent.SOURCE_RELEASED)
            lifecycle = tuple(e for e in lifecycle if e is not LifecycleEvent.SOURCE_LOST)
        assert lifecycle == expected

    @invariant()
    def complete_means_every_resource_was_released(self) -> None:
        if self.handoff.phase is not Phase.COMPLETE:
            return
        assert self.handoff.outstanding == ()

        def acknowledged(kind: ActionKind) -> bool:
            return any(
                a.kind is kind
                and a.id in self.acknowledged
                and self.acknowledged[a.id].kind in (OutcomeKind.APPLIED, OutcomeKind.NOOP)
                for a in self.issued
            )

        kinds = {a.kind for a in self.issued}
        lost = lost_sides(self.handoff)
        if ActionKind.SUBMIT_PREFILL in kinds and Role.SOURCE not in lost:
            assert acknowledged(ActionKind.RELEASE_SOURCE) or acknowledged(ActionKind.CANCEL_SOURCE)
        if self.handoff.completion is Completion.SUCCESS:
            assert Role.DESTINATION not in lost
        if ActionKind.RESERVE_DESTINATION in kinds and Role.DESTINATION not in lost:
            if self.handoff.completion is Completion.SUCCESS:
                assert acknowledged(ActionKind.ACTIVATE_DESTINATION)
            else:
                assert acknowledged(ActionKind.CANCEL_DESTINATION)
