"""The journal's formats: a completed handoff is one snapshot record (format 2),
and a journal written by the release before snapshots (format 1) recovers.

tests/fixtures/journal-v1/journal.sqlite3 was written by that release's server
running tests/support/journal_history.py, with what its registry then held beside it
(expected.json): recovery from the file must answer exactly that.
"""

from __future__ import annotations

import json
import shutil
import sqlite3
from pathlib import Path

from handoff_server.domain.entries import Entry, StartRequest
from handoff_server.domain.model import (
    ALLOWED_OUTCOMES,
    ActionKind,
    Canceled,
    DestinationReserved,
    EndCause,
    EndReason,
    EngineLost,
    Failed,
    LostCause,
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
from handoff_server.domain.registry import NOT_RECORDING, Registry
from handoff_server.domain.retained import Retained
from handoff_server.durability.journal import DATABASE, FORMAT_VERSION, Journal
from handoff_server.durability.records import (
    RETAINED,
    JournalRecorder,
    decode_retained,
    encode_retained,
)
from handoff_server.durability.recovery import ReplayClock, recover
from handoff_server.ops.metrics import Metrics
from tests.durability.test_recovery import state
from tests.support import journal_history
from tests.support.fakes import FakeClock

FIXTURE = Path(__file__).parents[1] / "fixtures" / "journal-v1" / DATABASE


def recovered(state_dir: Path, clock: FakeClock) -> tuple[Journal, Registry, int]:
    journal = Journal.open(state_dir)
    replay_clock = ReplayClock(clock)
    registry = Registry(journal_history.SETTINGS, Metrics(), replay_clock)
    result = recover(journal, registry, replay_clock)
    assert result.skipped == 0
    registry.recorder = JournalRecorder(journal)
    return journal, registry, result.total


def records(state_dir: Path, handoff_id: str) -> list[str]:
    with sqlite3.connect(state_dir / DATABASE) as db:
        rows = db.execute(
            "SELECT body FROM records WHERE handoff_id = ? ORDER BY seq", (handoff_id,)
        )
        return [json.loads(body)[0] for (body,) in rows]


def test_a_format_1_journal_recovers_as_its_history_ran(tmp_path: Path) -> None:
    shutil.copy(FIXTURE, tmp_path / DATABASE)
    with sqlite3.connect(tmp_path / DATABASE) as db:
        assert db.execute("SELECT value FROM meta WHERE key = 'format_version'").fetchone()[0] == 1
        kinds = {json.loads(body)[0] for (body,) in db.execute("SELECT body FROM records")}
    assert RETAINED not in kinds  # history only: every record replays through the registry

    expected = json.loads((FIXTURE.parent / "expected.json").read_text())
    clock = FakeClock()
    clock.now = expected["now"]
    journal, registry, total = recovered(tmp_path, clock)
    assert journal.engine_incarnations()  # the engines' incarnations came through too
    assert total == len(expected["handoffs"])
    assert journal_history.answers(registry) == expected["handoffs"]
    phases = {
        (type(e).__name__, e.core.phase, e.abandoned_at is not None)
        for e in registry.handoffs.values()
    }
    assert len(phases) >= 4  # retained, active, cleaning up, abandoned: the fixture covers them

    # Opened by this server, the file is format 2 from now on, and what
    # completes now is written as a snapshot; it recovers the same again.
    retained_before = {h for h, e in registry.handoffs.items() if isinstance(e, Retained)}
    for handoff_id, entry in list(registry.handoffs.items()):
        if isinstance(entry, Entry) and entry.abandoned_at is None:
            for side in (Role.SOURCE, Role.DESTINATION):
                if registry.handoffs[handoff_id].core.phase.value != "complete":
                    registry.report_fact(handoff_id, EngineLost(side))
    journal.commit_now()
    journal.close_now()
    newly = {h for h, e in registry.handoffs.items() if isinstance(e, Retained)} - retained_before
    assert newly
    for handoff_id in newly:
        assert records(tmp_path, handoff_id) == [RETAINED]
    registry.recorder = NOT_RECORDING
    _, again, _ = recovered(tmp_path, clock)
    assert state(again) == state(registry)
    with sqlite3.connect(tmp_path / DATABASE) as db:
        version = db.execute("SELECT value FROM meta WHERE key = 'format_version'").fetchone()[0]
    assert version == FORMAT_VERSION == 3


def test_a_completed_handoff_is_one_record_and_a_reopened_one_replays_from_it(
    tmp_path: Path,
) -> None:
    clock = FakeClock()
    journal, registry, _ = recovered(tmp_path, clock)
    h = "h"
    timing = TransferTiming(TimingMode.FULL_PROMPT, 100, 10, 1.0)
    trace = (("traceparent", "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"),)
    registry.start(StartRequest(h, Order.SOURCE_FIRST, "p", "d", 5.0, trace_context=trace))
    for step in (
        (0, OutcomeKind.SUBMITTED),
        SourceHeld(timing),
        (1, OutcomeKind.ACCEPTED),
        DestinationReserved(100),
        (2, OutcomeKind.SCHEDULED),
        TransferCompleted(),
        (3, OutcomeKind.APPLIED),
    ):
        clock.now += 0.5
        if isinstance(step, tuple):
            registry.report_outcome(h, step[0], Outcome(step[1]))
        else:
            registry.report_fact(h, step)
    journal.commit_now()
    assert records(tmp_path, h)[-1] != RETAINED  # ReleaseSource still outstanding
    registry.report_outcome(h, 4, Outcome(OutcomeKind.APPLIED))
    journal.commit_now()
    assert records(tmp_path, h) == [RETAINED]  # its history went in the same commit

    # A decode-phase cancel reopens the success: records follow the snapshot,
    # and the second completion replaces them all with one snapshot again.
    clock.now += 1.0
    registry.report_fact(h, Canceled())
    reopened_entry = registry.handoffs[h]
    assert isinstance(reopened_entry, Entry)
    assert reopened_entry.core.outstanding  # CancelDestination, owed
    journal.commit_now()
    assert records(tmp_path, h) == [RETAINED, "canceled"]
    journal.close_now()
    registry.recorder = NOT_RECORDING
    journal, reopened, _ = recovered(tmp_path, clock)
    assert state(reopened) == state(registry)
    assert reopened.handoffs[h].trace_context == trace
    for action in reopened_entry.core.outstanding:
        reopened.report_outcome(h, action.id, Outcome(OutcomeKind.APPLIED))
        registry.report_outcome(h, action.id, Outcome(OutcomeKind.APPLIED))
    journal.commit_now()
    journal.close_now()
    assert records(tmp_path, h) == [RETAINED]
    _, last, _ = recovered(tmp_path, clock)
    assert state(last) == state(registry)


def test_end_reasons_survive_a_restart_and_a_format_2_row_reads_unspecified(
    tmp_path: Path,
) -> None:
    clock = FakeClock()
    journal, registry, _ = recovered(tmp_path, clock)
    failed, active = "failed", "active"
    for handoff_id in (failed, active):
        registry.start(StartRequest(handoff_id, Order.SOURCE_FIRST, "p", "d", 5.0))
    registry.report_outcome(failed, 0, Outcome(OutcomeKind.FAILED, "out of KV blocks"))
    registry.report_fact(active, Canceled())  # cleaning up: CancelSource outstanding
    before = {h: registry.get(h).reasons for h in (failed, active)}
    assert before[failed][0].detail == "out of KV blocks"
    journal.commit_now()
    journal.close_now()
    registry.recorder = NOT_RECORDING
    _, again, _ = recovered(tmp_path, clock)
    assert {h: again.get(h).reasons for h in (failed, active)} == before

    # Its source lost, nothing is owed: it completes, and is retained.
    again.report_fact(failed, EngineLost(Role.SOURCE))
    retained = again.get(failed)
    assert isinstance(retained, Retained)
    row = encode_retained(retained)
    assert decode_retained(failed, row, {}).reasons == retained.reasons
    # A format 2 retained row ends at the next action id: no reasons in it.
    old = decode_retained(failed, row[:-1], {})
    assert [r.cause for r in old.reasons] == [EndCause.UNSPECIFIED]


def test_why_an_unfinished_handoff_ended_survives_a_restart_and_its_completion(
    tmp_path: Path,
) -> None:
    """What only the server knew (why it lost an engine, a drain, the caller's
    text) is journaled with the fact, not derived from it on recovery."""
    clock = FakeClock()
    journal, registry, _ = recovered(tmp_path, clock)
    source = registry.subscribe("p", lambda: None)
    ids = ("canceled", "failed", "reconciled", "drained")
    for handoff_id in ids:
        registry.start(StartRequest(handoff_id, Order.SOURCE_FIRST, "p", "d", 5.0))
    assert registry.take(source, 100)  # each SubmitPrefill reached p: its cleanup is owed
    registry.report_fact("canceled", Canceled(), detail="client went away")
    registry.report_fact("failed", Failed(), detail="router gave up")
    live = registry.subscribe("d", lambda: None)  # a reconcile comes from the live stream
    registry.reconcile("d", [], [("reconciled", Role.DESTINATION)], incarnation="", session_id="")
    registry.unsubscribe(live)
    registry.cancel_active("server shutting down")
    before = {h: registry.get(h).reasons for h in ids}
    assert before == {
        "canceled": (EndReason(EndCause.FRONTEND_CANCELED, detail="client went away"),),
        "failed": (EndReason(EndCause.FAILED, detail="router gave up"),),
        "reconciled": (
            EndReason(EndCause.ENGINE_LOST, Role.DESTINATION, "d", LostCause.RECONCILED),
        ),
        "drained": (EndReason(EndCause.DRAIN, detail="server shutting down"),),
    }
    assert all(registry.get(h).core.phase is Phase.CLEANING_UP for h in ids)
    journal.commit_now()
    journal.close_now()
    registry.recorder = NOT_RECORDING
    journal, again, _ = recovered(tmp_path, clock)
    assert state(again) == state(registry)

    # Their cleanup answered, each completes with the reason it had, as the
    # COMPLETE notice says, and keeps it in its retained row.
    for world in (registry, again):
        for handoff_id in ids:
            entry = world.get(handoff_id)
            assert isinstance(entry, Entry)
            for action in list(entry.core.outstanding):
                kind = min(ALLOWED_OUTCOMES[action.kind], key=lambda k: k.value)
                world.report_outcome(handoff_id, action.id, Outcome(kind))
            assert isinstance(world.get(handoff_id), Retained)
    notices = {
        d.handoff_id: d.reason
        for d in again.take(again.subscribe("p", lambda: None), 100) or []
        if d.action.kind is ActionKind.COMPLETE
    }
    assert notices == {h: reasons[-1] for h, reasons in before.items()}
    journal.commit_now()
    journal.close_now()
    _, last, _ = recovered(tmp_path, clock)
    assert state(last) == state(registry)
