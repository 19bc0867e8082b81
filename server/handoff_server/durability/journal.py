"""The journal: every accepted call, kept in SQLite so a restarted server recovers.

Choices, and why:

- **SQLite from the standard library, WAL mode.** A real embedded engine whose
  crash safety is tested far beyond anything written here: a transaction is
  whole or absent after any crash, and WAL frames written without their
  commit are discarded when the file is next opened. ``synchronous=NORMAL``
  (the default) does not fsync each commit: a commit survives the process
  dying (kill -9, OOM, a container restart) but the last ones may be lost if
  the machine itself loses power. ``--durability full`` fsyncs every commit.
- **What is kept: the registry's inputs, not its state.** Each accepted call
  is one record (its start parameters with the caller's trace context, a
  fact, or an outcome, with the time the registry saw it); the server's own
  facts (deadlines, unreachable engines, shutdown) are records like any
  other. Replaying them through a registry whose clock reads each record's
  time rebuilds every handoff exactly (recovery.py). A handoff that leaves
  the registry (retention expired, evicted, abandoned) has its records
  deleted, so the file holds only what the registry holds. A handoff that
  completes is written once more, whole (its packed core and times), and that
  one record replaces its history in the same commit: recovery restores a
  retained handoff from one row instead of replaying nine (recovery.py).
- **Group commit.** Calls append to an in-memory batch synchronously (the
  registry never awaits); one writer task commits each batch in one
  transaction. The event loop never waits on the disk: a commit that could
  (it fsyncs) runs on a thread of its own, while the next batch gathers.
  Every commit with ``--durability full`` fsyncs. With ``normal``, a WAL
  commit only appends to the WAL (a write into the page cache, which the
  kernel throttles only when the disk falls far behind: far cheaper than
  the hop to a thread and back), so it runs on the
  event loop, except those that may fsync: the one that begins the WAL
  (its header is synced). A batch of more than :data:`LOOP_BATCH_MAX`
  records also goes to the thread: the streaming path's batches are large,
  and the loop serves on meanwhile. There a commit's records (and its
  departed handoffs) go in one statement per :data:`ROWS_PER_STATEMENT`:
  on a thread each statement ends in a wait for the GIL, up to Python's
  switch interval while the loop is busy, and one statement per record
  made a large batch's commit take hundreds of them. On the loop, one
  statement per record costs less CPU (SQLite runs a many-row VALUES as a
  subquery).
- **Checkpoints beside the commits, not between them.** SQLite's automatic
  checkpoint, which would run inside whichever commit crossed 1000 pages,
  is off. Once the WAL passes :data:`WAL_CHECKPOINT_BYTES` a second
  connection, on a thread of its own, copies it into the database (and
  syncs both) while commits go on: that copy takes many commits' time, and
  every call waiting on the barrier would wait for it. The WAL can begin
  again only once all of it is copied, so the writer's next commit, on its
  thread, first copies what was committed meanwhile (a few commits' pages),
  then commits and begins the WAL again (its header is synced). From the
  copy's start until then a third connection holds a read transaction (the
  pin): no commit on the loop can begin the WAL while a reader is in it, so
  the commits made while the copy runs stay on the loop. The WAL stays
  about that size.
- **Another writer waits off the loop.** SQLite's busy handler would sleep
  inside the commit, on the event loop, while another process (someone's
  ``sqlite3`` shell) holds a write transaction. Serving, the connection has
  none: a commit that meets the lock gives up at once, and the writer tries
  the same batch again after a pause while the loop serves on (answers
  wait). Past ``journal_busy_timeout_s`` it says who holds the lock
  (holders.py) and asks the server to drain; the drain's last commit waits
  that long again at most.
- **The barrier.** :meth:`Journal.durable` returns once everything appended
  so far (or up to a position, :attr:`Journal.appended` when it was taken)
  is committed. Every place the server writes to the network awaits it
  first, so no answer, acknowledgement or action leaves before the commit
  that holds it.
- **JSON bodies.** A few microseconds slower than pickle, but the file can be
  read with the ``sqlite3`` shell, and reading it never runs code.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import os
import sqlite3
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from handoff_server.durability import holders, statedir, statelock, torn
from handoff_server.durability.statedir import JournalError as JournalError
from handoff_server.durability.statedir import StateDirBusy as StateDirBusy

log = logging.getLogger("handoff.journal")

# 2: a completed handoff's history is replaced by one snapshot record
# (records.encode_retained), and a side settled without ever being sent
# anything is a record of its own (recovery.FORSAKEN). A version 1 file holds
# neither, and reads as is.
# 3: a retained row ends with why the handoff ended (its end reasons), and
# a fact's row with the reason the server gave it beyond the fact's own (a
# lost engine's cause, a drain, the caller's text); a format 2 retained row
# has none, and reads as ended for an unspecified reason.
FORMAT_VERSION = 3
DATABASE = "journal.sqlite3"
CHECKPOINT = "PRAGMA wal_checkpoint(PASSIVE)"
DURABILITY = {"normal": "NORMAL", "full": "FULL"}
READ_BATCH = 10_000
# A WAL larger than this is copied into the database (beside the commits).
# Each checkpoint ends in a catch-up that holds one commit for some
# milliseconds; at SQLite's own size (1000 pages, 4 MiB) that came several
# times a second under load, often enough to set the p99 of every call
# waiting for a commit (bench/RESULTS.md).
WAL_CHECKPOINT_BYTES = 16 * 2**20
# A batch larger than this is committed on the thread even when it cannot
# fsync: the streaming path's batches at its maximum rate, where the loop
# serves on meanwhile (about a tenth less CPU per handoff). Not smaller: a
# commit on the thread waits for the GIL after each statement, and while it
# waits the next batch grows past the limit too (bench/RESULTS.md).
LOOP_BATCH_MAX = 128
# Rows per statement at most in a commit on the writer's thread: each
# statement there ends in a wait for the GIL. Its statement for each count
# stays in the connection's cache of prepared statements (CACHED_STATEMENTS).
ROWS_PER_STATEMENT = 64
CACHED_STATEMENTS = 256
# A commit that met another process's write lock is tried again after this,
# doubling up to the most: a lock held for a moment costs a moment.
BUSY_FIRST_PAUSE_S = 0.002
BUSY_MAX_PAUSE_S = 0.1

SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS records (
    seq INTEGER PRIMARY KEY,
    handoff_id TEXT NOT NULL,
    at REAL NOT NULL,
    body TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS records_by_handoff ON records (handoff_id);
CREATE TABLE IF NOT EXISTS engines (
    engine_id TEXT PRIMARY KEY,
    incarnation TEXT NOT NULL
) WITHOUT ROWID;
"""


