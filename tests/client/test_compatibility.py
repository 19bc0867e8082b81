"""The wire between releases: 0.1.0's SDK against this server, and this SDK
against 0.1.0's server, each running a handoff to its end (issue 26: a
protocol change must leave older peers working; the wire, ``handoff.v1``,
only grows fields older peers ignore).

0.1.0 is vendored as its wheel, with its README's sidecar example
(tests/fixtures/release-0.1.0); it runs in a process of its own with the
wheel first on its path, which imports 0.1.0's packages from the wheel."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path

import grpc
import pytest

from handoff_client import Completion
from tests.sdk.test_readme_example import readme_main
from tests.support.fakes import free_port
from tests.support.servers import StartServer

RELEASE = Path(__file__).resolve().parents[1] / "fixtures" / "release-0.1.0"
WHEEL = RELEASE / "handoff-0.1.0-py3-none-any.whl"
EXAMPLE = RELEASE / "readme_example.py.txt"
TIMEOUT_S = 30.0
# The success path's lifecycle, as both releases record it.
SUCCESS_EVENTS = 6

# Runs in a process of its own: 0.1.0's packages from the wheel (checked),
# then ``code`` with sys.argv[1:] as its arguments.
FROM_WHEEL = """
import sys
wheel = sys.argv.pop(1)
sys.path.insert(0, wheel)
import handoff_client, handoff_server
for package in (handoff_client, handoff_server):
    assert package.__file__.startswith(wheel), package.__file__
"""

RUN_EXAMPLE = """
import asyncio
example = {"__name__": "readme_example"}
exec(compile(open(sys.argv[1]).read(), sys.argv[1], "exec"), example)
handoff = asyncio.run(example["main"](sys.argv[2]))
print("0.1.0 SDK:", handoff.completion.name, len(handoff.lifecycle))
"""

SERVE = """
import runpy
sys.argv[0] = "handoff"
runpy.run_module("handoff_server.cli", run_name="__main__", alter_sys=True)
"""


@pytest.mark.timeout(60)
async def test_the_0_1_0_sdk_runs_a_handoff_through_this_server(
    start_server: StartServer,
) -> None:
    server = await start_server()
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        FROM_WHEEL + RUN_EXAMPLE,
        str(WHEEL),
        str(EXAMPLE),
        f"127.0.0.1:{server.port}",
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    async with asyncio.timeout(TIMEOUT_S):
        out, err = await process.communicate()
    assert process.returncode == 0, err.decode()[-3000:]
    assert f"0.1.0 SDK: SUCCESS {SUCCESS_EVENTS}" in out.decode(), out.decode()


@pytest.mark.timeout(60)
async def test_this_sdk_runs_a_handoff_through_the_0_1_0_server(tmp_path: Path) -> None:
    port = free_port()
    log = tmp_path / "server-0.1.0.log"
    flags = ["--host", "127.0.0.1", "--port", str(port), "--metrics-port", "-1"]
    with log.open("wb") as output:
        server = await asyncio.create_subprocess_exec(
            *(sys.executable, "-c", FROM_WHEEL + SERVE, str(WHEEL), "serve"),
            *(*flags, "--drain-grace-s", "0.1"),
            stdout=output,
            stderr=subprocess.STDOUT,
        )
    try:
        target = f"127.0.0.1:{port}"
        async with asyncio.timeout(TIMEOUT_S):
            async with grpc.aio.insecure_channel(target) as channel:
                while server.returncode is None:
                    try:
                        await asyncio.wait_for(channel.channel_ready(), 0.5)
                        break
                    except TimeoutError:
                        continue
            assert server.returncode is None, log.read_text()[-3000:]
            handoff = await readme_main().main(target)
        assert handoff.completion is Completion.SUCCESS
        assert len(handoff.lifecycle) == SUCCESS_EVENTS
        assert handoff.end_reasons == ()  # 0.1.0 does not say why; nothing breaks
    finally:
        if server.returncode is None:
            server.terminate()
        await server.wait()
