"""Named unit tests for correction 7: a lost engine owes nothing (docs/semantics.md)."""

from __future__ import annotations

import pytest

from handoff_server.domain.core import Handoff, Settlement
from handoff_server.domain.model import (
    Action,
    ActionKind,
    Canceled,
    Completion,
    EngineLost,
    Failed,
    FailedPrecondition,
    InvalidArgument,
    LifecycleEvent,
    Order,
    Outcome,
    OutcomeKind,
    Phase,
    Role,
)
from tests.support.core import (
    APPLIED,
    HANDOFF_ID,
    NOOP,
    SCHEDULED,
    completed,
    held_and_reserved,
    kinds,
    only,
    schedule_transfer,
    transferred,
)

SOURCE_LOST = EngineLost(Role.SOURCE)
DESTINATION_LOST = EngineLost(Role.DESTINATION)
ORDERS = pytest.mark.parametrize("order", list(Order))


def assert_complete(action: Action, handoff: Handoff, completion: Completion) -> None:
    assert action.kind is ActionKind.COMPLETE
    assert action.completion is completion  # the notice says how it ended
    assert (handoff.phase, handoff.completion) == (Phase.COMPLETE, completion)
    assert handoff.outstanding == ()


# --- ACTIVE, source lost after TransferCompleted: the handoff goes on ------------


@ORDERS
def test_source_lost_after_the_transfer_goes_on_and_succeeds_without_release(
    order: Order,
) -> None:
    handoff, activate = transferred(order)
    assert handoff.apply_fact(SOURCE_LOST) == ()
    assert handoff.phase is Phase.ACTIVE
    assert handoff.source.settlement is Settlement.LOST  # the record names the side
    complete = only(handoff.apply_outcome(activate.id, APPLIED))
    assert_complete(complete, handoff, Completion.SUCCESS)
    assert LifecycleEvent.SOURCE_RELEASED not in handoff.lifecycle
    assert handoff.lifecycle[-2:] == (
        LifecycleEvent.DESTINATION_ACTIVATED,
        LifecycleEvent.COMPLETED,
    )
    assert LifecycleEvent.SOURCE_LOST in handoff.lifecycle


@ORDERS
def test_source_lost_with_release_outstanding_completes_success_at_once(order: Order) -> None:
    handoff, activate = transferred(order)
    release = only(handoff.apply_outcome(activate.id, APPLIED))
    assert release.kind is ActionKind.RELEASE_SOURCE
    assert_complete(only(handoff.apply_fact(SOURCE_LOST)), handoff, Completion.SUCCESS)
    # The release's late outcome is answered like any outcome after completion.
    assert handoff.apply_outcome(release.id, NOOP) == ()


def test_a_failure_after_the_source_was_lost_cancels_only_the_destination() -> None:
    handoff, _ = transferred(Order.SOURCE_FIRST)
    handoff.apply_fact(SOURCE_LOST)
    cancel = only(handoff.apply_fact(Failed()))
    assert cancel.kind is ActionKind.CANCEL_DESTINATION
    assert_complete(only(handoff.apply_outcome(cancel.id, APPLIED)), handoff, Completion.CANCELED)


# --- ACTIVE, source lost before the transfer, or destination lost: cleanup -------


@ORDERS
def test_source_lost_before_the_transfer_cancels_the_destination(order: Order) -> None:
    handoff = held_and_reserved(order)
    transfer = schedule_transfer(handoff)
    handoff.apply_outcome(transfer.id, SCHEDULED)
    cancel = only(handoff.apply_fact(SOURCE_LOST))
    assert cancel.kind is ActionKind.CANCEL_DESTINATION
    assert handoff.phase is Phase.CLEANING_UP
    assert_complete(only(handoff.apply_outcome(cancel.id, NOOP)), handoff, Completion.CANCELED)


@ORDERS
def test_destination_lost_cancels_the_source(order: Order) -> None:
    handoff, _ = transferred(order)
    cancel = only(handoff.apply_fact(DESTINATION_LOST))
    assert cancel.kind is ActionKind.CANCEL_SOURCE
    assert_complete(only(handoff.apply_outcome(cancel.id, APPLIED)), handoff, Completion.CANCELED)
    assert handoff.lifecycle[-2:] == (LifecycleEvent.DESTINATION_LOST, LifecycleEvent.COMPLETED)


def test_a_lost_engine_the_other_side_never_acted_for_completes_at_once() -> None:
    # SOURCE_FIRST: the destination was never asked to act yet.
    handoff = Handoff(HANDOFF_ID, Order.SOURCE_FIRST, 0.0)
    handoff.start()
    assert_complete(only(handoff.apply_fact(SOURCE_LOST)), handoff, Completion.CANCELED)
    # DESTINATION_FIRST: the source was never asked to act yet.
    handoff = Handoff(HANDOFF_ID, Order.DESTINATION_FIRST, 0.0)
    handoff.start()
    assert_complete(only(handoff.apply_fact(DESTINATION_LOST)), handoff, Completion.CANCELED)


# --- CLEANING_UP: the lost side counts as cleaned up ------------------------------