class NewerFormat(JournalError):
    pass


class JournalFailed(Exception):
    """A commit failed: what was appended may never be durable, so nothing
    built on it may be sent. The server stops; a restart recovers what was."""


# What one commit writes: records (seq, handoff id, time, body) in, departed
# handoffs (id, the first seq kept) out, engines' incarnations.
Inserts = list[tuple[int, str, float, str]]
Drops = list[tuple[str, int]]
Engines = dict[str, str]
Batch = tuple[Inserts, Drops, Engines]


@dataclass(frozen=True, slots=True)
class Record:
    seq: int
    handoff_id: str
    at: float
    body: list[Any]  # as records.encode wrote it


class Journal:
    """One open state dir: its lock, its database, and the batch being gathered."""

    def __init__(
        self,
        state_dir: Path,
        connection: sqlite3.Connection,
        lock_fd: int,
        incarnation: int,
        next_seq: int,
        busy_timeout_s: float = 5.0,
        checkpoint_bytes: int = WAL_CHECKPOINT_BYTES,
    ) -> None:
        self.state_dir = state_dir
        self.incarnation = incarnation  # this process's; larger than any before it
        self._db = connection
        self._wal = state_dir / (DATABASE + "-wal")
        # FULL fsyncs every commit, so no commit may run on the event loop.
        self._fsync_per_commit = self.synchronous == "FULL"
        self.checkpoint_bytes = checkpoint_bytes  # the WAL's size that starts a checkpoint
        self._checkpoint_at = checkpoint_bytes  # WAL bytes
        self._lock_fd = lock_fd
        self._next_seq = next_seq
        self._inserts: Inserts = []
        self._drops: Drops = []
        self._engines: Engines = {}
        self._appended = 0  # batch items ever appended
        self._committed = 0  # of those, how many are committed
        self._progress = asyncio.Event()
        self._wanted = asyncio.Event()
        self._failure: BaseException | None = None
        self._writer: asyncio.Task[None] | None = None
        self._executor: ThreadPoolExecutor | None = None
        # The checkpoint's own connection and thread (opened at the first one),
        # so commits go on while it copies the WAL; and the one running.
        self._checkpointer: sqlite3.Connection | None = None
        self._checkpoint_thread: ThreadPoolExecutor | None = None
        self._checkpointing: asyncio.Future[None] | None = None
        # Read from the copy's start to its catch-up, so that no commit on the
        # loop begins the WAL (and syncs) meanwhile; opened at the first copy.
        self._pin: sqlite3.Connection | None = None
        # The copy ended: the next commit copies the rest and begins the WAL.
        self._copied = False
        self._checkpoint_failure: BaseException | None = None
        self.on_failure: Callable[[BaseException], None] = lambda error: None
        # Another process held the write lock past busy_timeout_s: the server drains.
        self.busy_timeout_s = busy_timeout_s
        self.on_held: Callable[[str], None] = lambda reason: None
        self._held = asyncio.Event()
        # Bytes of the pages SQLite freed inside the database (space.py), measured
        # after each commit only while the volume is short of room.
        self._measure_reusable = False
        self._reusable_bytes = _reusable_bytes(connection)
        self.commits = 0
        self.committed_items = 0
        self.checkpoints = 0  # whole: each a copy beside the commits and its catch-up
        self.copies = 0

    # --- opening ------------------------------------------------------------

    @classmethod
    def open(
        cls,
        state_dir: Path,
        durability: str = "normal",
        busy_timeout_s: float = 5.0,
        checkpoint_bytes: int = WAL_CHECKPOINT_BYTES,
    ) -> Journal:
        """Lock ``state_dir``, open (or create) its journal, and take a new incarnation.

        A corrupt database is moved aside (kept for inspection) and the
        server starts empty: a coordinator that will not start serves no one.
        A full volume, or another process writing the journal for longer
        than ``busy_timeout_s``, is a :class:`JournalError` naming the setting.
        """
        problem = statedir.prepare(state_dir)
        if problem is not None:
            raise JournalError(problem)
        try:
            lock_fd = statelock.lock(state_dir)
        except PermissionError as error:
            reason = error.strerror or str(error)
            raise JournalError(statedir.unwritable(state_dir, reason)) from error
        except OSError as error:
            if error.errno in statedir.FULL_ERRNOS:
                raise JournalError(statedir.full(state_dir)) from None
            raise
        path = state_dir / DATABASE
        try:
            if statedir.is_full(state_dir):
                raise JournalError(statedir.full(state_dir))
            statelock.make_private(state_dir, lock_fd)
            statelock.private_database(path)
            torn.report_torn_tail(path)
            try:
                connection = _connect(path, durability, busy_timeout_s)
            except sqlite3.OperationalError as error:
                # Not the file's content (permissions, a full disk): keep it.
                raise JournalError(_cannot_open(state_dir, error)) from None
            except sqlite3.DatabaseError as error:
                _move_aside(path, str(error))
                connection = _connect(path, durability, busy_timeout_s)
            try:
                statelock.same_directory(state_dir, lock_fd)
                incarnation, last = _take_incarnation(connection, path)
                # Serving, a commit never waits inside SQLite (see the module's note).
                connection.execute("PRAGMA busy_timeout=0")
            except sqlite3.OperationalError as error:
                connection.close()
                raise JournalError(_cannot_open(state_dir, error)) from None
            except BaseException:
                connection.close()
                raise
        except BaseException:
            os.close(lock_fd)
            raise
        return cls(
            state_dir, connection, lock_fd, incarnation, last + 1, busy_timeout_s, checkpoint_bytes
        )

    # --- reading (recovery) -------------------------------------------------

    def records(self) -> Iterator[Record]:
        """Every record, oldest first."""
        for seq, handoff_id, at, body in self.rows():
            yield Record(seq, handoff_id, at, json.loads(body))

    def rows(self) -> Iterator[tuple[int, str, float, str]]:
        """Every record as stored, its body still JSON text, oldest first: so a
        replay decodes each distinct body once (most records repeat a few)."""
        cursor = self._db.execute("SELECT seq, handoff_id, at, body FROM records ORDER BY seq")
        while rows := cursor.fetchmany(READ_BATCH):
            yield from rows

    def rows_of(self, handoff_id: str, last_seq: int) -> list[tuple[int, str, float, str]]:
        """One handoff's records as stored, up to and including ``last_seq``, oldest first."""
        return self._db.execute(
            "SELECT seq, handoff_id, at, body FROM records WHERE handoff_id = ? AND seq <= ? "
            "ORDER BY seq",
            (handoff_id, last_seq),
        ).fetchall()

    def engine_incarnations(self) -> dict[str, str]:
        """Each engine's last incarnation, as last recorded."""
        return dict(self._db.execute("SELECT engine_id, incarnation FROM engines"))

    @property
    def synchronous(self) -> str:
        """SQLite's synchronous setting in force: NORMAL or FULL."""
        level = self._db.execute("PRAGMA synchronous").fetchone()[0]
        return {1: "NORMAL", 2: "FULL"}.get(level, str(level))

    def size_bytes(self) -> int:
        path = self.state_dir / DATABASE
        return sum(
            p.stat().st_size for p in (path, path.with_name(path.name + "-wal")) if p.exists()
        )

    # --- appending (the registry's Recorder) --------------------------------

    def append(self, handoff_id: str, at: float, body: list[object]) -> None:
        seq = self._next_seq
        self._next_seq = seq + 1
        self._inserts.append((seq, handoff_id, at, json.dumps(body, separators=(",", ":"))))
        self._appended += 1
        self._wanted.set()

    def replace(self, handoff_id: str, at: float, body: list[object]) -> None:
        """One record that stands for all of the handoff's earlier ones, which go
        in the same commit."""
        self._drops.append((handoff_id, self._next_seq))
        self.append(handoff_id, at, body)

    def drop(self, handoff_id: str) -> None:
        """The handoff left the registry: its records go with the next commit."""
        self._drops.append((handoff_id, self._next_seq))
        self._appended += 1
        self._wanted.set()

    def engine(self, engine_id: str, incarnation: str) -> None:
        self._engines[engine_id] = incarnation
        self._appended += 1
        self._wanted.set()

    # --- committing ---------------------------------------------------------

    def start_writer(self, commit_delay_s: float = 0.0) -> None:
        """Commit from now on (on the event loop or a thread of the journal's own,
        see the module's note); at most one commit per ``commit_delay_s``
        (counted from the end of the previous one)."""
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="handoff-journal")
        self._writer = asyncio.create_task(self._write(commit_delay_s), name="handoff-journal")

    @property
    def appended(self) -> int:
        """How many items were ever appended: a position :meth:`durable` can wait for."""
        return self._appended

    async def durable(self, upto: int | None = None) -> None:
        """Return once everything appended so far, or the first ``upto`` items, is committed."""
        target = self._appended if upto is None else upto
        while self._committed < target:
            if self._failure is not None:
                raise JournalFailed(f"the journal cannot be written: {self._failure}")
            progress = self._progress
            await progress.wait()

    async def _write(self, commit_delay_s: float) -> None:
        """The writer's loop. Most of a small commit's CPU is its two thread
        hops and its transaction, not its records (bench/RESULTS.md): under a
        steady stream of unary calls a commit right after the previous one
        holds one or two calls. Waiting until ``commit_delay_s`` after the
        previous commit lets a commit gather what arrives meanwhile; a call
        to an idle server (no commit within the delay) is committed at once."""
        loop = asyncio.get_running_loop()
        last_commit = -math.inf
        try:
            while True:
                await self._wanted.wait()
                if self._checkpoint_failure is not None:
                    raise self._checkpoint_failure
                gathering = last_commit + commit_delay_s - loop.time()
                if gathering > 0:
                    await asyncio.sleep(gathering)
                self._wanted.clear()
                reaching = self._appended
                await self._commit_waiting(loop, self._take_batch())
                self._checkpoint_if_due(loop)
                last_commit = loop.time()
                self.commits += 1
                self.committed_items += reaching - self._committed
                self._committed = reaching
                self._progress.set()
                self._progress = asyncio.Event()
        except asyncio.CancelledError:
            raise
        except BaseException as error:
            log.critical("journal commit failed; stopping the server: %s", error)
            self._failure = error
            self._progress.set()
            self.on_failure(error)

    async def _commit_waiting(self, loop: asyncio.AbstractEventLoop, batch: Batch) -> None:
        """Commit ``batch``: on the loop, or on the thread if it is large or may
        fsync (:meth:`_may_fsync`; a checkpoint's catch-up; while its copy runs).
        While another process holds the write lock, the same batch is tried
        again after a pause (the loop serves meanwhile); past
        ``busy_timeout_s`` the server is asked to drain, and the writer goes on
        trying, so a lock released during the drain still lets it end well."""
        catch_up, self._copied = self._copied, False
        if catch_up:
            self._unpin()  # the catch-up copies what was committed since the pin
        on_thread = catch_up or len(batch[0]) + len(batch[1]) > LOOP_BATCH_MAX or self._may_fsync()
        if catch_up:
            commit = self._catch_up_and_commit
        else:
            commit = self._commit_on_thread if on_thread else self._commit
        waiting_since: float | None = None
        pause = BUSY_FIRST_PAUSE_S
        while True:
            try:
                if on_thread:
                    await loop.run_in_executor(self._executor, commit, *batch)
                else:
                    commit(*batch)
                break
            except sqlite3.OperationalError as error:
                if error.sqlite_errorcode & 0xFF != sqlite3.SQLITE_BUSY:
                    raise
            if catch_up:
                commit = self._commit_on_thread  # the catch-up has run
            now = loop.time()
            if waiting_since is None:
                waiting_since = now
                log.warning(
                    "journal commits wait: %s holds a write transaction on %s; calls are "
                    "answered once it ends, or the server drains in %g s "
                    "(journal_busy_timeout_s)",
                    self._holder(),
                    self.state_dir / DATABASE,
                    self.busy_timeout_s,
                )
            elif not self._held.is_set() and now - waiting_since >= self.busy_timeout_s:
                self._held.set()
                reason = (
                    f"the journal in --state-dir {self.state_dir} is held by {self._holder()}: "
                    f"a commit waited {now - waiting_since:.1f} s for its write transaction "
                    f"(journal_busy_timeout_s {self.busy_timeout_s:g}); draining the server: "
                    "stop that process (reading the journal is harmless, writing it is not)"
                )
                log.error("%s", reason)
                self.on_held(reason)
            await asyncio.sleep(pause)
            pause = min(2 * pause, BUSY_MAX_PAUSE_S)
        if waiting_since is not None:
            self._held.clear()
            log.warning(
                "journal commits go on: the other process's write transaction ended after %.1f s",
                loop.time() - waiting_since,
            )

    def _holder(self) -> str:
        return holders.describe(holders.write_lock_holder(self.state_dir / DATABASE))

    def _take_batch(self) -> Batch:
        batch = self._inserts, self._drops, self._engines
        self._inserts, self._drops, self._engines = [], [], {}
        return batch

    def _may_fsync(self) -> bool:
        """Whether the next commit may fsync: with FULL, each one; with NORMAL,
        the one that begins an empty WAL (just opened); the one after a
        checkpoint is the caller's to know."""
        return self._fsync_per_commit or self._wal_bytes() == 0

    def _checkpoint_if_due(self, loop: asyncio.AbstractEventLoop) -> None:
        """Start the checkpoint's copy beside the commits if the WAL is past its
        size and no checkpoint is under way; a failed copy stops the writer at
        its next commit."""
        if self._checkpointing is not None or self._copied:
            return  # one runs, or its catch-up is still to come
        if self._wal_bytes() < self._checkpoint_at:
            return
        if self._checkpoint_thread is None:
            self._checkpoint_thread = ThreadPoolExecutor(1, thread_name_prefix="handoff-checkpoint")
            self._pin = sqlite3.connect(
                self.state_dir / DATABASE, timeout=0, isolation_level=None, check_same_thread=False
            )
        # Reads everything committed so far (the copy's whole extent), from the
        # WAL's frames, so no writer may begin the WAL until the catch-up.
        assert self._pin is not None
        self._pin.execute("BEGIN")
        self._pin.execute("SELECT count(*) FROM meta").fetchone()
        running = loop.run_in_executor(self._checkpoint_thread, self._checkpoint_beside)
        self._checkpointing = running

        def ended(future: asyncio.Future[None]) -> None:
            self._checkpointing = None
            self._copied = True
            if not future.cancelled() and future.exception() is not None:
                self._checkpoint_failure = future.exception()
                self._wanted.set()  # the writer raises it

        running.add_done_callback(ended)

    def _unpin(self) -> None:
        if self._pin is not None and self._pin.in_transaction:
            self._pin.execute("COMMIT")

    def _checkpoint_beside(self) -> None:
        """The copy, on the checkpointer's own connection (on its thread); what
        is committed meanwhile is left to the catch-up."""
        if self._checkpointer is None:
            self._checkpointer = _checkpointer(self.state_dir / DATABASE, self.synchronous)
        self._checkpointer.execute(CHECKPOINT).fetchone()
        self.copies += 1

    def _catch_up_and_commit(self, inserts: Inserts, drops: Drops, engines: Engines) -> None:
        """After the copy, on the writer's thread: copy the rest, then commit
        (which begins the WAL again, the copy being whole)."""
        self._checkpoint(self._db)
        self._commit_on_thread(inserts, drops, engines)

    def _wal_bytes(self) -> int:
        try:
            return self._wal.stat().st_size
        except FileNotFoundError:
            return 0

    def _commit_checkpointing(self, inserts: Inserts, drops: Drops, engines: Engines) -> None:
        """Checkpoint if the WAL has grown past its size, then commit: off the
        event loop (both may fsync)."""
        if self._wal_bytes() >= self._checkpoint_at:
            self._checkpoint(self._db)
        self._commit(inserts, drops, engines)

    def _checkpoint(self, db: sqlite3.Connection) -> None:
        """Copy the WAL into the database, between commits. PASSIVE never
        waits: a reader of an older snapshot (someone's ``sqlite3`` shell) keeps
        its frames in the WAL, which then grows until the next try, a WAL's
        size later."""
        busy, frames, copied = db.execute(CHECKPOINT).fetchone()
        self.checkpoints += 1
        if busy or copied < frames:
            self._checkpoint_at = self._wal_bytes() + self.checkpoint_bytes
            log.warning(
                "journal checkpoint copied %d of %d WAL frames (another connection reads "
                "the journal): the WAL grows to %d bytes before the next try",
                copied,
                frames,
                self._checkpoint_at,
            )
        else:
            # The next commit begins the WAL again, and journal_size_limit=0
            # truncates the file to what that commit wrote.
            self._checkpoint_at = self.checkpoint_bytes

    def _commit(
        self, inserts: Inserts, drops: Drops, engines: Engines, few_statements: bool = False
    ) -> None:
        """One transaction: the batch's records in, its departed handoffs' out
        (each bounded by seq: a handoff id may be reused once its handoff left);
        in one statement per row, or per ROWS_PER_STATEMENT ``few_statements``.

        IMMEDIATE takes the write lock first: another writer's lock fails the
        commit (SQLITE_BUSY) before any work, and the writer tries again."""
        db = self._db
        db.execute("BEGIN IMMEDIATE")
        try:
            if few_statements:
                for rows in _slices(inserts):
                    db.execute(_INSERTS[len(rows)], [value for row in rows for value in row])
                for gone in _slices(drops):
                    db.execute(_DELETES[len(gone)], [value for row in gone for value in row])
            else:
                db.executemany(INSERT, inserts)
                if drops:
                    db.executemany(DELETE, drops)
            if engines:
                db.executemany("INSERT OR REPLACE INTO engines VALUES (?, ?)", engines.items())
        except BaseException:
            db.execute("ROLLBACK")
            raise
        db.execute("COMMIT")
        if self._measure_reusable:
            self._reusable_bytes = _reusable_bytes(db)

    def _commit_on_thread(self, inserts: Inserts, drops: Drops, engines: Engines) -> None:
        self._commit(inserts, drops, engines, few_statements=True)

    def reusable_bytes(self) -> int:
        """Bytes of the pages SQLite freed inside the database, as last measured."""
        return self._reusable_bytes

    def measure_reusable(self, on: bool) -> None:
        """Measure :meth:`reusable_bytes` after each commit (a query each), or stop."""
        self._measure_reusable = on

    def commit_now(self) -> None:
        """Commit what is pending, synchronously (tools and tests without a writer)."""
        assert self._writer is None, "the writer task commits while it runs"
        self._commit_checkpointing(*self._take_batch())
        self._committed = self._appended

    async def close(self) -> None:
        """Commit what is pending, checkpoint, and release the state dir."""
        try:
            if self._writer is None:
                self.commit_now()
            elif self._failure is None:
                await self._last_commit()
        finally:
            if self._writer is not None:
                self._writer.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await self._writer
            await self._end_checkpoints()
            if self._executor is None:
                self.close_now()
            else:
                # The last checkpoint fsyncs: off the event loop too.
                await asyncio.get_running_loop().run_in_executor(self._executor, self.close_now)
                self._executor.shutdown()
                self._executor = None

    async def _last_commit(self) -> None:
        """Until what is pending is committed; while another process holds the
        write lock, ``busy_timeout_s`` more at most (then it is left uncommitted:
        nothing built on it was sent, and a restart recovers what was committed)."""
        durable = asyncio.ensure_future(self.durable())
        held = asyncio.ensure_future(self._held.wait())
        try:
            await asyncio.wait((durable, held), return_when=asyncio.FIRST_COMPLETED)
            if not durable.done():
                await asyncio.wait((durable,), timeout=self.busy_timeout_s)
            if durable.done():
                durable.result()
                return
            log.error(
                "the journal in --state-dir %s is still held by %s: %d calls are left "
                "uncommitted, none of them answered; a restart recovers what was committed",
                self.state_dir,
                self._holder(),
                self._appended - self._committed,
            )
        finally:
            durable.cancel()
            held.cancel()

    async def _end_checkpoints(self) -> None:
        """Let a running checkpoint end, then close its connection and thread."""
        if self._checkpoint_thread is None:
            return
        if self._checkpointing is not None:
            with contextlib.suppress(Exception):
                await self._checkpointing
        if self._pin is not None:
            self._unpin()
            self._pin.close()
            self._pin = None
        if self._checkpointer is not None:
            checkpointer, self._checkpointer = self._checkpointer, None
            await asyncio.get_running_loop().run_in_executor(
                self._checkpoint_thread, checkpointer.close
            )
        self._checkpoint_thread.shutdown()
        self._checkpoint_thread = None

    def close_now(self) -> None:
        """Release without committing (start failed, or after close)."""
        with contextlib.suppress(sqlite3.Error):
            self._db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        self._db.close()
        with contextlib.suppress(OSError):
            os.close(self._lock_fd)


