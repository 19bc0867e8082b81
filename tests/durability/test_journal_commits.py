"""Where the journal's commits run, on real SQLite files: with ``normal`` on the
event loop, except what may fsync (a checkpoint's catch-up and the commit
after it, which begins the WAL again) and large batches, which run on the
writer's thread; with ``full`` every commit on the thread. A checkpoint's
copy runs on a connection and thread of its own while commits go on, on
the loop: none of them begins the WAL.
The WAL stays bounded, a reader cannot make the writer wait, close truncates
the WAL, a commit that fails on the event loop stops the server with
nothing built on it sent, and another process's write lock makes commits
wait without stopping the loop.

Where a statement ran is read from SQLite's own trace callback, which runs on
the thread that executes the statement."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import itertools
import logging
import sqlite3
import threading
import uuid
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from handoff_proto.v1 import coordinator_pb2_grpc as pb_grpc
from handoff_server.durability.journal import (
    DATABASE,
    LOOP_BATCH_MAX,
    ROWS_PER_STATEMENT,
    Journal,
)
from tests.support.holder import holding
from tests.support.rpc import SOURCE, StreamRecorder, start_request
from tests.support.servers import StartServer

CHECKPOINT = "PRAGMA wal_checkpoint(PASSIVE)"
# SQLite's own checkpoint size, a quarter of the server's: these tests write
# a few WALs' worth in seconds.
CHECKPOINT_BYTES = 4 * 2**20
BODY: list[object] = ["note", "x" * 1000]  # about a quarter of a page


class Where:
    """Counts the journal connection's statements that begin with one of
    ``statements`` (COMMITs and checkpoints unless told), by whether they ran
    on the event loop's thread or another."""

    def __init__(
        self, journal: Journal, statements: tuple[str, ...] = ("COMMIT", CHECKPOINT)
    ) -> None:
        self.loop_thread = threading.get_ident()
        self.statements = statements  # each counted by this beginning
        self.counts: Counter[tuple[str, str]] = Counter()
        journal._db.set_trace_callback(self._trace)

    def _trace(self, statement: str) -> None:
        for counted in self.statements:
            if statement.startswith(counted):
                where = "loop" if threading.get_ident() == self.loop_thread else "thread"
                self.counts[(counted, where)] += 1


def longest_run(numbers: list[int]) -> int:
    """The most consecutive numbers in the ascending ``numbers``."""
    longest = run = 0
    previous = None
    for number in numbers:
        run = run + 1 if previous is not None and number == previous + 1 else 1
        longest = max(longest, run)
        previous = number
    return longest


def wal_bytes(state_dir: Path) -> int:
    wal = state_dir / f"{DATABASE}-wal"
    return wal.stat().st_size if wal.exists() else 0


def committed(state_dir: Path) -> int:
    with sqlite3.connect(state_dir / DATABASE) as db:
        count: int = db.execute("SELECT count(*) FROM records").fetchone()[0]
        return count


async def write(
    journal: Journal,
    state_dir: Path,
    commits: int,
    per_commit: int,
    beside: list[int] | None = None,
) -> list[int]:
    """``commits`` commits of ``per_commit`` records each; the WAL's size after
    each. ``beside`` collects the commits asked for while a checkpoint's copy ran."""
    sizes = []
    for i in range(commits):
        for j in range(per_commit):
            journal.append(f"h{i}-{j}", 1.0, BODY)
        if beside is not None and journal._checkpointing is not None:
            beside.append(i)
        await journal.durable()
        sizes.append(wal_bytes(state_dir))
    return sizes