@ORDERS
def test_while_cleaning_up_the_lost_side_counts_as_cleaned_up(order: Order) -> None:
    handoff = held_and_reserved(order)
    cancels = handoff.apply_fact(Canceled())
    assert kinds(cancels) == [ActionKind.CANCEL_SOURCE, ActionKind.CANCEL_DESTINATION]
    cancel_source, cancel_destination = cancels
    assert handoff.apply_fact(DESTINATION_LOST) == ()  # the source is still owed
    assert handoff.phase is Phase.CLEANING_UP
    complete = only(handoff.apply_outcome(cancel_source.id, APPLIED))
    assert_complete(complete, handoff, Completion.CANCELED)
    # The lost side's outstanding cancel never blocked completion.
    assert handoff.apply_outcome(cancel_destination.id, APPLIED) == ()


def test_while_cleaning_up_losing_the_last_owed_side_completes_at_once() -> None:
    handoff = held_and_reserved(Order.SOURCE_FIRST)
    _, cancel_destination = handoff.apply_fact(Failed())
    handoff.apply_outcome(cancel_destination.id, NOOP)
    assert_complete(only(handoff.apply_fact(SOURCE_LOST)), handoff, Completion.CANCELED)


# --- after completion -------------------------------------------------------------


@ORDERS
def test_destination_lost_after_success_reopens_without_cancel_destination(
    order: Order,
) -> None:
    handoff = completed(order)
    complete = only(handoff.apply_fact(DESTINATION_LOST))
    assert_complete(complete, handoff, Completion.CANCELED)
    assert handoff.lifecycle[-3:] == (
        LifecycleEvent.COMPLETED,
        LifecycleEvent.DESTINATION_LOST,
        LifecycleEvent.COMPLETED,
    )


def test_destination_lost_while_a_reopened_success_cleans_up_completes_it() -> None:
    handoff = completed(Order.SOURCE_FIRST)
    cancel = only(handoff.apply_fact(Canceled()))
    assert cancel.kind is ActionKind.CANCEL_DESTINATION
    assert_complete(only(handoff.apply_fact(DESTINATION_LOST)), handoff, Completion.CANCELED)


@ORDERS
def test_source_lost_after_success_or_anything_after_canceled_changes_nothing(
    order: Order,
) -> None:
    handoff = completed(order)
    before = handoff.snapshot()
    assert handoff.apply_fact(SOURCE_LOST) == ()
    assert handoff.snapshot() == before
    handoff.apply_fact(DESTINATION_LOST)  # now CANCELED
    before = handoff.snapshot()
    for fact in (SOURCE_LOST, DESTINATION_LOST, Failed()):
        assert handoff.apply_fact(fact) == ()
    assert handoff.snapshot() == before


def test_a_side_that_freed_what_it_held_is_not_lost_afterwards() -> None:
    handoff = held_and_reserved(Order.SOURCE_FIRST)
    cancel_source, _ = handoff.apply_fact(Failed())
    handoff.apply_outcome(cancel_source.id, APPLIED)
    before = handoff.snapshot()
    assert handoff.apply_fact(SOURCE_LOST) == ()
    assert handoff.snapshot() == before  # no SourceLost: it had nothing left to lose


# --- never rejected, recorded once, outcomes still validated -------------------------


@ORDERS
def test_engine_lost_is_never_rejected_and_recorded_once_per_side(order: Order) -> None:
    handoff, _ = transferred(order)
    handoff.apply_fact(SOURCE_LOST)
    before = handoff.snapshot()
    assert handoff.apply_fact(SOURCE_LOST) == ()  # a repeat changes nothing
    assert handoff.snapshot() == before
    assert handoff.lifecycle.count(LifecycleEvent.SOURCE_LOST) == 1


def test_outcomes_of_a_lost_sides_actions_are_still_validated_and_recorded() -> None:
    handoff = held_and_reserved(Order.SOURCE_FIRST)
    cancel_source, cancel_destination = handoff.apply_fact(Canceled())
    handoff.apply_fact(SOURCE_LOST)
    # A failed cleanup action is still refused, and an impossible outcome too.
    with pytest.raises(FailedPrecondition, match=f"cleanup action {cancel_source.id} failed"):
        handoff.apply_outcome(cancel_source.id, Outcome(OutcomeKind.FAILED, "gone"))
    with pytest.raises(InvalidArgument, match="invalid handoff action outcome Submitted"):
        handoff.apply_outcome(cancel_source.id, Outcome(OutcomeKind.SUBMITTED))
    assert handoff.apply_outcome(cancel_source.id, APPLIED) == ()
    assert not handoff.is_outstanding(cancel_source.id)  # recorded
    with pytest.raises(FailedPrecondition, match="conflicting outcome"):
        handoff.apply_outcome(cancel_source.id, NOOP)
    assert_complete(
        only(handoff.apply_outcome(cancel_destination.id, APPLIED)), handoff, Completion.CANCELED
    )


def test_complete_says_how_the_handoff_ended() -> None:
    handoff = completed(Order.DESTINATION_FIRST)
    first = handoff.apply_fact(Canceled())  # reopened: CancelDestination
    second = only(handoff.apply_outcome(only(first).id, APPLIED))
    assert_complete(second, handoff, Completion.CANCELED)