INSERT = "INSERT INTO records VALUES (?, ?, ?, ?)"
DELETE = "DELETE FROM records WHERE handoff_id = ? AND seq < ?"
# The same for n rows in one statement, for each n up to ROWS_PER_STATEMENT.
_INSERTS = [
    "",
    *(
        "INSERT INTO records VALUES " + ", ".join(["(?, ?, ?, ?)"] * n)
        for n in range(1, ROWS_PER_STATEMENT + 1)
    ),
]
_DELETES = [
    "",
    *(
        "WITH gone (handoff_id, seq) AS (VALUES " + ", ".join(["(?, ?)"] * n) + ") "
        "DELETE FROM records WHERE seq IN (SELECT records.seq FROM gone JOIN records "
        "ON records.handoff_id = gone.handoff_id AND records.seq < gone.seq)"
        for n in range(1, ROWS_PER_STATEMENT + 1)
    ),
]


Row = TypeVar("Row")


def _slices(rows: list[Row]) -> Iterator[list[Row]]:
    for first in range(0, len(rows), ROWS_PER_STATEMENT):
        yield rows[first : first + ROWS_PER_STATEMENT]


def fresh_incarnation() -> int:
    """A coordinator incarnation from the clock (microseconds): new at each start,
    and comparable with those the journal hands out, which never go back."""
    return time.time_ns() // 1000


