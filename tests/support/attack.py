"""A real `handoff serve` process to attack, and a well-behaved client beside the attacker.

Every attack test starts the server as its own process (so its RSS, read
from /proc, is the server's alone, and a blocked event loop there cannot
stall the test), runs a :class:`WellBehaved` frontend with its two engines
while the attack lasts, and then checks that those handoffs kept completing.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import importlib
import multiprocessing
import os
import signal
import subprocess
import sys
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from handoff_proto.v1 import coordinator_pb2 as pb
from handoff_proto.v1 import coordinator_pb2_grpc as pb_grpc
from tests.support.fakes import free_port
from tests.support.rpc import ACCEPTED, APPLIED, HELD, RESERVED, SCHEDULED, SUBMITTED, TRANSFERRED
from tests.support.security import Stub

R = TypeVar("R")

START_WITHIN_S = 20.0
BIND_ATTEMPTS = 3
# Each handoff of the well-behaved client must finish within this, attack or not.
HANDOFF_WITHIN_S = 5.0


def proc_status(pid: int, field: str) -> int:
    """A number from /proc/<pid>/status (VmRSS in KiB, Threads, ...)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1])
    raise AssertionError(f"no {field} for process {pid}")


def rss_mib(pid: int) -> float:
    """Resident memory of process ``pid``, in MiB, from /proc."""
    return proc_status(pid, "VmRSS") / 1024


@dataclass
class Served:
    """A running `handoff serve` process on loopback."""

    process: asyncio.subprocess.Process
    port: int
    health_port: int
    metrics_port: int
    log: Path

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    def rss_mib(self) -> float:
        return rss_mib(self.process.pid)

    def threads(self) -> int:
        return proc_status(self.process.pid, "Threads")

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")


async def _serving(served: Served) -> bool:
    """Until the health port answers SERVING (True), or the process exits (False):
    a process start announces nothing else."""
    async with grpc.aio.insecure_channel(f"127.0.0.1:{served.health_port}") as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while served.process.returncode is None:
            try:
                answer = await stub.Check(health_pb2.HealthCheckRequest(), timeout=1.0)
                if answer.status == health_pb2.HealthCheckResponse.SERVING:
                    return True
            except grpc.aio.AioRpcError:
                pass
            await asyncio.sleep(0.05)
        return False


@contextlib.asynccontextmanager
async def serving(folder: Path, *flags: str) -> AsyncIterator[Served]:
    """`handoff serve` with ``flags`` on free loopback ports; SIGTERM at exit.

    A port found free can be taken by another process before the server binds
    it (servers bind exclusively, so it then exits naming the address): such a
    start is tried again on new ports, a few times."""
    for attempt in range(1, BIND_ATTEMPTS + 1):
        served = await _start(folder, flags)
        try:
            async with asyncio.timeout(START_WITHIN_S):
                started = await _serving(served)
        except BaseException:
            await _stop(served.process)
            raise
        if started:
            break
        if " in use" not in served.log_text() or attempt == BIND_ATTEMPTS:
            raise AssertionError(f"handoff serve exited at start:\n{served.log_text()}")
    try:
        yield served
    finally:
        await _stop(served.process)


async def _start(folder: Path, flags: tuple[str, ...]) -> Served:
    port, health_port, metrics_port = free_port(), free_port(), free_port()
    log = folder / f"serve-{port}.log"
    argv = [
        *("--host", "127.0.0.1", "--port", str(port)),
        *("--health-host", "127.0.0.1", "--health-port", str(health_port)),
        *("--metrics-host", "127.0.0.1", "--metrics-port", str(metrics_port)),
        *("--drain-grace-s", "0.2"),
        *flags,
    ]
    env = {k: v for k, v in os.environ.items() if not k.startswith("HANDOFF_")}
    with log.open("wb") as sink:
        process = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "handoff_server.commands.cli",
            "serve",
            *argv,
            stdout=sink,
            stderr=sink,
            env=env,
        )
    return Served(process, port, health_port, metrics_port, log)


async def _stop(process: asyncio.subprocess.Process) -> None:
    if process.returncode is None:
        process.send_signal(signal.SIGTERM)
        try:
            async with asyncio.timeout(START_WITHIN_S):
                await process.wait()
        except TimeoutError:
            process.kill()
            await process.wait()


Metadata = tuple[tuple[str, str], ...]


def bearer(token: str) -> Metadata:
    return (("authorization", f"Bearer {token}"),)


def start_request(source: str, destination: str) -> pb.StartHandoffRequest:
    return pb.StartHandoffRequest(
        handoff_id=str(uuid.uuid4()),
        engine_type=pb.ENGINE_TYPE_VLLM,
        source_engine_id=source,
        destination_engine_id=destination,
    )


