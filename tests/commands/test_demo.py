"""Smoke tests of the commands as a user runs them: `handoff demo` and `handoff sim`.

The demo's coordinator is a process of its own, killed with SIGKILL mid-run
and restarted: these tests check that it really was, and that no coordinator
process outlives the demo, whether it passes, fails or is interrupted.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from handoff_client.sim import options
from handoff_server.commands.cli import build_parser
from handoff_server.commands.demo import DEFAULTS
from tests.support.servers import StartServer

HANDOFF = str(Path(sys.executable).with_name("handoff"))
TIMEOUT_S = 60.0
SHARDS = ("handoff-0", "handoff-1", "handoff-2")


def number(pattern: str, text: str) -> int:
    match = re.search(pattern, text)
    assert match is not None, f"{pattern!r} not in:\n{text}"
    return int(match.group(1))


def alive(pid: int) -> bool:
    """Whether any process, a zombie included, has this pid."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def coordinator_pid(first_line: str) -> int:
    return number(r"^coordinator pid (\d+) on 127\.0\.0\.1:\d+", first_line)


def demo(*flags: str, tmp: Path, timeout_s: float = TIMEOUT_S) -> subprocess.CompletedProcess[str]:
    """``handoff demo`` as a user runs it; its temporary directory under ``tmp``."""
    return subprocess.run(
        [HANDOFF, "demo", *flags],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        check=False,
        env={**os.environ, "TMPDIR": str(tmp)},
    )


def test_a_short_demo_ends_with_a_clean_summary(tmp_path: Path) -> None:
    log = tmp_path / "demo.log"
    done = demo(
        *("--duration", "3", "--rate", "30", "--time-scale", "0.5"),
        *("--handoff-timeout", "5", "--seed", "5", "--log-file", str(log)),
        tmp=tmp_path,
    )
    out = done.stdout
    assert done.returncode == 0, out + done.stderr
    # Not a terminal: progress comes as whole lines, never redrawn in place.
    assert "\r" not in out
    first = out.splitlines()[0]
    assert first.endswith("simulated engines, sidecars on Connect")  # the default
    assert re.search(r"^\[[#-]+\]\s+\d+%.* load +\d+ started, \d+ in flight", out, re.MULTILINE)
    assert "leaked: 0 blocks" in out
    assert "stuck: 0" in out
    assert "PASS: every handoff finished" in out
    # The demo's faults include an engine restarting under its id and hung handlers.
    assert re.search(r"restarted: \S+-\d, stuck handlers: [1-9]\d* on \S+", out)
    assert re.search(r"engines lost: restarted \d+, unreachable \d+", out)
    assert re.search(r"latency p50/p95/p99: \S+ m?s / \S+ m?s / \S+ m?s", out)
    # The coordinator crash, on by default: the first process was killed mid-run, a
    # second one recovered the handoffs from its journal, and neither outlives the demo.
    first_pid = coordinator_pid(first)
    crash = re.search(
        r"coordinator: killed 1x with \d+ handoffs in flight, restarted in \S+ m?s, "
        r"recovered (\d+) handoffs in \S+ m?s "
        r"\(kill -9 of pid (\d+); now pid (\d+)\)",
        out,
    )
    assert crash is not None, out
    recovered, killed, restarted = (int(g) for g in crash.groups())
    assert killed == first_pid != restarted
    assert recovered > 0
    assert not alive(killed)
    assert not alive(restarted)
    assert "summed over 2 coordinator processes" in out
    # The server started exactly the handoffs the simulator did: the restarted
    # process recovered those started before the kill, and counted the rest.
    started = number(r"handoffs: (\d+) started", out)
    assert started == number(r"\n\s+started: (\d+) \((\d+) recovered", out) > recovered
    assert f"logs: {log}" in out
    # A PASS leaves no temporary directory behind (state dir and coordinator log).
    assert list(tmp_path.glob("handoff-demo-*")) == []


def test_a_failed_demo_keeps_the_coordinators_log_and_leaves_no_process(tmp_path: Path) -> None:
    # Decodes 20x slower than the settling allows: the leak check finds blocks
    # still held, and the demo fails.
    done = demo(
        *("--duration", "1", "--rate", "20", "--prompt-median", "16", "--time-scale", "20"),
        *("--handoff-timeout", "1", "--settle-timeout", "1.5", "--no-faults", "--seed", "2"),
        tmp=tmp_path,
    )
    out = done.stdout
    assert done.returncode == 1, out + done.stderr
    assert "FAIL:" in out
    assert "killed: none" in out
    assert "coordinator: killed" not in out  # --no-faults: no crash either
    (directory,) = tmp_path.glob("handoff-demo-*")
    assert f"coordinator log and state dir kept in {directory}\n" in out
    assert "serving gRPC" in (directory / "coordinator-0.log").read_text()
    assert not alive(coordinator_pid(out.splitlines()[0]))


