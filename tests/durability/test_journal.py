"""The journal's storage on real SQLite files: group commit, durability modes,
compaction, torn tails, corrupt files, newer formats, and the state dir lock."""

from __future__ import annotations

import asyncio
import logging
import shutil
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from handoff_server.domain.entries import StartRequest
from handoff_server.domain.model import (
    DestinationReserved,
    Order,
    Outcome,
    OutcomeKind,
    SourceHeld,
    TimingMode,
    TransferCompleted,
    TransferTiming,
)
from handoff_server.domain.registry import Registry
from handoff_server.durability.journal import (
    DATABASE,
    WAL_CHECKPOINT_BYTES,
    Journal,
    NewerFormat,
    StateDirBusy,
)
from handoff_server.durability.records import JournalRecorder
from handoff_server.durability.recovery import ReplayClock, recover
from handoff_server.ops.config import MIN_JOURNAL_RESERVE_MIB, Settings
from handoff_server.ops.metrics import Metrics

ROOT = Path(__file__).resolve().parents[2]
HANDOFF = [sys.executable, "-m", "handoff_server.commands.cli"]


def rows(state_dir: Path) -> list[tuple[int, str]]:
    """The records as another process would read them: only what is committed."""
    with sqlite3.connect(state_dir / DATABASE) as db:
        return list(db.execute("SELECT seq, handoff_id FROM records ORDER BY seq"))


@pytest.mark.timeout(30)
async def test_group_commit_makes_a_batch_durable_in_one_transaction(tmp_path: Path) -> None:
    journal = Journal.open(tmp_path)
    journal.start_writer()
    try:
        for i in range(500):
            journal.append(f"h{i}", 1.0 + i, ["canceled"])
        assert rows(tmp_path) == []  # appended is not committed
        await journal.durable()
        assert [handoff_id for _, handoff_id in rows(tmp_path)] == [f"h{i}" for i in range(500)]
        assert journal.commits == 1  # 500 calls, one transaction
    finally:
        await journal.close()


@pytest.mark.timeout(30)
async def test_appends_made_while_a_commit_runs_on_the_thread_gather(tmp_path: Path) -> None:
    """With FULL every commit runs on the writer's thread; what the event loop
    appends meanwhile goes into the next commit."""
    journal = Journal.open(tmp_path, "full")
    journal.start_writer()
    try:
        waits = []
        for round_ in range(20):
            journal.append(f"r{round_}", 2.0, ["failed"])
            waits.append(asyncio.ensure_future(journal.durable()))
            await asyncio.sleep(0)
        await asyncio.gather(*waits)
        assert len(rows(tmp_path)) == 20
        assert journal.commits < 1 + 20
    finally:
        await journal.close()


@pytest.mark.timeout(30)
async def test_a_commit_delay_gathers_calls_under_load_and_not_when_idle(
    tmp_path: Path,
) -> None:
    """With a commit delay, calls that come one at a time, each waiting for
    its commit, share commits; a call to an idle writer is committed at once."""
    delay_s = 0.05
    journal = Journal.open(tmp_path)
    journal.start_writer(delay_s)
    try:
        loop = asyncio.get_running_loop()
        began = loop.time()
        journal.append("idle", 1.0, ["canceled"])
        await journal.durable()
        assert loop.time() - began < delay_s  # nothing committed within the delay

        # Right after that commit: each call waits for the commit that holds it
        # (its answer's) while the next calls arrive, as unary calls under load.
        waits = []
        for i in range(10):
            journal.append(f"busy{i}", 2.0, ["failed"])
            waits.append(asyncio.ensure_future(journal.durable()))
            await asyncio.sleep(delay_s / 20)
        await asyncio.gather(*waits)
        assert len(rows(tmp_path)) == 11
        assert journal.commits <= 1 + 3  # without the delay: about one per call
    finally:
        await journal.close()


@pytest.mark.timeout(30)
async def test_durable_returns_at_once_when_nothing_is_pending(tmp_path: Path) -> None:
    journal = Journal.open(tmp_path)
    journal.start_writer()
    try:
        await asyncio.wait_for(journal.durable(), 1.0)
        assert journal.commits == 0
    finally:
        await journal.close()