def _connect(path: Path, durability: str, busy_timeout_s: float = 5.0) -> sqlite3.Connection:
    # check_same_thread off: opened here, then used by the writer, on the
    # event loop or its thread, never both at once.
    # Autocommit: _commit opens and ends its transactions itself.
    # The busy timeout holds for opening only (not serving yet): Journal.open.
    connection = sqlite3.connect(
        path,
        timeout=busy_timeout_s,
        isolation_level=None,
        check_same_thread=False,
        cached_statements=CACHED_STATEMENTS,
    )
    try:
        connection.execute("PRAGMA journal_mode=WAL")
        connection.execute(f"PRAGMA synchronous={DURABILITY[durability]}")
        # The writer checkpoints itself, off the event loop (Journal._checkpoint).
        connection.execute("PRAGMA wal_autocheckpoint=0")
        connection.execute("PRAGMA journal_size_limit=0")
        problems = [row[0] for row in connection.execute("PRAGMA quick_check")]
        if problems != ["ok"]:
            raise sqlite3.DatabaseError("; ".join(problems[:5]))
        connection.executescript(SCHEMA)
    except BaseException:
        connection.close()
        raise
    return connection


def _checkpointer(path: Path, synchronous: str) -> sqlite3.Connection:
    """A second connection to the open journal, for checkpoints only: its
    syncs follow the journal's durability, and it never waits for a lock."""
    connection = sqlite3.connect(path, timeout=0, isolation_level=None, check_same_thread=False)
    connection.execute(f"PRAGMA synchronous={synchronous}")
    connection.execute("PRAGMA wal_autocheckpoint=0")
    return connection


