"""Named unit tests for the core: happy paths, and each correction of docs/semantics.md."""

from __future__ import annotations

import math

import pytest

from handoff_server.domain.core import Handoff
from handoff_server.domain.model import (
    ActionKind,
    Canceled,
    Completion,
    DestinationReserved,
    Failed,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    Order,
    Outcome,
    OutcomeKind,
    Phase,
    SourceHeld,
    TimedOut,
    TimingMode,
    TransferCompleted,
    TransferTiming,
)
from tests.support.core import (
    ACCEPTED,
    APPLIED,
    EXPECTED_LIFECYCLE,
    HANDOFF_ID,
    NO_MODEL,
    NOOP,
    SCHEDULED,
    SUBMITTED,
    completed,
    held_and_reserved,
    kinds,
    only,
    schedule_transfer,
)


@pytest.mark.parametrize("order", list(Order))
def test_success_path_issues_the_expected_actions_and_lifecycle(order: Order) -> None:
    handoff = completed(order)
    assert handoff.phase is Phase.COMPLETE
    assert handoff.completion is Completion.SUCCESS
    assert handoff.lifecycle == EXPECTED_LIFECYCLE[order]
    assert handoff.outstanding == ()


def test_transfer_delay_follows_the_bandwidth_model() -> None:
    timing = TransferTiming(
        TimingMode.FULL_PROMPT,
        full_prompt_tokens=1000,
        kv_bytes_per_token=1_000_000,
        bandwidth_gb_s=10.0,
        state_bytes=500_000_000,
    )
    handoff = held_and_reserved(Order.SOURCE_FIRST, timing)
    transfer = schedule_transfer(handoff)
    # (1000 * 1e6 + 5e8) bytes / 10e9 B/s = 0.15 s
    assert transfer.delay_ms is not None
    assert math.isclose(transfer.delay_ms, 150.0)


@pytest.mark.parametrize("bandwidth", [None, 0.0])
def test_missing_or_zero_bandwidth_falls_back(bandwidth: float | None) -> None:
    timing = TransferTiming(
        TimingMode.FULL_PROMPT, 10, kv_bytes_per_token=1, bandwidth_gb_s=bandwidth
    )
    handoff = held_and_reserved(Order.SOURCE_FIRST, timing)
    assert schedule_transfer(handoff).delay_ms == 7.5


def test_correction_1_terminal_fact_after_success_reopens_cleanup() -> None:
    for fact in (Canceled(), Failed(), TimedOut()):
        handoff = completed(Order.SOURCE_FIRST)
        cancel = only(handoff.apply_fact(fact))
        assert cancel.kind is ActionKind.CANCEL_DESTINATION
        assert handoff.phase is Phase.CLEANING_UP
        complete = only(handoff.apply_outcome(cancel.id, APPLIED))
        assert complete.kind is ActionKind.COMPLETE
        assert handoff.completion is Completion.CANCELED
        # Once canceled, nothing reopens it again.
        assert handoff.apply_fact(Canceled()) == ()


def test_correction_2_rejected_outcome_is_not_journalled() -> None:
    handoff = Handoff(HANDOFF_ID, Order.SOURCE_FIRST, 1.0)
    submit = only(handoff.start())
    for _ in range(2):
        with pytest.raises(InvalidArgument, match="invalid handoff action outcome Accepted"):
            handoff.apply_outcome(submit.id, ACCEPTED)
    assert handoff.apply_outcome(submit.id, SUBMITTED) == ()
    assert not handoff.is_outstanding(submit.id)


def test_correction_3_non_finite_scheduled_delay_is_rejected() -> None:
    # The full-prompt delay is finite, so SourceHeld passes its boundary check;
    # the destination's token count then makes the scheduled delay infinite.
    timing = TransferTiming(
        TimingMode.DESTINATION_MISSING, 1, kv_bytes_per_token=1024, bandwidth_gb_s=1e-300
    )
    handoff = held_and_reserved(Order.SOURCE_FIRST, timing)
    with pytest.raises(InvalidArgument, match="invalid handoff transfer delay inf"):
        handoff.apply_fact(DestinationReserved(1 << 60))


def test_correction_4_start_on_a_terminal_handoff_issues_nothing() -> None:
    handoff = Handoff(HANDOFF_ID, Order.SOURCE_FIRST, 1.0)
    complete = only(handoff.apply_fact(Canceled()))
    assert complete.kind is ActionKind.COMPLETE
    assert handoff.start() == ()
    assert handoff.outstanding == ()


