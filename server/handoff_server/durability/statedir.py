"""The state dir checked before the journal opens it, each failure naming --state-dir.

A bare ``[Errno 20] Not a directory`` says nothing of which setting to fix,
and creating a mistyped path with all its parents would start the server
empty and report "recovered 0 handoffs" as if that were the journal. So the
state dir must be a directory, or a new one whose parent exists; it is
created only then, and that is logged. A full volume, or one the journal
cannot write, is said as one line naming the setting, not a traceback.
"""

from __future__ import annotations

import errno
import logging
import os
from pathlib import Path

log = logging.getLogger("handoff.journal")

FIX = "fix --state-dir (HANDOFF_STATE_DIR)"


class JournalError(Exception):
    """The state dir cannot be used; the server must not start (exit 2)."""


class StateDirBusy(JournalError):
    pass


# A write refused for want of space (a quota counts as the volume's size).
FULL_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT})


def prepare(state_dir: Path) -> str | None:
    """Make ``state_dir`` a usable directory, creating it (one level) if new;
    what is wrong with it otherwise, naming the setting."""
    if state_dir.exists() and not state_dir.is_dir():
        return f"--state-dir {state_dir} is a file, not a directory: {FIX}"
    if not state_dir.exists():
        parent = state_dir.parent
        if not parent.is_dir():
            return (
                f"--state-dir {state_dir}: its parent {parent} does not exist (a typo?); "
                f"create it first, or {FIX}"
            )
        try:
            state_dir.mkdir(mode=0o700)
        except OSError as error:
            return (
                f"--state-dir {state_dir} cannot be created ({error.strerror}): make "
                f"{parent} writable by uid {os.geteuid()}, or {FIX}"
            )
        log.warning(
            "state dir %s did not exist: created it, and the server starts with no "
            "handoffs; if a journal should be here, check --state-dir",
            state_dir,
        )
    return None


def unwritable(state_dir: Path, reason: str) -> str:
    """What to say when a file cannot be made in an existing state dir."""
    return (
        f"--state-dir {state_dir} is not writable ({reason}): make it writable by "
        f"uid {os.geteuid()}, or {FIX}"
    )


def full(state_dir: Path) -> str:
    """What to say when the state dir's volume has no room for the journal."""
    try:
        usage = os.statvfs(state_dir)
        free = usage.f_bavail * usage.f_frsize
        left = f"{free / 2**20:.1f} MiB free of {usage.f_blocks * usage.f_frsize / 2**20:.1f}"
    except OSError:
        left = "no room"
    return (
        f"--state-dir {state_dir}: its volume is full ({left} MiB), so the journal cannot "
        "be written: free space on that volume or grow it, then start again (the journal is "
        "kept as it is, and its handoffs are recovered then)"
    )


def is_full(state_dir: Path) -> bool:
    """Whether the state dir's volume has no byte left for this process."""
    try:
        usage = os.statvfs(state_dir)
    except OSError:
        return False
    return usage.f_bavail == 0