def _take_incarnation(connection: sqlite3.Connection, path: Path) -> tuple[int, int]:
    """Check the file's format, record a new incarnation; the incarnation and the last seq."""
    version = connection.execute("SELECT value FROM meta WHERE key = 'format_version'").fetchone()
    if version is not None and int(version[0]) > FORMAT_VERSION:
        raise NewerFormat(
            f"{path} was written in journal format {version[0]}, newer than this "
            f"server's {FORMAT_VERSION}: run the newer server, or move the state "
            "dir aside to start empty"
        )
    row = connection.execute("SELECT value FROM meta WHERE key = 'incarnation'").fetchone()
    previous = int(row[0]) if row is not None else 0
    incarnation = max(previous + 1, fresh_incarnation())
    connection.execute(
        "INSERT OR REPLACE INTO meta VALUES ('format_version', ?), ('incarnation', ?)",
        (FORMAT_VERSION, incarnation),
    )
    last = connection.execute("SELECT max(seq) FROM records").fetchone()[0]
    return incarnation, last or 0


def _reusable_bytes(connection: sqlite3.Connection) -> int:
    """Bytes of the database's free pages, which SQLite fills before it grows the file."""
    pages: int = connection.execute("PRAGMA freelist_count").fetchone()[0]
    size: int = connection.execute("PRAGMA page_size").fetchone()[0]
    return pages * size


