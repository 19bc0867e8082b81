"""The state dir held by one server, and private to it.

The OS-level lock (``flock``) is on the directory itself, so deleting or
replacing the ``lock`` file, which only names the holder's pid, cannot
admit a second server; that file, and the journal's, are opened without
following a symlink, and the lock file is not written through another
name (a hard link), so a planted name cannot make the server overwrite
another file. The directory is 0700 and its files 0600: the journal holds
engine ids and trace context.
"""

from __future__ import annotations

import fcntl
import logging
import os
import stat
from pathlib import Path

from handoff_server.durability.statedir import FIX, JournalError, StateDirBusy

log = logging.getLogger("handoff.journal")

LOCK = "lock"


def lock(state_dir: Path) -> int:
    """Hold ``state_dir`` for this process; a second server on it is refused.

    The OS-level lock is on the directory itself, which holds the journal:
    deleting or replacing the ``lock`` file cannot admit a second server.
    That file only names the holder's pid, and is opened without following
    a symlink (a planted link must not make the server overwrite its target)."""
    try:
        fd = os.open(state_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except PermissionError:
        raise
    except OSError as error:
        raise JournalError(
            f"--state-dir {state_dir} cannot be locked ({error.strerror}): it must be a "
            f"directory, not a symlink to one; {FIX}"
        ) from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        try:
            holder = (state_dir / LOCK).read_text(errors="replace").strip()[:32] or "unknown"
        except OSError:
            holder = "unknown"
        raise StateDirBusy(
            f"state dir {state_dir} is in use by another handoff server (pid {holder}); "
            "one server per state dir"
        ) from None
    try:
        write_private(state_dir / LOCK, f"{os.getpid()}\n".encode())
    except BaseException:
        os.close(fd)
        raise
    return fd


def make_private(state_dir: Path, fd: int) -> None:
    """What the journal holds (engine ids, trace context) is the server's alone:
    the state dir is 0700. One the server does not own (a volume's root, owned
    by root with the pod's fsGroup) cannot be changed: said, not refused."""
    try:
        os.fchmod(fd, 0o700)
    except PermissionError:
        log.warning(
            "state dir %s is not owned by uid %d: its mode is left as it is; point "
            "--state-dir at a directory the server creates for it to be 0700",
            state_dir,
            os.geteuid(),
        )


def write_private(path: Path, data: bytes) -> None:
    """Replace ``path``'s content, never through a symlink; the file is 0600."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    except PermissionError:
        raise  # the state dir is not writable: the caller says which setting fixes it
    except OSError as error:
        raise JournalError(f"{path}: not a regular file the server may write ({error})") from None
    try:
        status = os.fstat(fd)
        if not stat.S_ISREG(status.st_mode):
            raise JournalError(f"{path}: not a regular file")
        if status.st_nlink > 1:
            # Another name for some other file: writing would overwrite it.
            raise JournalError(f"{path}: has {status.st_nlink} hard links; remove it")
        os.fchmod(fd, 0o600)
        os.ftruncate(fd, 0)
        os.pwrite(fd, data, 0)
    finally:
        os.close(fd)


def private_database(path: Path) -> None:
    """The database (and so its -wal and -shm, which SQLite creates with the
    database's permissions) is 0600, and never a symlink."""
    for name, create in ((path.name, os.O_CREAT), (path.name + "-wal", 0), (path.name + "-shm", 0)):
        try:
            fd = os.open(path.with_name(name), os.O_RDONLY | create | os.O_NOFOLLOW, 0o600)
        except FileNotFoundError:
            continue
        except OSError as error:
            raise JournalError(f"cannot open {path.with_name(name)}: {error}") from None
        try:
            os.fchmod(fd, 0o600)
        finally:
            os.close(fd)


def same_directory(state_dir: Path, fd: int) -> None:
    """The state dir is still the directory locked (checked by inode): one
    renamed or swapped for another while the server opened it is refused."""
    locked, now = os.fstat(fd), os.lstat(state_dir)
    if (locked.st_dev, locked.st_ino) != (now.st_dev, now.st_ino):
        raise JournalError(
            f"--state-dir {state_dir} was replaced while the server locked it (another "
            f"directory is at that path now): start again; {FIX}"
        )
