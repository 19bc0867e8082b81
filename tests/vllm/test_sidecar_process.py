"""The engine's sidecar process, without vLLM: its channel, and that it dies with the engine.

Real coordinator, real processes: tests/vllm/stub_engine.py is an engine
core with the connector's HandoffEngine and SidecarProcess and no scheduler
(its hooks come from stdin). kill -9 of it must take its sidecar process
with it, and the coordinator must see the engine lost.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path

import pytest
import pytest_asyncio

from handoff_client import Completion, EngineType, HandoffClient, LifecycleEventKind, Role
from tests.vllm.support import ROOT, Coordinator, ended, lifecycle_has, poll


@pytest.fixture(scope="module")
def quick(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Coordinator]:
    """A coordinator of its own, with a short delivery timeout: an engine lost in 2 s."""
    coordinator = Coordinator(tmp_path_factory.mktemp("quick"), delivery_timeout_s=2.0)
    coordinator.start()
    asyncio.run(coordinator.ready())
    yield coordinator
    coordinator.stop()


@pytest_asyncio.fixture
async def client(quick: Coordinator) -> AsyncIterator[HandoffClient]:
    async with HandoffClient(quick.address, timeout_s=10.0) as client:
        yield client


class Stub:
    def __init__(self, coordinator: Coordinator, engine_id: str) -> None:
        self.process = subprocess.Popen(
            [sys.executable, "-m", "tests.vllm.stub_engine", coordinator.address, engine_id],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            cwd=ROOT,
        )
        assert self.process.stdout is not None
        self.sidecar_pid = int(self.process.stdout.readline())

    def send(self, line: str) -> None:
        assert self.process.stdin is not None
        self.process.stdin.write(f"{line}\n".encode())
        self.process.stdin.flush()

    def kill(self) -> None:
        self.process.send_signal(signal.SIGKILL)
        self.process.wait()

    def stop(self) -> None:
        if self.process.poll() is None:
            assert self.process.stdin is not None
            self.process.stdin.close()
            self.process.wait(timeout=30)


def alive(pid: int) -> bool:
    """Running, not a zombie waiting to be reaped."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, IndexError):
        return False
    return state != "Z"


async def test_actions_facts_and_kill_9_cross_the_channel(
    quick: Coordinator, client: HandoffClient
) -> None:
    prefill, decode = Stub(quick, "prefill-stub"), Stub(quick, "decode-stub")
    try:
        # Its own session (so its own scheduling group), not its engine's.
        await poll("the sidecar in a session of its own", _own_session(decode.sidecar_pid), 10.0)
        assert os.getsid(decode.sidecar_pid) != os.getsid(decode.process.pid)
        handoff_id = str(uuid.uuid4())
        await client.start_handoff(
            handoff_id,
            engine_type=EngineType.VLLM,
            source_engine_id="prefill-stub",
            destination_engine_id="decode-stub",
            transfer_executor=Role.DESTINATION,
            fallback_transfer_delay_ms=1.0,
            handoff_timeout_s=60.0,
        )
        # A fact from the prefill's "scheduler", after SubmitPrefill's SUBMITTED.
        await poll(
            "SubmitPrefill answered",
            lambda: _answered(client, handoff_id),
            20.0,
        )
        prefill.send(f"held {handoff_id}")
        await poll("SOURCE_HELD", lambda: lifecycle_has(client, handoff_id, "SOURCE_HELD"), 20.0)
        # Then ReserveDestination was answered ACCEPTED from the decode's engine core.
        await poll(
            "DESTINATION_ACCEPTED",
            lambda: lifecycle_has(client, handoff_id, "DESTINATION_ACCEPTED"),
            20.0,
        )
        decode.kill()
        # The sidecar process went with its engine core, and the coordinator
        # saw the engine lost: the handoff ends CANCELED, the decode lost.
        await poll("the decode's sidecar gone", _gone(decode.sidecar_pid), 10.0)
        handoff = await ended(client, handoff_id, timeout_s=20.0)
        assert handoff.completion is Completion.CANCELED, handoff
        kinds = {event.kind for event in handoff.lifecycle}
        assert LifecycleEventKind.DESTINATION_LOST in kinds, handoff
    finally:
        decode.stop()
        prefill.stop()
    assert not alive(prefill.sidecar_pid)  # a clean stop ends it too


async def _answered(client: HandoffClient, handoff_id: str) -> bool:
    handoff = await client.get_handoff(handoff_id)
    return not any(a.kind.name == "SUBMIT_PREFILL" for a in handoff.outstanding_actions)


def _own_session(pid: int) -> Callable[[], Awaitable[bool]]:
    async def check() -> bool:
        return os.getsid(pid) == pid

    return check


def _gone(pid: int) -> Callable[[], Awaitable[bool]]:
    async def check() -> bool:
        return not alive(pid)

    return check


def test_a_sidecar_whose_engine_died_before_it_started_exits() -> None:
    """The race PR_SET_PDEATHSIG leaves: a parent already gone is checked by pid."""
    answer = subprocess.run(
        [sys.executable, "-m", "handoff_vllm.sidecar", "0", str(os.getpid() + 10**6)],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        timeout=30,
        cwd=ROOT,
    )
    assert answer.returncode == 1