def test_correction_5_rejected_fact_changes_nothing() -> None:
    # The reference latched `held` before the delay check failed.
    timing = TransferTiming(
        TimingMode.DESTINATION_MISSING, 1, kv_bytes_per_token=1024, bandwidth_gb_s=1e-300
    )
    handoff = held_and_reserved(Order.DESTINATION_FIRST, tokens=1 << 60)
    before = handoff.snapshot()
    with pytest.raises(InvalidArgument):
        handoff.apply_fact(SourceHeld(timing))
    assert handoff.snapshot() == before
    # The same fact with a sane timing still goes through.
    assert only(handoff.apply_fact(SourceHeld(NO_MODEL))).kind is ActionKind.START_TRANSFER


def test_correction_6_fact_payloads_are_validated_in_every_phase() -> None:
    bad = TransferTiming(TimingMode.FULL_PROMPT, 1, kv_bytes_per_token=1, bandwidth_gb_s=-1.0)
    handoff = completed(Order.SOURCE_FIRST)
    before = handoff.snapshot()
    with pytest.raises(InvalidArgument, match="invalid handoff transfer bandwidth -1"):
        handoff.apply_fact(SourceHeld(bad))
    assert handoff.snapshot() == before


def test_invalid_fallback_is_rejected_at_creation() -> None:
    for fallback in (-1.0, math.inf, math.nan):
        with pytest.raises(InvalidArgument, match="invalid fallback transfer delay"):
            Handoff(HANDOFF_ID, Order.SOURCE_FIRST, fallback)


def test_facts_before_their_prerequisites_are_failed_preconditions() -> None:
    handoff = Handoff(HANDOFF_ID, Order.SOURCE_FIRST, 1.0)
    handoff.start()
    with pytest.raises(FailedPrecondition, match="source held before prefill submission"):
        handoff.apply_fact(SourceHeld(NO_MODEL))
    with pytest.raises(FailedPrecondition, match="destination reserved before ownership"):
        handoff.apply_fact(DestinationReserved(1))
    with pytest.raises(FailedPrecondition, match="transfer completed before it was scheduled"):
        handoff.apply_fact(TransferCompleted())


def test_outcome_errors_name_the_action() -> None:
    handoff = Handoff(HANDOFF_ID, Order.SOURCE_FIRST, 1.0)
    submit = only(handoff.start())
    with pytest.raises(NotFound, match="unknown handoff action 9"):
        handoff.apply_outcome(9, SUBMITTED)
    handoff.apply_outcome(submit.id, SUBMITTED)
    with pytest.raises(FailedPrecondition, match="conflicting outcome for handoff action 0"):
        handoff.apply_outcome(submit.id, Outcome(OutcomeKind.FAILED, "oops"))
    assert handoff.apply_outcome(submit.id, SUBMITTED) == ()


def test_failed_action_starts_cleanup_and_failed_cleanup_is_rejected() -> None:
    handoff = held_and_reserved(Order.SOURCE_FIRST)
    transfer = schedule_transfer(handoff)
    cleanup = handoff.apply_outcome(transfer.id, Outcome(OutcomeKind.FAILED, "nic down"))
    assert kinds(cleanup) == [ActionKind.CANCEL_SOURCE, ActionKind.CANCEL_DESTINATION]
    cancel_source, cancel_destination = cleanup
    with pytest.raises(FailedPrecondition, match=f"cleanup action {cancel_source.id} failed"):
        handoff.apply_outcome(cancel_source.id, Outcome(OutcomeKind.FAILED, "x"))
    assert handoff.apply_outcome(cancel_source.id, NOOP) == ()
    complete = only(handoff.apply_outcome(cancel_destination.id, APPLIED))
    assert complete.kind is ActionKind.COMPLETE
    assert handoff.completion is Completion.CANCELED


def test_restore_undoes_every_change_since_the_checkpoint() -> None:
    handoff = held_and_reserved(Order.SOURCE_FIRST)
    before = handoff.snapshot()
    checkpoint = handoff.checkpoint()
    # Issues, records lifecycle events, fills the journal, then completes and empties it.
    transfer = schedule_transfer(handoff)
    handoff.apply_outcome(transfer.id, SCHEDULED)
    activate = only(handoff.apply_fact(TransferCompleted()))
    release = only(handoff.apply_outcome(activate.id, APPLIED))
    handoff.apply_outcome(release.id, APPLIED)
    assert handoff.phase is Phase.COMPLETE
    handoff.restore(checkpoint)
    assert handoff.snapshot() == before
    again = schedule_transfer(handoff)  # it carries on as if nothing had happened
    assert (again.id, again.kind) == (transfer.id, transfer.kind)
    assert handoff.outstanding == (again,)