@pytest.mark.parametrize(("durability", "expected"), [("normal", "NORMAL"), ("full", "FULL")])
def test_durability_modes(tmp_path: Path, durability: str, expected: str) -> None:
    journal = Journal.open(tmp_path, durability)
    try:
        assert journal.synchronous == expected
        with sqlite3.connect(tmp_path / DATABASE) as db:
            assert db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    finally:
        journal.close_now()


def test_incarnations_increase_across_opens(tmp_path: Path) -> None:
    seen = []
    for _ in range(3):
        journal = Journal.open(tmp_path)
        seen.append(journal.incarnation)
        journal.close_now()
    assert seen == sorted(set(seen))
    with sqlite3.connect(tmp_path / DATABASE) as db:  # a clock gone back changes nothing
        db.execute("UPDATE meta SET value = ? WHERE key = 'incarnation'", (2**62,))
    journal = Journal.open(tmp_path)
    assert journal.incarnation == 2**62 + 1
    journal.close_now()


def test_engine_incarnations_are_kept(tmp_path: Path) -> None:
    journal = Journal.open(tmp_path)
    journal.engine("decode-0", "a1")
    journal.engine("decode-0", "a2")
    journal.engine("prefill-0", "b1")
    journal.commit_now()
    journal.close_now()
    journal = Journal.open(tmp_path)
    assert journal.engine_incarnations() == {"decode-0": "a2", "prefill-0": "b1"}
    journal.close_now()


TIMING = TransferTiming(TimingMode.FULL_PROMPT, 100, 1000, 10.0)


def run_handoffs(registry: Registry, prefix: str, count: int) -> None:
    applied = Outcome(OutcomeKind.APPLIED)
    for i in range(count):
        handoff_id = f"{prefix}-{i}"
        registry.start(StartRequest(handoff_id, Order.SOURCE_FIRST, "p", "d", 1.0))
        registry.report_outcome(handoff_id, 0, Outcome(OutcomeKind.SUBMITTED))
        registry.report_fact(handoff_id, SourceHeld(TIMING))
        registry.report_outcome(handoff_id, 1, Outcome(OutcomeKind.ACCEPTED))
        registry.report_fact(handoff_id, DestinationReserved(100))
        registry.report_outcome(handoff_id, 2, Outcome(OutcomeKind.SCHEDULED))
        registry.report_fact(handoff_id, TransferCompleted())
        registry.report_outcome(handoff_id, 3, applied)
        registry.report_outcome(handoff_id, 4, applied)


def test_the_smallest_reserve_holds_the_write_ahead_log_twice() -> None:
    """--journal-reserve-mib's floor (config) follows the checkpoint size
    (journal): below a full WAL, a volume short of room would fill anyway."""
    assert MIN_JOURNAL_RESERVE_MIB * 2**20 >= 2 * WAL_CHECKPOINT_BYTES


def test_compaction_keeps_the_file_flat_under_steady_load(tmp_path: Path) -> None:
    """Handoffs whose retention expired leave the journal: rounds of load, each
    expiring the round before, and the files stop growing once the WAL has
    reached its checkpoint size (SQLite reuses the freed pages)."""
    now = [1_800_000_000.0]
    # A quarter of the server's checkpoint size, so the WAL reaches it early.
    journal = Journal.open(tmp_path, checkpoint_bytes=4 * 2**20)
    clock = ReplayClock(lambda: now[0])
    registry = Registry(Settings(retention_s=10.0, delivery_timeout_s=1e6), Metrics(), clock)
    recover(journal, registry, clock)
    registry.recorder = JournalRecorder(journal)
    sizes = []
    for round_ in range(30):
        run_handoffs(registry, f"r{round_}", 300)
        journal.commit_now()
        sizes.append(journal.size_bytes())
        now[0] += 11.0
        registry.fire_due()  # the round's handoffs expire
    journal.commit_now()
    assert len(rows(tmp_path)) == 0
    assert max(sizes[15:]) <= sizes[14] * 1.05, sizes
    journal.close_now()


def test_a_second_server_on_one_state_dir_is_refused(tmp_path: Path) -> None:
    journal = Journal.open(tmp_path)
    try:
        with pytest.raises(StateDirBusy, match=r"in use by another handoff server \(pid \d+\)"):
            Journal.open(tmp_path)
        serve = subprocess.run(
            [
                *HANDOFF,
                "serve",
                "--state-dir",
                str(tmp_path),
                "--port",
                "0",
                "--metrics-port",
                "-1",
            ],
            capture_output=True,
            text=True,
            timeout=60,
            cwd=ROOT,
        )
        assert serve.returncode == 2
        assert f"state dir {tmp_path} is in use by another handoff server" in serve.stderr
    finally:
        journal.close_now()
    Journal.open(tmp_path).close_now()  # released on close


