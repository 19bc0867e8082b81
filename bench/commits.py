"""One journal commit on the writer's thread while the event loop's thread runs Python.

The thread releases the GIL inside each SQLite call and must take it back
after: while the other thread runs Python, each take waits up to Python's
switch interval. So a commit's time on the thread is about its statements'
count times that wait, whatever its size. This times a commit of ``--rows``
records made as one INSERT per record (``executemany``, the journal's way
before, and still on the loop) and as the journal makes it on its thread
now (one statement per ``ROWS_PER_STATEMENT``), on the calling thread, then
on a thread with the calling thread idle and busy.

Run: .venv/bin/python -m bench.commits   (--rows 200 --repeats 30)
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from handoff_server.durability.journal import Journal

Rows = list[tuple[int, str, float, str]]
BODY = '["fact",{"source_held":{"blocks":12}}]'


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--rows", type=int, default=200, help="records per commit")
    parser.add_argument("--repeats", type=int, default=30, help="commits per figure")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="bench-commits-") as state:
        journal = Journal.open(Path(state), "normal")
        seq = iter(range(1, 10**9))

        def batch() -> Rows:
            return [(next(seq), f"h{i}", 1.0, BODY) for i in range(args.rows)]

        def per_record(rows: Rows) -> None:
            db = journal._db
            db.execute("BEGIN IMMEDIATE")
            db.executemany("INSERT INTO records VALUES (?, ?, ?, ?)", rows)
            db.execute("COMMIT")

        def few_statements(rows: Rows) -> None:
            journal._commit(rows, [], {}, few_statements=True)

        print(
            f"| commit of {args.rows} records | on the caller | on a thread | "
            "on a thread, caller busy |"
        )
        print("|---|---|---|---|")
        with ThreadPoolExecutor(1) as thread:
            for name, commit in (
                ("one INSERT per record", per_record),
                ("one per ROWS_PER_STATEMENT", few_statements),
            ):
                figures = [
                    timed(args.repeats, batch, commit, thread, where)
                    for where in ("caller", "thread", "busy")
                ]
                print(f"| {name} | " + " | ".join(f"{ms:.2f} ms" for ms in figures) + " |")
        journal.close_now()
    return 0


def timed(
    repeats: int,
    batch: Callable[[], Rows],
    commit: Callable[[Rows], None],
    thread: ThreadPoolExecutor,
    where: str,
) -> float:
    """The median milliseconds of ``repeats`` commits: on the caller, or on
    ``thread`` with the caller waiting idle or running Python meanwhile."""
    times = []
    for _ in range(repeats):
        rows = batch()
        began = time.perf_counter()
        if where == "caller":
            commit(rows)
        else:
            done = thread.submit(commit, rows)
            if where == "busy":
                while not done.done():
                    sum(range(200))  # the event loop's thread, handling calls
            done.result()
        times.append(time.perf_counter() - began)
    return statistics.median(times) * 1e3


if __name__ == "__main__":
    raise SystemExit(main())
