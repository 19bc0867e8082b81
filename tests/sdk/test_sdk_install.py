"""The `handoff` command where only the SDK is installed (make test-sdk)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

import pytest

# The console script of the venv running the tests (the SDK's, under make test-sdk).
HANDOFF = Path(sys.executable).parent / "handoff"
SDK_ONLY = os.environ.get("HANDOFF_SDK_ONLY") == "1"


def handoff(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([HANDOFF, *args], capture_output=True, text=True, timeout=60)


def test_version_prints_the_installed_version() -> None:
    done = handoff("--version")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == f"handoff {version('kv-handoff')}"


@pytest.mark.skipif(not SDK_ONLY, reason="needs a venv without the server extra")
def test_the_server_dependencies_are_not_installed() -> None:
    for module in ("prometheus_client", "grpc_health", "grpc_reflection", "uvloop"):
        assert importlib.util.find_spec(module) is None, module


@pytest.mark.skipif(not SDK_ONLY, reason="needs a venv without the server extra")
@pytest.mark.parametrize("command", ["serve", "health", "sim", "demo"])
def test_server_commands_say_the_server_extra_is_needed(command: str) -> None:
    done = handoff(command, "--port", "1")
    assert done.returncode == 2
    assert f"handoff {command}: needs the server's dependencies" in done.stderr
    assert "pip install 'kv-handoff[server]'" in done.stderr
    assert "Traceback" not in done.stderr


@pytest.mark.skipif(not SDK_ONLY, reason="needs a venv without the server extra")
def test_help_lists_every_command() -> None:
    done = handoff("--help")
    assert done.returncode == 0, done.stderr
    for command in ("serve", "inspect", "replay", "health", "sim", "demo"):
        assert command in done.stdout
    assert "needs the server extra" in done.stdout


def test_inspect_needs_only_the_sdk(coordinator: str) -> None:
    done = handoff("inspect", "00000000-0000-0000-0000-000000000000", "--target", coordinator)
    assert done.returncode == 1
    assert "NOT_FOUND" in done.stderr
