"""`handoff` and `handoff serve`: clear refusals, their own usage, and a second signal."""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import signal
import socket
import subprocess
import sys
import time
import uuid
from importlib.metadata import version

import pytest

from handoff_client import EngineType, HandoffClient
from handoff_server.commands.cli import DISTRIBUTION, main
from handoff_server.ops import config

SERVE = [sys.executable, "-m", "handoff_server.commands.cli", "serve"]
LINK = "tcp://10.96.0.12:50051"  # what Kubernetes sets for a Service named "handoff"


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["--version"])
    assert exited.value.code == 0
    assert capsys.readouterr().out == f"handoff {version(DISTRIBUTION)}\n"


def test_an_unknown_serve_argument_is_one_line_naming_serve(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["serve", "--bogus"])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert err == "handoff serve: unrecognized arguments: --bogus (see handoff serve --help)\n"


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (["serve", "--port", "abc"], "argument --port takes a whole number, got 'abc'"),
        (["serve", "--drain-grace-s=soon"], "argument --drain-grace-s takes a number, got 'soon'"),
        (["serve", "--require-known-engines=maybe"], "takes true or false, got 'maybe'"),
        (["serve", "--log-level=loud"], "argument --log-level: invalid choice: 'loud'"),
    ],
)
def test_a_bad_value_is_one_line_naming_the_flag_and_what_it_takes(
    capsys: pytest.CaptureFixture[str], argv: list[str], said: str
) -> None:
    with pytest.raises(SystemExit) as exited:
        main(argv)
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert err.startswith("handoff serve: ")
    assert said in err
    assert "usage:" not in err


def test_serve_help_groups_the_settings_by_topic(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    out = capsys.readouterr().out
    headings = re.findall(r"^(\S[^:\n]*):$", out, re.M)
    assert headings == ["options", *config.TOPICS.values()]
    listeners = out.partition("listeners:")[2].partition("handoffs and engines:")[0]
    for flag in ("--host", "--port", "--metrics-port", "--health-port"):
        assert flag in listeners
    assert "--state-dir" in out.partition("durability (docs/durability.md):")[2]


OFF_OR_PORT = "must be -1 (off), 0 (any free port) to 65535, got"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--port", "99999"], "port must be 0 (any free port) to 65535, got 99999"),
        (["--port", "-1"], "port must be 0 (any free port) to 65535, got -1"),
        (["--metrics-port", "-2"], f"metrics_port {OFF_OR_PORT} -2"),
        (["--metrics-port", "65536"], f"metrics_port {OFF_OR_PORT} 65536"),
        (["--health-port", "70000"], f"health_port {OFF_OR_PORT} 70000"),
    ],
)
def test_serve_refuses_a_port_out_of_range(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["serve", *argv]) == 2
    assert capsys.readouterr().err == f"handoff serve: {message}\n"


def test_a_kubernetes_service_link_in_a_setting_variable_is_ignored() -> None:
    environ = {"HANDOFF_PORT": LINK, "HANDOFF_METRICS_PORT": "9999"}
    assert config.service_links(environ) == ["HANDOFF_PORT"]
    settings = config.from_arguments(argparse.Namespace(), environ)
    assert settings.port == config.Settings().port
    assert settings.metrics_port == 9999


def read_until(process: subprocess.Popen[str], pattern: str, seen: list[str]) -> re.Match[str]:
    """Read the process's log until a line matches (readline returns '' once it exits)."""
    assert process.stderr is not None
    for line in process.stderr:
        seen.append(line)
        match = re.search(pattern, line)
        if match:
            return match
    raise AssertionError(f"no line matching {pattern!r} in:\n{''.join(seen)}")


@pytest.mark.parametrize("second", [signal.SIGINT, signal.SIGTERM])
def test_a_second_signal_during_the_drain_exits_at_once(second: signal.Signals) -> None:
    process = subprocess.Popen(
        [*SERVE, "--host=127.0.0.1", "--port=0", "--metrics-port=-1", "--drain-grace-s=20"],
        env=os.environ | {"HANDOFF_PORT": LINK},
        stderr=subprocess.PIPE,
        text=True,
    )
    seen: list[str] = []
    try:
        serving = read_until(process, r"serving gRPC .*? on 127\.0\.0\.1:(\d+), (.*)$", seen)
        assert serving.group(2) == "metrics off"
        assert any("ignoring HANDOFF_PORT" in line for line in seen)
        # A handoff whose engines never come: the drain would wait 2 x 20 s for it.
        asyncio.run(start_one(f"127.0.0.1:{serving.group(1)}"))
        process.send_signal(signal.SIGTERM)
        read_until(process, r"draining: 1 handoffs unfinished", seen)
        sent = time.monotonic()
        process.send_signal(second)
        assert process.wait(timeout=10) == 128 + second
        assert time.monotonic() - sent < 5
        assert process.stderr is not None
        rest = process.stderr.read()
        assert f"{second.name} again during the drain: exiting now, 1 handoffs unfinished" in rest
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        assert process.stderr is not None
        process.stderr.close()


async def start_one(target: str) -> None:
    async with asyncio.timeout(10), HandoffClient(target) as client:
        await client.start_handoff(
            str(uuid.uuid4()),
            engine_type=EngineType.VLLM,
            source_engine_id="prefill-0",
            destination_engine_id="decode-0",
        )


def test_a_taken_metrics_port_is_one_line_naming_the_flags() -> None:
    """It printed "Event loop is closed" and a never-awaited coroutine: the gRPC
    server already started was left to stop after the loop was gone."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = subprocess.run(
            [*SERVE, "--port=0", f"--metrics-port={port}", "--metrics-host=127.0.0.1"],
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert done.returncode == 1
    assert f"cannot bind metrics on 127.0.0.1:{port}: in use" in done.stderr
    assert "--metrics-host/--metrics-port (-1: off)" in done.stderr
    for noise in ("Traceback", "Event loop is closed", "never awaited"):
        assert noise not in done.stderr