@dataclass
class WellBehaved:
    """A frontend and its two engines doing one handoff after another, to success.

    The engines hold action streams (so nothing waits for an absent engine);
    the reports go over the unary calls. ``completed`` counts handoffs that
    reached SUCCESS, ``errors`` every call that failed, by code. With ``per_s``
    it starts at most that many handoffs a second, as a frontend with that much
    work does; without, one after another as fast as the server answers.
    """

    channel: grpc.aio.Channel
    metadata: Metadata = ()
    per_s: float | None = None
    source: str = "good-prefill"
    destination: str = "good-decode"
    completed: int = 0
    errors: Counter[str] = field(default_factory=Counter)
    _progress: asyncio.Event = field(default_factory=asyncio.Event)

    async def completed_at_least(self, count: int) -> None:
        """Until ``count`` handoffs completed, or one failed (the caller then sees it)."""
        while self.completed < count and not self.errors:
            self._progress.clear()
            await self._progress.wait()

    async def run(self, until: asyncio.Event) -> None:
        stub: Stub = pb_grpc.HandoffCoordinatorStub(self.channel)
        loop = asyncio.get_running_loop()
        began, started = loop.time(), 0
        async with engine_streams(stub, (self.source, self.destination), self.metadata):
            while not until.is_set():
                if self.per_s is not None:
                    started += 1
                    # The frontend's own pace, not a wait for an event.
                    await asyncio.sleep(max(0.0, began + started / self.per_s - loop.time()))
                try:
                    async with asyncio.timeout(HANDOFF_WITHIN_S):
                        await self._one(stub)
                    self.completed += 1
                except grpc.aio.AioRpcError as error:
                    self.errors[error.code().name] += 1
                except TimeoutError:
                    self.errors["SLOWER_THAN_HANDOFF_WITHIN_S"] += 1
                self._progress.set()

    async def _one(self, stub: Stub) -> None:
        started = await stub.StartHandoff(
            start_request(self.source, self.destination), metadata=self.metadata
        )
        handoff = await finish(stub, started.handoff.handoff_id, self.metadata)
        assert handoff.completion == pb.COMPLETION_SUCCESS, handoff


# Every report of a source-first handoff from its start to SUCCESS, in order.
TO_SUCCESS: Sequence[tuple[int, pb.Outcome] | pb.Fact] = (
    (0, SUBMITTED),
    HELD,
    (1, ACCEPTED),
    RESERVED,
    (2, SCHEDULED),
    TRANSFERRED,
    (3, APPLIED),
    (4, APPLIED),
)


async def finish(stub: Stub, handoff_id: str, metadata: Metadata = ()) -> pb.Handoff:
    """Report a started handoff through to its end, as its engines would; the
    handoff as the last answer shows it."""
    handoff = pb.Handoff()
    for step in TO_SUCCESS:
        if isinstance(step, pb.Fact):
            request = pb.ReportFactRequest(handoff_id=handoff_id, fact=step)
            handoff = (await stub.ReportFact(request, metadata=metadata)).handoff
        else:
            action_id, outcome = step
            report = pb.ReportOutcomeRequest(
                handoff_id=handoff_id, action_id=action_id, outcome=outcome
            )
            handoff = (await stub.ReportOutcome(report, metadata=metadata)).handoff
    return handoff


@contextlib.asynccontextmanager
async def engine_streams(
    stub: Stub, engine_ids: Sequence[str], metadata: Metadata = ()
) -> AsyncIterator[None]:
    """An action stream held (and read) for each engine for the block's
    duration, so nothing waits for an absent engine."""
    streams = [
        stub.StreamActions(pb.StreamActionsRequest(engine_id=engine), metadata=metadata)
        for engine in engine_ids
    ]
    drains = [asyncio.create_task(_drain(stream)) for stream in streams]
    try:
        yield
    finally:
        for stream in streams:
            stream.cancel()
        await asyncio.gather(*drains, return_exceptions=True)


async def _drain(stream: grpc.aio.UnaryStreamCall[pb.StreamActionsRequest, pb.Action]) -> None:
    with contextlib.suppress(grpc.aio.AioRpcError, asyncio.CancelledError):
        async for _ in stream:
            pass


@contextlib.asynccontextmanager
async def alongside(
    channel: grpc.aio.Channel, metadata: Metadata = (), per_s: float | None = None
) -> AsyncIterator[WellBehaved]:
    """A :class:`WellBehaved` client running for the block's duration."""
    client = WellBehaved(channel, metadata, per_s)
    until = asyncio.Event()
    task = asyncio.create_task(client.run(until))
    try:
        yield client
    finally:
        until.set()
        await task