def test_a_journal_of_a_newer_format_refuses_to_start(tmp_path: Path) -> None:
    Journal.open(tmp_path).close_now()
    with sqlite3.connect(tmp_path / DATABASE) as db:
        db.execute("UPDATE meta SET value = 99 WHERE key = 'format_version'")
    with pytest.raises(NewerFormat, match="journal format 99, newer than this server's 3"):
        Journal.open(tmp_path)
    serve = subprocess.run(
        [*HANDOFF, "serve", "--state-dir", str(tmp_path), "--port", "0", "--metrics-port", "-1"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )
    assert serve.returncode == 2, serve.stderr
    assert "newer than this server's" in serve.stderr
    Journal.open(tmp_path / "other").close_now()  # the lock was released


def test_a_corrupt_file_is_moved_aside_and_the_server_starts_empty(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    journal = Journal.open(tmp_path)
    for i in range(2000):
        journal.append(f"h{i}", 1.0, ["canceled", "x" * 200])
    journal.commit_now()
    journal.close_now()
    path = tmp_path / DATABASE
    data = bytearray(path.read_bytes())
    page = 4096
    data[3 * page : 5 * page] = b"\xa5" * (2 * page)  # two pages of the records b-tree
    path.write_bytes(bytes(data))
    with caplog.at_level(logging.ERROR, "handoff.journal"):
        journal = Journal.open(tmp_path)
    assert list(journal.records()) == []
    journal.close_now()
    (aside,) = tmp_path.glob(f"{DATABASE}.corrupt-*")
    assert aside.read_bytes() == bytes(data)  # kept, untouched, for inspection
    assert "is corrupt" in caplog.text
    assert "starting EMPTY" in caplog.text
    assert str(aside) in caplog.text


def test_not_a_database_at_all_is_handled_the_same(tmp_path: Path) -> None:
    (tmp_path / DATABASE).write_bytes(b"this is not SQLite" * 100)
    journal = Journal.open(tmp_path)
    assert list(journal.records()) == []
    journal.close_now()
    assert len(list(tmp_path.glob(f"{DATABASE}.corrupt-*"))) == 1


def test_a_torn_tail_is_dropped_to_the_last_whole_transaction_and_logged(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A crash in the middle of a commit: the copy taken while the journal is
    open (no checkpoint) loses the last transaction's final bytes."""
    live, crashed = tmp_path / "live", tmp_path / "crashed"
    journal = Journal.open(live)
    for i in range(10):
        journal.append(f"kept-{i}", 1.0, ["canceled"])
    journal.commit_now()
    for i in range(200):
        journal.append(f"torn-{i}", 2.0, ["failed", "y" * 100])
    journal.commit_now()
    crashed.mkdir()
    for name in (DATABASE, DATABASE + "-wal"):
        shutil.copyfile(live / name, crashed / name)
    journal.close_now()
    wal = crashed / (DATABASE + "-wal")
    size = wal.stat().st_size
    with wal.open("r+b") as file:
        file.truncate(size - 1000)  # the commit frame, cut short
    with caplog.at_level(logging.ERROR, "handoff.journal"):
        recovered = Journal.open(crashed)
    assert [r.handoff_id for r in recovered.records()] == [f"kept-{i}" for i in range(10)]
    recovered.close_now()
    assert "journal tail torn by a crash" in caplog.text
    assert "after the last whole transaction" in caplog.text
    assert "partial frame" in caplog.text


def test_an_intact_wal_is_not_reported_as_torn(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    live, copy = tmp_path / "live", tmp_path / "copy"
    journal = Journal.open(live)
    for i in range(50):
        journal.append(f"h{i}", 1.0, ["canceled"])
        journal.commit_now()
    copy.mkdir()
    for name in (DATABASE, DATABASE + "-wal"):
        shutil.copyfile(live / name, copy / name)
    journal.close_now()
    with caplog.at_level(logging.ERROR, "handoff.journal"):
        recovered = Journal.open(copy)
    assert len(list(recovered.records())) == 50
    recovered.close_now()
    assert "torn" not in caplog.text
