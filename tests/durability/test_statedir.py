"""--state-dir that cannot be used: each refusal names the setting and the fix,
and a mistyped path is neither created with all its parents nor reported as
an empty journal."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest

from handoff_server.durability.journal import Journal, JournalError
from tests.support.holder import holding_now

FIX = "fix --state-dir (HANDOFF_STATE_DIR)"


def test_a_file_is_refused_naming_the_setting(tmp_path: Path) -> None:
    state = tmp_path / "state"
    state.write_text("not a directory")
    with pytest.raises(JournalError) as refused:
        Journal.open(state)
    assert str(refused.value) == f"--state-dir {state} is a file, not a directory: {FIX}"


def test_a_mistyped_path_is_not_created(tmp_path: Path) -> None:
    state = tmp_path / "var" / "lib" / "handoff"
    with pytest.raises(JournalError) as refused:
        Journal.open(state)
    assert f"its parent {state.parent} does not exist (a typo?)" in str(refused.value)
    assert FIX in str(refused.value)
    assert not (tmp_path / "var").exists()


def test_a_new_directory_is_created_and_said_so(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    state = tmp_path / "state"
    with caplog.at_level(logging.WARNING, logger="handoff.journal"):
        journal = Journal.open(state)
    journal.close_now()
    assert state.is_dir()
    (line,) = [r.getMessage() for r in caplog.records if r.name == "handoff.journal"]
    assert f"state dir {state} did not exist: created it" in line
    assert "check --state-dir" in line


def unwritable_dir(tmp_path: Path) -> Path:
    """A directory this process cannot create files in (root ignores modes)."""
    if os.geteuid() != 0:
        tmp_path.chmod(0o500)
        return tmp_path
    try:
        os.close(os.open("/sys/handoff-test.lock", os.O_RDWR | os.O_CREAT, 0o644))
    except PermissionError:
        return Path("/sys")
    os.unlink("/sys/handoff-test.lock")
    pytest.skip("running as root with no read-only directory at hand")


def test_a_read_only_directory_is_refused_naming_the_setting(tmp_path: Path) -> None:
    state = unwritable_dir(tmp_path)
    try:
        with pytest.raises(JournalError) as refused:
            Journal.open(state)
    finally:
        tmp_path.chmod(0o700)
    assert f"--state-dir {state} is not writable" in str(refused.value)
    assert FIX in str(refused.value)


def test_a_symlink_is_refused_naming_the_setting(tmp_path: Path) -> None:
    """The lock is on the directory itself, opened without following a link:
    a link is refused with the setting to fix, not a bare OSError."""
    real = tmp_path / "real"
    real.mkdir()
    state = tmp_path / "state"
    state.symlink_to(real)
    with pytest.raises(JournalError) as refused:
        Journal.open(state)
    assert f"--state-dir {state} cannot be locked" in str(refused.value)
    assert "not a symlink" in str(refused.value)
    assert FIX in str(refused.value)
    assert list(real.iterdir()) == []


def test_a_full_volume_is_refused_in_one_line_naming_the_setting(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SQLite says "database or disk is full" (or "disk I/O error") from deep
    inside the open; the server says which setting, and what to do.
    (tests/service/test_security_attacks.py does it on a real full volume.)"""
    Journal.open(tmp_path).close_now()
    real = os.statvfs(tmp_path)

    class Full:
        f_bavail, f_frsize, f_blocks = 0, real.f_frsize, 4096

    monkeypatch.setattr(os, "statvfs", lambda path: Full())
    with pytest.raises(JournalError) as refused:
        Journal.open(tmp_path)
    assert str(refused.value) == (
        f"--state-dir {tmp_path}: its volume is full "
        f"(0.0 MiB free of {4096 * real.f_frsize / 2**20:.1f} MiB), so the journal cannot be "
        "written: free space on that volume or grow it, then start again (the journal is "
        "kept as it is, and its handoffs are recovered then)"
    )


def test_a_journal_another_process_writes_is_refused_naming_it(tmp_path: Path) -> None:
    Journal.open(tmp_path).close_now()
    database = tmp_path / "journal.sqlite3"
    with holding_now(database) as holder, pytest.raises(JournalError) as refused:
        Journal.open(tmp_path, busy_timeout_s=0.1)
    assert str(refused.value).startswith(
        f"--state-dir {tmp_path}: {database} is being written by pid {holder.pid}"
    )
    assert str(refused.value).endswith(": stop that process, then start again")


def test_a_lock_file_with_another_name_is_not_written(tmp_path: Path) -> None:
    """A hard link is another name for a file the server must not overwrite."""
    state = tmp_path / "state"
    state.mkdir()
    precious = tmp_path / "precious"
    precious.write_text("keep me\n")
    os.link(precious, state / "lock")
    with pytest.raises(JournalError, match="lock: has 2 hard links; remove it"):
        Journal.open(state)
    assert precious.read_text() == "keep me\n"