async def rate(client: WellBehaved, seconds: float) -> float:
    """The client's completed handoffs per second over the next ``seconds``."""
    loop = asyncio.get_running_loop()
    began, before = loop.time(), client.completed
    await asyncio.sleep(seconds)  # a measurement window, not a wait for an event
    return (client.completed - before) / (loop.time() - began)


async def rate_kept(
    client: WellBehaved, attack: Awaitable[R], before_s: float = 1.5
) -> tuple[R, float]:
    """The client's rate over ``before_s``, then ``attack`` awaited: its
    result, and the share of that rate the client kept while it ran."""
    before = await rate(client, before_s)
    loop = asyncio.get_running_loop()
    began, completed = loop.time(), client.completed
    result = await attack
    return result, (client.completed - completed) / (loop.time() - began) / before


async def metric(served: Served, name: str) -> float:
    """The sum of the samples of ``name`` on the server's /metrics (0 if absent)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", served.metrics_port)
    writer.write(b"GET /metrics HTTP/1.0\r\nHost: x\r\n\r\n")
    body = (await reader.read()).decode()
    writer.close()
    total = 0.0
    for line in body.splitlines():
        if line.startswith(name) and line[len(name) : len(name) + 1] in (" ", "{"):
            total += float(line.rsplit(" ", 1)[1])
    return total


def _run(attack: Callable[..., Awaitable[R]], *args: object) -> R:
    async def main() -> R:
        return await attack(*args)

    return asyncio.run(main())


def _import(module: str) -> None:
    importlib.import_module(module)


@contextlib.asynccontextmanager
async def attacker(
    module: str = "tests.service.test_security_attacks",
) -> AsyncIterator[Callable[..., Awaitable[Any]]]:
    """A process of its own to run attacks in: ``await attack(function, *args)``
    runs ``function(*args)`` there to its end and returns its result.

    An attack of thousands of calls is CPU work for the client as much as
    for the server: run in the test's own process, its calls would queue the
    well-behaved client's behind them on the test's event loop, and the
    well-behaved client would measure the attacker's client, not the server.
    The process has imported ``module`` (grpc and all) before the block
    starts, so a rate measured in the block does not pay for that. Attack
    functions are module-level, their results picklable.
    """
    context = multiprocessing.get_context("spawn")
    loop = asyncio.get_running_loop()
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=context) as pool:
        await loop.run_in_executor(pool, _import, module)

        async def attack(function: Callable[..., Awaitable[Any]], *args: object) -> Any:
            return await loop.run_in_executor(pool, _run, function, *args)

        yield attack


@contextlib.contextmanager
def small_volume(path: Path, mib: int) -> Iterator[Path]:
    """A tmpfs of ``mib`` MiB mounted at ``path`` for the block: a real file
    system, which fills (ENOSPC) and reports its free space as any volume.

    Mounting needs root (or CAP_SYS_ADMIN), as in the containers the tests
    run in; without it the test is skipped, saying so: nothing a process
    can do alone makes a volume full for another process (RLIMIT_FSIZE
    fails writes with EFBIG and leaves statvfs as it was)."""
    path.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={mib}m,mode=0755", "tmpfs", str(path)],
        capture_output=True,
        text=True,
        check=False,
    )
    if mounted.returncode != 0:
        pytest.skip(
            f"cannot mount a {mib} MiB tmpfs at {path} (needs root or CAP_SYS_ADMIN): "
            f"{mounted.stderr.strip()}"
        )
    try:
        yield path
    finally:
        subprocess.run(["umount", str(path)], check=True)


def fill(volume: Path, leave_bytes: int = 0) -> Path:
    """A file in ``volume`` that takes all its free space but ``leave_bytes``."""
    filler = volume / f"filler-{uuid.uuid4().hex[:8]}"
    usage = os.statvfs(volume)
    size = usage.f_bavail * usage.f_frsize - leave_bytes
    with filler.open("wb", buffering=0) as sink:
        if size > 0:
            os.posix_fallocate(sink.fileno(), 0, size)
        if not leave_bytes:
            # Whatever fallocate's rounding left, a page at a time, after it.
            sink.seek(0, os.SEEK_END)
            with contextlib.suppress(OSError):
                while True:
                    sink.write(b"\0" * usage.f_frsize)
    if not leave_bytes:
        assert os.statvfs(volume).f_bavail == 0, f"{volume} is not full"
    return filler