@pytest.mark.timeout(60)
async def test_normal_commits_on_the_loop_and_checkpoints_beside_them(tmp_path: Path) -> None:
    journal = Journal.open(tmp_path, "normal", checkpoint_bytes=CHECKPOINT_BYTES)
    where = Where(journal)
    journal.start_writer()
    beside: list[int] = []
    try:
        # About 3 pages a commit: the WAL passes its checkpoint size about
        # every 300 commits.
        sizes = await write(journal, tmp_path, 1500, 8, beside)
        assert committed(tmp_path) == 1500 * 8
        assert journal.commits == 1500
        assert journal.checkpoints >= 3
        # Each checkpoint's copy ran on the checkpointer's connection while
        # commits went on, on the loop; its catch-up, and the commit after
        # it, on the writer's thread; every other commit on the loop.
        assert journal.copies in (journal.checkpoints, journal.checkpoints + 1)
        assert beside, "no commit was made while a copy ran"
        assert where.counts == {
            (CHECKPOINT, "thread"): journal.checkpoints,
            ("COMMIT", "thread"): journal.checkpoints,
            ("COMMIT", "loop"): 1500 - journal.checkpoints,
        }
        # Only those commits began the WAL again (the file shrinks then).
        shrinks = sum(after < before for before, after in itertools.pairwise(sizes))
        assert shrinks == journal.checkpoints
        # Bounded: past its size by what is committed while a copy runs (as
        # many commits as the loop makes meanwhile: more when this machine is
        # busy and the copy's thread waits), and a checkpoint brings the file
        # back to one commit's size.
        growth = max(after - before for before, after in itertools.pairwise(sizes))
        assert max(sizes) <= CHECKPOINT_BYTES + (longest_run(beside) + 2) * growth, (
            max(sizes),
            longest_run(beside),
            growth,
        )
        assert min(sizes[300:]) < 64 * 1024, min(sizes[300:])
    finally:
        await journal.close()
    assert wal_bytes(tmp_path) == 0  # close checkpoints (TRUNCATE)
    assert committed(tmp_path) == 1500 * 8


@pytest.mark.timeout(30)
async def test_a_large_batch_commits_on_the_thread_in_few_statements(tmp_path: Path) -> None:
    """A batch the loop would stop for (the streaming path's) is worth the hop.
    There its records and its departed handoffs go in one statement per
    ROWS_PER_STATEMENT (on a thread each statement ends in a wait for the
    GIL); on the loop one per row. A departed handoff's records go, and only
    those written before it departed."""
    journal = Journal.open(tmp_path, "normal")
    where = Where(journal, ("COMMIT", "INSERT", "WITH gone", "DELETE"))
    journal.start_writer()
    try:
        await write(journal, tmp_path, 1, LOOP_BATCH_MAX)
        assert where.counts == {("INSERT", "loop"): LOOP_BATCH_MAX, ("COMMIT", "loop"): 1}
        where.counts.clear()
        await write(journal, tmp_path, 1, 2 * ROWS_PER_STATEMENT + 1)  # the same ids, and more
        assert where.counts == {("INSERT", "thread"): 3, ("COMMIT", "thread"): 1}
        where.counts.clear()
        for j in range(2 * ROWS_PER_STATEMENT + 1):
            journal.drop(f"h0-{j}")
        journal.append("h0-0", 2.0, BODY)  # the id, used again after it departed
        await journal.durable()
        assert where.counts == {
            ("WITH gone", "thread"): 3,
            ("INSERT", "thread"): 1,
            ("COMMIT", "thread"): 1,
        }
    finally:
        await journal.close()
    with sqlite3.connect(tmp_path / DATABASE) as db:
        assert db.execute("SELECT handoff_id, at FROM records").fetchall() == [("h0-0", 2.0)]


@pytest.mark.timeout(60)
async def test_full_commits_on_the_thread_only(tmp_path: Path) -> None:
    journal = Journal.open(tmp_path, "full", checkpoint_bytes=CHECKPOINT_BYTES)
    where = Where(journal)
    journal.start_writer()
    try:
        await write(journal, tmp_path, 400, 8)
        assert journal.checkpoints >= 1
        assert where.counts == {
            (CHECKPOINT, "thread"): journal.checkpoints,
            ("COMMIT", "thread"): 400,
        }
    finally:
        await journal.close()
    assert committed(tmp_path) == 400 * 8


