"""--state-dir that cannot be used: each refusal names the setting and the fix,
and a mistyped path is neither created with all its parents nor reported as
an empty journal."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest

from handoff_server.durability.journal import Journal, JournalError

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
