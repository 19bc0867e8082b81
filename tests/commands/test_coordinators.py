"""Coordinator processes (handoff_server.commands.coordinators): real `handoff serve` processes,
started until they serve, killed with SIGKILL, restarted on the same port and state dir."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import uuid
from pathlib import Path

import pytest

from handoff_client import EngineType, HandoffClient, Phase
from handoff_client.errors import UnavailableError
from handoff_client.retry import RetryPolicy
from handoff_client.sim.scrape import scrape
from handoff_server.commands.coordinators import (
    CoordinatorError,
    CoordinatorProcess,
    coordinators,
    serve_flags,
)
from handoff_server.ops.config import Settings

pytestmark = pytest.mark.timeout(120)
SETTINGS = Settings(drain_grace_s=0.5)
ONCE = RetryPolicy(max_attempts=1)


def alive(pid: int) -> bool:
    """Whether a process (not yet reaped) has this pid."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


async def start_one(client: HandoffClient) -> str:
    handoff_id = str(uuid.uuid4())
    await client.start_handoff(
        handoff_id,
        engine_type=EngineType.VLLM,
        source_engine_id="prefill-0",
        destination_engine_id="decode-0",
        fallback_transfer_delay_ms=1.0,
    )
    return handoff_id


def test_the_flags_are_the_settings_that_differ_from_the_defaults() -> None:
    flags = serve_flags(Settings(delivery_timeout_s=2.0, port=0))
    assert sorted(flags) == ["--delivery-timeout-s=2.0", "--port=0"]
    assert serve_flags(Settings()) == []


async def test_start_kill_9_and_restart_on_the_same_port_and_state(tmp_path: Path) -> None:
    coordinator = CoordinatorProcess("c", SETTINGS, tmp_path)
    await coordinator.start()
    try:
        first_pid, port = coordinator.pid, coordinator.port
        assert first_pid is not None
        assert port > 0
        assert coordinator.address == f"127.0.0.1:{port}"
        # Ready means serving: the first call is answered, without waiting for a connection.
        async with HandoffClient(coordinator.address, retry=ONCE) as client:
            handoff_id = await start_one(client)
        before = await scrape(coordinator.metrics_url)
        assert before.latest("handoff_started_total") == 1

        assert await coordinator.kill() == first_pid
        assert not alive(first_pid)
        assert coordinator.pid is None
        async with HandoffClient(coordinator.address, retry=ONCE, timeout_s=2) as client:
            with pytest.raises(UnavailableError):
                await client.get_handoff(handoff_id)

        await coordinator.start()
        assert coordinator.pid not in (None, first_pid)
        assert coordinator.port == port
        async with HandoffClient(coordinator.address, retry=ONCE) as client:
            handoff = await client.get_handoff(handoff_id)
        assert handoff.phase is Phase.ACTIVE  # recovered from the state dir
        after = await scrape(coordinator.metrics_url)
        assert after.latest("handoff_recovered_handoffs") == 1
        assert after.latest("handoff_started_total") == 0  # a new process counts anew
        assert after.after([before]).total("handoff_started_total") == 1
    finally:
        code = await coordinator.stop()
    assert code == 0  # SIGTERM: drained and exited cleanly
    log = coordinator.log_path.read_text()
    assert log.count("serving gRPC") == 2
    assert "recovered 1 handoffs" in log


async def test_restart_is_kill_then_start(tmp_path: Path) -> None:
    coordinator = CoordinatorProcess("c", SETTINGS, tmp_path)
    await coordinator.start()
    try:
        old = coordinator.pid
        assert old is not None
        await coordinator.restart()
        assert not alive(old)
        assert coordinator.pid not in (None, old)
        assert coordinator.starts == 2
    finally:
        await coordinator.stop()


async def test_a_process_that_exits_before_serving_is_an_error_naming_its_log(
    tmp_path: Path,
) -> None:
    # Two processes cannot open one state dir: the second exits at once.
    first = CoordinatorProcess("same", SETTINGS, tmp_path)
    second = CoordinatorProcess("same", SETTINGS, tmp_path)
    await first.start()
    try:
        with pytest.raises(CoordinatorError, match=r"exited before serving \(code 2\)") as caught:
            await second.start()
        assert str(second.log_path) in str(caught.value)
        assert second.pid is None
    finally:
        await first.stop()


async def test_several_are_all_stopped_when_the_block_is_cancelled(tmp_path: Path) -> None:
    pids: list[int] = []
    running = asyncio.Event()

    async def block() -> None:
        async with coordinators([SETTINGS, SETTINGS], tmp_path) as group:
            assert len({c.port for c in group}) == 2
            pids.extend(c.pid for c in group if c.pid is not None)
            running.set()
            await asyncio.Event().wait()  # until cancelled, as by Ctrl-C

    task = asyncio.create_task(block())
    await running.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert len(pids) == 2
    assert not any(alive(pid) for pid in pids)


async def test_a_stop_that_outlasts_its_grace_kills(tmp_path: Path) -> None:
    coordinator = CoordinatorProcess("c", SETTINGS, tmp_path)
    await coordinator.start()
    pid = coordinator.pid
    assert pid is not None
    os.kill(pid, signal.SIGSTOP)  # a process that ignores SIGTERM, for now
    code = await coordinator.stop(grace_s=0.5)
    assert code == -signal.SIGKILL
    assert not alive(pid)


async def test_a_client_with_the_default_policy_rides_through_a_restart(tmp_path: Path) -> None:
    """Kill -9, restart a second later: calls made meanwhile wait and are answered."""
    coordinator = CoordinatorProcess("c", SETTINGS, tmp_path)
    await coordinator.start()
    try:
        async with HandoffClient(coordinator.address) as client:
            handoff_id = await start_one(client)
            await coordinator.kill()
            # Made while the coordinator is down: the client retries, and its
            # channel notices the restarted process within a second.
            read = asyncio.ensure_future(client.get_handoff(handoff_id))
            started = asyncio.ensure_future(start_one(client))
            await asyncio.sleep(1.0)  # the outage the calls must ride through
            assert not read.done()
            assert not started.done()
            await coordinator.start()
            assert (await read).phase is Phase.ACTIVE
            await started
    finally:
        await coordinator.stop()


async def test_a_second_coordinator_on_a_taken_port_refuses_to_start(tmp_path: Path) -> None:
    """Without SO_REUSEPORT: it would otherwise bind too and take part of the connections."""
    first = CoordinatorProcess("first", SETTINGS, tmp_path)
    await first.start()
    try:
        second = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "handoff_server.commands.cli",
            "serve",
            "--host=127.0.0.1",
            f"--port={first.port}",
            "--metrics-port=-1",
            "--health-port=-1",
            stderr=asyncio.subprocess.PIPE,
        )
        try:
            async with asyncio.timeout(60):
                _, stderr = await second.communicate()
        finally:
            if second.returncode is None:  # it bound after all: never leave it running
                second.kill()
                await second.wait()
        assert second.returncode == 1
        assert f"cannot bind gRPC on 127.0.0.1:{first.port}: in use" in stderr.decode()
        async with HandoffClient(first.address, retry=ONCE) as client:
            await start_one(client)  # the first one still serves
    finally:
        await first.stop()
