"""Real processes for tests: `handoff serve` (for the tests that kill one),
benchmark runs, the Debian programs the tests run beside the service."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def serve_process(port: int, log: Path, *flags: str) -> subprocess.Popen[bytes]:
    """``handoff serve`` on loopback ``port`` in a process of its own (no metrics
    port, info logs appended to ``log``), with ``flags`` added."""
    command = [
        sys.executable,
        "-m",
        "handoff_server.commands.cli",
        "serve",
        "--port",
        str(port),
        "--host",
        "127.0.0.1",
        "--metrics-port",
        "-1",
        "--log-level",
        "info",
        *flags,
    ]
    return subprocess.Popen(command, cwd=ROOT, stdout=log.open("ab"), stderr=subprocess.STDOUT)


def bench_output(module: str, *flags: str, timeout_s: float = 110.0) -> str:
    """What ``python -m MODULE FLAGS`` (a benchmark's smoke run) printed, once
    it exited 0; its stderr's tail is the failure's message otherwise."""
    run = subprocess.run(
        [sys.executable, "-m", module, *flags],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout_s,
        check=False,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    return run.stdout


def debian_binary(command: str, package: str) -> str:
    """The path of ``command``, from Debian's ``package``: .ci/run installs it,
    so in CI a missing one fails the test; elsewhere the test is skipped."""
    binary = shutil.which(command)
    if binary is None:
        if os.environ.get("CI") == "true":
            pytest.fail(f"Debian's {package} package must be installed in CI (see .ci/run)")
        pytest.skip(f"{command} is not installed (apt-get install {package})")
    return binary
