"""Smoke tests of the commands as a user runs them: `handoff demo` and `handoff sim`."""

from __future__ import annotations

import asyncio
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import StartServer

HANDOFF = str(Path(sys.executable).with_name("handoff"))
TIMEOUT_S = 60.0


def number(pattern: str, text: str) -> int:
    match = re.search(pattern, text)
    assert match is not None, f"{pattern!r} not in:\n{text}"
    return int(match.group(1))


def test_a_short_demo_ends_with_a_clean_summary(tmp_path: Path) -> None:
    log = tmp_path / "demo.log"
    done = subprocess.run(
        [
            *(HANDOFF, "demo", "--duration", "3", "--rate", "30", "--time-scale", "0.5"),
            *("--handoff-timeout", "5", "--seed", "5", "--log-file", str(log)),
        ],
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
        check=False,
    )
    out = done.stdout
    assert done.returncode == 0, out + done.stderr
    # Not a terminal: progress comes as whole lines, never redrawn in place.
    assert "\r" not in out
    assert out.splitlines()[0].endswith("simulated engines, sidecars on Connect")  # the default
    assert re.search(r"^\[[#-]+\]\s+\d+%.* load +\d+ started, \d+ in flight", out, re.MULTILINE)
    assert "leaked: 0 blocks" in out
    assert "stuck: 0" in out
    assert "PASS: every handoff finished" in out
    # The demo's faults include an engine restarting under its id and hung handlers.
    assert re.search(r"restarted: \S+-\d, stuck handlers: [1-9]\d* on \S+", out)
    assert re.search(r"engines lost: restarted \d+, unreachable \d+", out)
    assert re.search(r"latency p50/p95/p99: \S+ m?s / \S+ m?s / \S+ m?s", out)
    # The demo's server is fresh: it started exactly the handoffs the simulator did.
    assert number(r"handoffs: (\d+) started", out) == number(r"\n\s+started: (\d+)", out) > 0
    assert f"logs: {log}" in out


@pytest.mark.parametrize(
    ("transport", "sidecars"),
    [("connect", "sidecars on Connect"), ("unary", "sidecars on StreamActions + unary reports")],
)
async def test_sim_runs_against_a_running_server(
    start_server: StartServer, transport: str, sidecars: str
) -> None:
    server = await start_server()
    process = await asyncio.create_subprocess_exec(
        HANDOFF,
        "sim",
        "--target",
        f"127.0.0.1:{server.port}",
        "--metrics-url",
        f"http://127.0.0.1:{server.metrics_port}/metrics",
        "--transport",
        transport,
        *("--duration", "1.5", "--rate", "30", "--no-faults", "--seed", "3"),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    async with asyncio.timeout(TIMEOUT_S):
        stdout, _ = await process.communicate()
    out = stdout.decode()
    assert process.returncode == 0, out
    assert out.splitlines()[0].endswith(f"engines, {sidecars}")
    assert "leaked: 0 blocks" in out
    assert "killed: none" in out  # --no-faults
    assert number(r"handoffs: (\d+) started", out) == number(r"\n\s+started: (\d+)", out) > 0
    assert server.registry.active_count == 0
