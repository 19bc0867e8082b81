"""Registry.reconcile on a fake clock: what a sidecar should stop holding, and
EngineLost for the sides it freed on its own (issue 12)."""

from __future__ import annotations

import uuid

import pytest

from handoff_server.domain.model import (
    Canceled,
    Completion,
    EngineLost,
    FailedPrecondition,
    LifecycleEvent,
    Outcome,
    OutcomeKind,
    Phase,
    Release,
    ReleaseReason,
    Role,
    SourceHeld,
)
from tests.support.registry import DESTINATION, SOURCE, TIMING, Harness

SUBMITTED = Outcome(OutcomeKind.SUBMITTED)


def test_an_unknown_handoff_or_another_engines_side_is_released() -> None:
    h = Harness()
    handoff_id = h.start()
    unknown = str(uuid.uuid4())
    releases, lost = h.reconcile(
        SOURCE, [(unknown, Role.SOURCE), (handoff_id, Role.DESTINATION)], []
    )
    assert releases == [
        Release(unknown, Role.SOURCE, ReleaseReason.UNKNOWN_HANDOFF),
        Release(handoff_id, Role.DESTINATION, ReleaseReason.UNKNOWN_HANDOFF),
    ]
    assert lost == 0


def test_an_active_handoff_goes_on_for_both_sides() -> None:
    h = Harness()
    handoff_id = h.start()
    h.registry.report_outcome(handoff_id, 0, SUBMITTED)
    assert h.reconcile(SOURCE, [(handoff_id, Role.SOURCE)], []) == ([], 0)
    assert h.reconcile(DESTINATION, [(handoff_id, Role.DESTINATION)], []) == ([], 0)


def test_a_canceled_handoff_releases_both_sides() -> None:
    h = Harness()
    handoff_id = h.start()
    h.registry.report_fact(handoff_id, Canceled())
    h.registry.report_outcome(handoff_id, 1, Outcome(OutcomeKind.NOOP))  # CancelSource
    assert h.registry.get(handoff_id).core.completion is Completion.CANCELED
    releases, _ = h.reconcile(SOURCE, [(handoff_id, Role.SOURCE)], [])
    assert releases == [Release(handoff_id, Role.SOURCE, ReleaseReason.CANCELED)]
    releases, _ = h.reconcile(DESTINATION, [(handoff_id, Role.DESTINATION)], [])
    assert releases == [Release(handoff_id, Role.DESTINATION, ReleaseReason.CANCELED)]


def test_a_success_releases_the_source_and_keeps_the_decode() -> None:
    h = Harness()
    handoff_id = h.start()
    h.succeed(handoff_id)
    releases, _ = h.reconcile(SOURCE, [(handoff_id, Role.SOURCE)], [])
    assert releases == [Release(handoff_id, Role.SOURCE, ReleaseReason.SUCCEEDED_AS_SOURCE)]
    assert h.reconcile(DESTINATION, [(handoff_id, Role.DESTINATION)], []) == ([], 0)


def test_a_side_declared_lost_is_released_while_the_other_goes_on() -> None:
    h = Harness()
    handoff_id = h.start()
    h.registry.report_outcome(handoff_id, 0, SUBMITTED)
    h.registry.report_fact(handoff_id, SourceHeld(TIMING))
    h.registry.report_fact(handoff_id, EngineLost(Role.DESTINATION), origin="server")
    releases, _ = h.reconcile(DESTINATION, [(handoff_id, Role.DESTINATION)], [])
    assert releases == [Release(handoff_id, Role.DESTINATION, ReleaseReason.ENGINE_LOST)]
    # The source was not lost: it is canceled through its own action.
    assert h.reconcile(SOURCE, [(handoff_id, Role.SOURCE)], []) == ([], 0)