@pytest.mark.timeout(60)
async def test_a_reader_holding_the_wal_does_not_make_the_writer_wait(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A reader of an old snapshot (someone's sqlite3 shell) keeps the checkpoint
    from copying the whole WAL: commits go on, the writer retries a WAL's size
    later, and once the reader is gone the WAL is copied and shrinks again."""
    journal = Journal.open(tmp_path, "normal", checkpoint_bytes=CHECKPOINT_BYTES)
    journal.start_writer()
    reader = sqlite3.connect(tmp_path / DATABASE, isolation_level=None)
    try:
        await write(journal, tmp_path, 10, 8)
        reader.execute("BEGIN")
        reader.execute("SELECT count(*) FROM records").fetchone()  # holds this snapshot
        with caplog.at_level(logging.WARNING, "handoff.journal"):
            sizes = await asyncio.wait_for(write(journal, tmp_path, 700, 8), 30)
        assert "journal checkpoint copied" in caplog.text
        assert "another connection reads the journal" in caplog.text
        assert max(sizes) > CHECKPOINT_BYTES  # it could not be copied back
        reader.execute("COMMIT")
        checkpoints = journal.checkpoints
        sizes = await write(journal, tmp_path, 800, 8)
        assert journal.checkpoints > checkpoints
        assert min(sizes) < 64 * 1024  # copied, and the file cut back
        assert committed(tmp_path) == (10 + 700 + 800) * 8
    finally:
        reader.close()
        await journal.close()


@pytest.mark.timeout(30)
async def test_a_commit_that_fails_on_the_loop_sends_nothing_and_stops_the_server(
    start_server: StartServer, tmp_path: Path
) -> None:
    """A real SQLite failure (a trigger that refuses every insert, put there by
    another connection) in a commit on the event loop: the call is refused,
    the server stops, and no action for the handoff reaches its engine."""
    server = await start_server(state_dir=str(tmp_path))
    assert server.journal is not None
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        stub = pb_grpc.HandoffCoordinatorStub(channel)
        source = StreamRecorder(stub, SOURCE)
        await source.subscribed()
        first = str(uuid.uuid4())
        await stub.StartHandoff(start_request(first))
        await source.wait_for(first, 0)
        with sqlite3.connect(tmp_path / DATABASE, isolation_level=None) as other:
            other.execute(
                "CREATE TRIGGER refuse BEFORE INSERT ON records "
                "BEGIN SELECT RAISE(ABORT, 'refused by a trigger'); END"
            )
        # The next commit is a small one on the event loop: not the WAL's first,
        # and the WAL is far below its checkpoint size.
        assert 0 < wal_bytes(tmp_path) < server.journal.checkpoint_bytes
        second = str(uuid.uuid4())
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await stub.StartHandoff(start_request(second))
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "the journal cannot be written" in (refused.value.details() or "")
        assert "refused by a trigger" in (refused.value.details() or "")
        await server.failed.wait()
        assert server.journal.checkpoints == 0
        await server.stop()  # its shutdown cancels are refused by the journal too
        with pytest.raises(grpc.aio.AioRpcError) as ended:
            await source.stream_ended()
        assert ended.value.code() == grpc.StatusCode.UNAVAILABLE
    assert [key for key in source.received if key[0] == second] == []
    assert list(source.received) == [(first, 0)]


@contextlib.contextmanager
def no_cyclic_gc() -> Iterator[None]:
    """The test process's cyclic collector off while the loop's gaps are timed:
    a full pass walks every object the whole suite's collection made (24 to
    100 ms each in make test's serial pass), a gap of the harness's own."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


@pytest.mark.timeout(30)
@pytest.mark.serial  # times the event loop's gaps: run alone (make test's second pass)
async def test_another_writer_makes_commits_wait_off_the_loop_then_asks_for_a_drain(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """SQLite's own busy handler would sleep on the event loop: while another
    process holds a write transaction, the loop keeps turning, the commit
    waits, the server is asked to drain after the busy timeout (naming the
    holder), and once the lock is released the batch is committed."""
    journal = Journal.open(tmp_path, "normal", busy_timeout_s=0.3)
    held = asyncio.Event()
    reasons: list[str] = []

    def on_held(reason: str) -> None:
        reasons.append(reason)
        held.set()

    journal.on_held = on_held
    journal.start_writer()
    await write(journal, tmp_path, 1, 1)  # the WAL's first commit is behind it
    loop = asyncio.get_running_loop()
    gaps: list[float] = []

    async def ticking() -> None:
        while not held.is_set():
            began = loop.time()
            await asyncio.sleep(0.005)
            gaps.append(loop.time() - began)

    try:
        with caplog.at_level(logging.WARNING, "handoff.journal"):
            async with holding(tmp_path / DATABASE) as holder:
                journal.append("waits", 1.0, BODY)
                durable = asyncio.create_task(journal.durable())
                with no_cyclic_gc():
                    await asyncio.gather(ticking(), held.wait())
                assert not durable.done()
            await asyncio.wait_for(durable, 5)
    finally:
        await journal.close()
    assert max(gaps) < 0.1, max(gaps)  # SQLite's handler would have slept 5 s
    (reason,) = reasons
    assert reason.startswith(f"the journal in --state-dir {tmp_path} is held by pid {holder.pid}")
    assert "journal commits wait: pid" in caplog.text
    assert "journal commits go on" in caplog.text
    assert committed(tmp_path) == 2
