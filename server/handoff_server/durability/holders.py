"""Who holds the journal's write lock, for the message that says why commits wait.

Another process that opens ``journal.sqlite3`` and begins a write (someone's
``sqlite3`` shell, a backup tool that writes) makes every commit wait. "The
database is locked" says nothing of whom to stop, so the holder is looked
up: in WAL mode SQLite's write lock is a POSIX record lock on one byte of
the ``-shm`` file, and ``F_GETLK`` names the process holding it (never this
one: a process's own locks do not conflict with it). Linux's ``struct
flock`` layout; anywhere it does not apply, the holder is "another process".
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import struct
from pathlib import Path

# SQLite's unix VFS: the WAL locks start at byte 120 of the -shm file
# ((22 + SQLITE_SHM_NLOCK) * 4), the writer's lock first.
WAL_WRITE_LOCK_BYTE = 120
# struct flock on Linux (x86_64, aarch64): l_type, l_whence, l_start, l_len, l_pid.
FLOCK = struct.Struct("@hhqqi4x")


def write_lock_holder(database: Path) -> int | None:
    """The pid of the process holding ``database``'s WAL write lock, if known."""
    shm = database.with_name(database.name + "-shm")
    try:
        fd = os.open(shm, os.O_RDWR | os.O_NOFOLLOW)
    except OSError:
        return None
    try:
        query = FLOCK.pack(fcntl.F_WRLCK, os.SEEK_SET, WAL_WRITE_LOCK_BYTE, 1, 0)
        answer = fcntl.fcntl(fd, fcntl.F_GETLK, query)
    except OSError:
        return None
    finally:
        os.close(fd)
    kind, _, _, _, pid = FLOCK.unpack(answer)
    return pid if kind != fcntl.F_UNLCK and pid > 0 else None


def describe(pid: int | None) -> str:
    """``pid 4242 (sqlite3)``, or ``another process`` when it is not known."""
    if pid is None:
        return "another process"
    name = ""
    with contextlib.suppress(OSError):
        name = Path(f"/proc/{pid}/comm").read_text(errors="replace").strip()[:32]
    return f"pid {pid} ({name})" if name else f"pid {pid}"