def test_a_freed_side_is_reported_lost_once_and_counted() -> None:
    h = Harness()
    handoff_id = h.start()
    h.registry.report_outcome(handoff_id, 0, SUBMITTED)
    h.registry.report_fact(handoff_id, SourceHeld(TIMING))
    releases, lost = h.reconcile(SOURCE, [(handoff_id, Role.SOURCE)], [(handoff_id, Role.SOURCE)])
    assert lost == 1
    # Freed and still listed as held: answered from the fact just applied.
    assert releases == [Release(handoff_id, Role.SOURCE, ReleaseReason.ENGINE_LOST)]
    core = h.registry.get(handoff_id).core
    assert LifecycleEvent.SOURCE_LOST in core.lifecycle
    assert core.phase is not Phase.ACTIVE  # the handoff does not wait for its deadline
    assert h.value("handoff_engines_lost_total", cause="reconciled") == 1
    assert h.value("handoff_facts_total", kind="engine_lost", origin="server") == 1
    # A second reconcile of the same freed side changes nothing.
    assert h.reconcile(SOURCE, [], [(handoff_id, Role.SOURCE)]) == ([], 0)
    assert h.value("handoff_engines_lost_total", cause="reconciled") == 1


def test_a_freed_side_of_another_engine_or_a_finished_handoff_changes_nothing() -> None:
    h = Harness()
    active, done = h.start(), h.start()
    h.succeed(done)
    before = h.registry.get(active).core.snapshot()
    freed = [(active, Role.DESTINATION), (done, Role.SOURCE), (str(uuid.uuid4()), Role.SOURCE)]
    assert h.reconcile(SOURCE, [], freed) == ([], 0)
    assert h.registry.get(active).core.snapshot() == before
    assert h.registry.get(done).core.completion is Completion.SUCCESS


def test_freed_by_the_lease_after_a_recovery_ends_the_handoff_without_waiting_for_deadlines() -> (
    None
):
    """Both engines freed on their own while the coordinator was away: the
    handoff completes CANCELED at once instead of waiting out its deadline."""
    h = Harness()
    handoff_id = h.start()
    h.registry.report_outcome(handoff_id, 0, SUBMITTED)
    h.registry.report_fact(handoff_id, SourceHeld(TIMING))
    h.registry.report_outcome(handoff_id, 1, Outcome(OutcomeKind.ACCEPTED))
    assert h.reconcile(SOURCE, [], [(handoff_id, Role.SOURCE)])[1] == 1
    assert h.reconcile(DESTINATION, [], [(handoff_id, Role.DESTINATION)])[1] == 1
    core = h.registry.get(handoff_id).core
    assert core.phase is Phase.COMPLETE
    assert core.completion is Completion.CANCELED


def test_only_the_engines_live_subscription_reconciles() -> None:
    """Issue 27 item 5: a reconcile frees and loses sides on the word of the
    engine's memory, so it comes from the engine's live stream only: one
    with no stream, an older (fenced) incarnation or another sidecar's
    session is refused, and nothing changes."""
    h = Harness()
    handoff_id = h.start()
    h.registry.report_outcome(handoff_id, 0, SUBMITTED)
    freed = [(handoff_id, Role.SOURCE)]
    before = h.registry.get(handoff_id).core.snapshot()
    with pytest.raises(FailedPrecondition) as none:
        h.registry.reconcile(SOURCE, [], freed, incarnation="", session_id="")
    assert none.value.message == (
        f"engine {SOURCE} has no live stream: Reconcile comes from the sidecar holding "
        "its StreamActions or Connect stream, after that subscription"
    )
    h.registry.subscribe(SOURCE, lambda: None, "0002-new", "bbbb2222")
    with pytest.raises(FailedPrecondition) as fenced:
        h.registry.reconcile(SOURCE, [], freed, incarnation="0001-old", session_id="aaaa1111")
    assert fenced.value.message == (
        f"engine {SOURCE}: Reconcile from incarnation 0001-old (an older one, fenced out), "
        "but its live stream is incarnation 0002-new: only the engine's current "
        "subscription reconciles"
    )
    with pytest.raises(FailedPrecondition) as other:
        h.registry.reconcile(SOURCE, [], freed, incarnation="0002-new", session_id="aaaa1111")
    assert other.value.message == (
        f"engine {SOURCE}: Reconcile from session aaaa1111, but its live stream under "
        "incarnation 0002-new is session bbbb2222: only the engine's current "
        "subscription reconciles"
    )
    assert h.registry.get(handoff_id).core.snapshot() == before
    assert h.value("handoff_engines_lost_total", cause="reconciled") == 0
    assert h.registry.reconcile(
        SOURCE, [], freed, incarnation="0002-new", session_id="bbbb2222"
    ) == ([], 1)
