"""Another process holding a write transaction on a journal, as someone's
``sqlite3`` shell would: the writer the journal must wait for off the loop."""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

# Begins a write transaction, says so, and holds it until its stdin closes.
HOLD = """
import sqlite3, sys
db = sqlite3.connect(sys.argv[1], isolation_level=None)
db.execute("BEGIN IMMEDIATE")
print("held", flush=True)
sys.stdin.read()
"""


@contextlib.asynccontextmanager
async def holding(database: Path) -> AsyncIterator[asyncio.subprocess.Process]:
    """The holder process, once it holds ``database``'s write lock; released at exit."""
    holder = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        HOLD,
        str(database),
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
    )
    assert holder.stdin is not None
    assert holder.stdout is not None
    try:
        assert await holder.stdout.readline() == b"held\n"
        yield holder
    finally:
        holder.stdin.close()
        await holder.wait()


@contextlib.contextmanager
def holding_now(database: Path) -> Iterator[subprocess.Popen[bytes]]:
    """:func:`holding`, for a test without an event loop."""
    with subprocess.Popen(
        [sys.executable, "-c", HOLD, str(database)], stdin=subprocess.PIPE, stdout=subprocess.PIPE
    ) as holder:
        assert holder.stdout is not None
        try:
            assert holder.stdout.readline() == b"held\n"
            yield holder
        finally:
            holder.communicate(b"")
