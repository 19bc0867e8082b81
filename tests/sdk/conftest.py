"""The SDK's tests run against a coordinator in a process of its own.

`make test-sdk` runs them from a venv that has only the wheel's SDK at the
oldest grpcio/protobuf (so pytest is told --confcutdir=tests/sdk and never
loads tests/conftest.py, which imports the server); HANDOFF_COORDINATOR
then names the `handoff` command of a venv with the server. In the main
suite they run as well, with this venv's own.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator

import pytest

STARTUP_S = 30.0
SERVING = re.compile(r"serving gRPC .*? on 127\.0\.0\.1:(\d+)")


def coordinator_command() -> list[str]:
    command = os.environ.get("HANDOFF_COORDINATOR")
    return [command] if command else [sys.executable, "-m", "handoff_server.commands.cli"]


@pytest.fixture(scope="module")
def coordinator() -> Iterator[str]:
    """HOST:PORT of a real coordinator process on a free loopback port."""
    with serving() as target:
        yield target


@contextlib.contextmanager
def serving(*flags: str) -> Iterator[str]:
    """A coordinator process with ``flags`` besides the loopback ones, until exit."""
    process = subprocess.Popen(
        [
            *coordinator_command(),
            "serve",
            "--host=127.0.0.1",
            "--port=0",
            "--metrics-port=-1",
            "--drain-grace-s=0.1",
            *flags,
        ],
        stderr=subprocess.PIPE,
        text=True,
    )
    assert process.stderr is not None
    log: list[str] = []
    try:
        port = _port_from_log(process, log)
        # Keep reading, or a chatty coordinator would block on a full pipe.
        drain = threading.Thread(target=log.extend, args=(process.stderr,), daemon=True)
        drain.start()
        yield f"127.0.0.1:{port}"
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=STARTUP_S)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        process.stderr.close()


def _port_from_log(process: subprocess.Popen[str], seen: list[str]) -> int:
    """Read the coordinator's log until it says where it serves."""
    assert process.stderr is not None
    # readline blocks; the subprocess exits (and the pipe closes) if it cannot start.
    for line in process.stderr:
        seen.append(line)
        match = SERVING.search(line)
        if match:
            return int(match.group(1))
    raise RuntimeError("the coordinator exited before serving:\n" + "".join(seen))
