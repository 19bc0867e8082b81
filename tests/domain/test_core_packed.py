"""A completed handoff packed for retention answers every call exactly as the full core."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

from handoff_server.commands.conformance import (
    Answer,
    FactStep,
    StartStep,
    Vector,
    mismatch,
)
from handoff_server.domain.core import Handoff
from handoff_server.domain.model import (
    Action,
    ActionKind,
    Canceled,
    Completion,
    DestinationReserved,
    EngineLost,
    HandoffError,
    Order,
    Outcome,
    OutcomeKind,
    Phase,
    Role,
    SourceHeld,
    TimingMode,
    TransferCompleted,
    TransferTiming,
)
from handoff_server.domain.packing import Ending, pack
from tests.support.core import (
    APPLIED,
    HandoffMachine,
    completed,
    held_and_reserved,
    only,
    transferred,
)
from tests.support.vectors import LOST_VECTORS, VECTORS, all_vectors

Observed = tuple[Action, ...] | tuple[str, str]


def observe(apply: Callable[..., tuple[Action, ...]], *args: object) -> Observed:
    try:
        return apply(*args)
    except HandoffError as error:
        return (error.code, error.message)


def test_unpacking_gives_back_the_same_state_and_the_reads_agree() -> None:
    reopened = completed(Order.SOURCE_FIRST)
    cancel = only(reopened.apply_fact(Canceled()))
    assert only(reopened.apply_outcome(cancel.id, APPLIED)).kind is ActionKind.COMPLETE
    canceled = held_and_reserved(Order.DESTINATION_FIRST)
    for action in canceled.apply_fact(Canceled()):
        canceled.apply_outcome(action.id, APPLIED)
    handoffs = [completed(Order.SOURCE_FIRST), completed(Order.DESTINATION_FIRST)]
    # Lost sides: a success without the source, a success whose decode died.
    source_lost, activate = transferred(Order.SOURCE_FIRST)
    source_lost.apply_fact(EngineLost(Role.SOURCE))
    source_lost.apply_outcome(activate.id, APPLIED)
    decode_lost = completed(Order.DESTINATION_FIRST)
    decode_lost.apply_fact(EngineLost(Role.DESTINATION))
    for handoff in [*handoffs, reopened, canceled, source_lost, decode_lost]:
        packed = pack(handoff)
        assert packed.unpack().snapshot() == handoff.snapshot()
        assert packed.snapshot() == handoff.snapshot()
        assert packed.handoff_id == handoff.handoff_id
        assert packed.fallback_transfer_delay_ms == handoff.fallback_transfer_delay_ms
        assert (packed.order, packed.phase, packed.completion, packed.lifecycle) == (
            handoff.order,
            handoff.phase,
            handoff.completion,
            handoff.lifecycle,
        )
    assert [h.completion for h in (reopened, canceled, decode_lost)] == [Completion.CANCELED] * 3
    assert source_lost.completion is Completion.SUCCESS


def test_handoffs_that_ended_alike_share_their_ending() -> None:
    """Only the id and the fallback delay are a retained handoff's own."""
    first = completed(Order.SOURCE_FIRST)
    second = Handoff("00000000-0000-4000-8000-000000000009", Order.SOURCE_FIRST, 99.0)
    submit = only(second.start())
    second.apply_outcome(submit.id, Outcome(OutcomeKind.SUBMITTED))
    timing = TransferTiming(TimingMode.FULL_PROMPT, 123_456, 4096, 25.0, state_bytes=7)
    reserve = only(second.apply_fact(SourceHeld(timing)))
    second.apply_outcome(reserve.id, Outcome(OutcomeKind.ACCEPTED))
    transfer = only(second.apply_fact(DestinationReserved(654_321)))
    second.apply_outcome(transfer.id, Outcome(OutcomeKind.SCHEDULED))
    activate = only(second.apply_fact(TransferCompleted()))
    release = only(second.apply_outcome(activate.id, APPLIED))
    second.apply_outcome(release.id, APPLIED)
    assert pack(first).ending is pack(second).ending


class PackedMachine(HandoffMachine):
    """The core's property machine, where every call that reaches a completed
    handoff also runs on its packed-and-unpacked twin, as a retained one would."""

    def call(self, apply: object, *args: object) -> None:
        if self.handoff.phase is not Phase.COMPLETE:
            super().call(apply, *args)
            return
        twin = pack(self.handoff).unpack()
        assert twin.snapshot() == self.handoff.snapshot()
        name = apply.__name__  # type: ignore[attr-defined]
        expected = observe(getattr(twin, name), *args)
        seen: list[Observed] = []

        def observed(*call_args: object) -> tuple[Action, ...]:
            try:
                actions: tuple[Action, ...] = apply(*call_args)  # type: ignore[operator]
            except HandoffError as error:
                seen.append((error.code, error.message))
                raise
            seen.append(actions)
            return actions

        super().call(observed, *args)
        assert seen == [expected]
        assert twin.snapshot() == self.handoff.snapshot()


PackedMachine.TestCase.settings = settings(
    max_examples=300,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestPackedMachine = PackedMachine.TestCase


def replay_packing(vector: Vector, endings: list[Ending]) -> str | None:
    """The vector through the core, packing and unpacking whenever it is complete."""
    handoff: Handoff | None = None
    for index, step in enumerate(vector.steps):
        if handoff is not None and handoff.phase is Phase.COMPLETE:
            packed = pack(handoff)
            endings.append(packed.ending)
            handoff = packed.unpack()
        if isinstance(step, StartStep):
            try:
                handoff = Handoff(step.handoff_id, step.order, step.fallback_transfer_delay_ms)
            except HandoffError as error:
                refused = Answer(False, error.code, (), None, None, error.message)
                return None if mismatch(step.expect, refused) is None else vector.name
            answer = observe(handoff.start)
        else:
            assert handoff is not None
            if isinstance(step, FactStep):
                answer = observe(handoff.apply_fact, step.fact)
            else:
                answer = observe(handoff.apply_outcome, step.action_id, step.outcome)
        completion = None if handoff.completion is None else handoff.completion.value
        rejected = bool(answer) and isinstance(answer[0], str)
        observed = Answer(
            ok=not rejected,
            code=str(answer[0]) if rejected else None,
            actions=() if rejected else answer,  # type: ignore[arg-type]
            phase=handoff.phase.value,
            completion=completion,
            message=str(answer[1]) if rejected else "",
        )
        reason = mismatch(step.expect, observed)
        if reason is not None:
            return f"{vector.name} step {index}: {reason}"
    return None


@pytest.mark.parametrize(
    ("path", "distinct"), [(VECTORS, 48), (LOST_VECTORS, 128)], ids=["vectors", "lost"]
)
def test_all_vectors_pass_when_completed_handoffs_are_packed_between_calls(
    path: Path, distinct: int
) -> None:
    endings: list[Ending] = []
    failures = [f for v in all_vectors(path) if (f := replay_packing(v, endings)) is not None]
    assert failures == []
    # Thousands of completed states, and they are a few dozen shared objects.
    assert len(endings) > 1000
    assert len({id(e) for e in endings}) <= distinct


def test_a_reopened_handoff_is_not_packed_until_it_completes_again() -> None:
    handoff = completed(Order.SOURCE_FIRST)
    cancel = only(handoff.apply_fact(Canceled()))
    with pytest.raises(AssertionError, match="only a completed handoff"):
        pack(handoff)
    handoff.apply_outcome(cancel.id, APPLIED)
    assert pack(handoff).completion is Completion.CANCELED