def _default_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.mark.parametrize(("signum", "code"), [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_an_interrupted_demo_stops_its_coordinator(
    tmp_path: Path, signum: signal.Signals, code: int
) -> None:
    process = subprocess.Popen(
        [HANDOFF, "demo", "--duration", "30", "--seed", "1"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "TMPDIR": str(tmp_path)},
        # A suite started in the background of a script inherits SIGINT
        # ignored, and so would the demo: it must see Ctrl-C as a terminal sends it.
        preexec_fn=_default_sigint,
    )
    try:
        assert process.stdout is not None
        first = process.stdout.readline()  # printed once the coordinator serves
        pid = coordinator_pid(first)
        assert alive(pid)
        process.send_signal(signum)  # to the demo alone, not its process group
        _, err = process.communicate(timeout=TIMEOUT_S)
    finally:
        process.kill()
        process.wait()
    assert process.returncode == code, err
    assert "the coordinator is stopped" in err
    assert not alive(pid)


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


def test_only_the_demo_can_crash_its_coordinator(capsys: pytest.CaptureFixture[str]) -> None:
    parser = build_parser()

    def crashes(*argv: str) -> int:
        args = parser.parse_args(["demo", *argv])
        return options.config_from(args, DEFAULTS).faults.coordinator_crashes

    assert crashes() == 1  # on by default
    assert crashes("--coordinator-crashes", "2") == 2
    assert crashes("--coordinator-crashes", "2", "--no-faults") == 0
    # `handoff sim` runs against a coordinator it does not own: no such flag.
    with pytest.raises(SystemExit):
        parser.parse_args(["sim", "--target", "127.0.0.1:1", "--coordinator-crashes", "1"])
    assert "--coordinator-crashes" in capsys.readouterr().err


def test_a_three_shard_demo_crashes_one_shard_and_loses_nothing(tmp_path: Path) -> None:
    done = demo(
        *("--shards", "3", "--duration", "3", "--rate", "30", "--time-scale", "0.5"),
        *("--handoff-timeout", "5", "--seed", "5"),
        tmp=tmp_path,
        timeout_s=2 * TIMEOUT_S,  # three coordinators start on a busy machine
    )
    out = done.stdout
    assert done.returncode == 0, out + done.stderr
    lines = out.splitlines()
    pids = {
        name: number(rf"^shard {name}: coordinator pid (\d+) on 127\.0\.0\.1:\d+", line)
        for name, line in zip(SHARDS, lines, strict=False)
    }
    assert lines[3].endswith("sidecars on Connect, each connected to all 3 shards")
    assert "leaked: 0 blocks" in out
    assert "stuck: 0" in out
    assert "PASS: every handoff finished" in out
    # Every shard started handoffs (the frontend routed each to its owner), and
    # none was refused as misrouted.
    per_shard = re.search(
        r"shards: handoff-0 (\d+), handoff-1 (\d+) \(killed and restarted\), "
        r"handoff-2 (\d+) handoffs started",
        out,
    )
    assert per_shard is not None, out
    counts = [int(n) for n in per_shard.groups()]
    assert min(counts) > 0
    assert sum(counts) == number(r"handoffs: (\d+) started", out)
    assert "misrouted starts: 0" in out
    # The second shard, and it alone, was killed with -9 and came back.
    crash = re.search(
        r"coordinator: shard handoff-1 killed 1x with \d+ handoffs in flight, restarted in "
        r"\S+ m?s, recovered (\d+) handoffs in \S+ m?s \(kill -9 of pid (\d+); now pid (\d+)\)",
        out,
    )
    assert crash is not None, out
    recovered, killed, restarted = (int(g) for g in crash.groups())
    assert killed == pids["handoff-1"] != restarted
    assert recovered > 0
    assert "3 shards, counters summed over 4 coordinator processes" in out
    # The servers started exactly what the frontend did, shard by shard.
    started = re.search(
        r"\n\s+started: (\d+) \(by shard: handoff-0 (\d+), handoff-1 (\d+) \(\d+ recovered.*?"
        r"handoff-2 (\d+)\)",
        out,
    )
    assert started is not None, out
    assert [int(n) for n in started.groups()] == [sum(counts), *counts]
    # No coordinator process outlives the demo, the restarted one included.
    for pid in (*pids.values(), restarted):
        assert not alive(pid)
    assert list(tmp_path.glob("handoff-demo-*")) == []