def _cannot_open(state_dir: Path, error: sqlite3.OperationalError) -> str:
    """One line for an SQLite error at open that is not the file's content."""
    path = state_dir / DATABASE
    code = error.sqlite_errorcode & 0xFF
    if code == sqlite3.SQLITE_FULL or statedir.is_full(state_dir):
        return statedir.full(state_dir)
    if code == sqlite3.SQLITE_BUSY:
        return (
            f"--state-dir {state_dir}: {path} is being written by "
            f"{holders.describe(holders.write_lock_holder(path))}: stop that process, "
            "then start again"
        )
    if code in (sqlite3.SQLITE_READONLY, sqlite3.SQLITE_CANTOPEN, sqlite3.SQLITE_PERM):
        return statedir.unwritable(state_dir, str(error))
    return f"--state-dir {state_dir}: cannot open {path} ({error}); {statedir.FIX}"


def _move_aside(path: Path, reason: str) -> None:
    aside = path.with_name(f"{path.name}.corrupt-{time.strftime('%Y%m%dT%H%M%S')}")
    for suffix in ("", "-wal", "-shm"):
        part = path.with_name(path.name + suffix)
        if part.exists():
            part.rename(aside.with_name(aside.name + suffix))
    log.error(
        "journal %s is corrupt (%s); moved aside to %s and starting EMPTY: the handoffs it "
        "held are lost to this server, their engines must free them on their own",
        path,
        reason,
        aside,
    )
