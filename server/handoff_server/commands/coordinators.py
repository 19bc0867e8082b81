"""Coordinators as processes of their own: `handoff serve` started, killed -9, restarted.

``handoff demo`` runs its coordinator the way an operator does, as a
``handoff serve`` process with a journal in a state dir, so that it can crash
it for real (SIGKILL) and restart it on the same port and state dir. One
:class:`CoordinatorProcess` is one coordinator across its restarts;
:func:`coordinators` runs several (the shards of issue 13) and stops every
one of them however the block it guards ends.

A process is ready when its gRPC health service answers SERVING. Its first
start binds free ports (``--port 0``) and learns them from the line the
server logs once it serves; every restart binds those same ports again, as a
restarted pod keeps its Service. The processes' stderr (their log) is
appended to one file per coordinator.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import re
import sys
from collections.abc import AsyncIterator, Sequence
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from handoff_server.ops.config import Settings, env_name

HOST = "127.0.0.1"
STARTUP_TIMEOUT_S = 60.0  # a loaded 2-core machine imports grpc slowly
STOP_GRACE_S = 15.0  # SIGTERM's drain, then SIGKILL
# The line app.Server logs once it serves: where gRPC and the metrics endpoint listen.
SERVING = re.compile(rb"serving gRPC .*? on \S+:(\d+), metrics on \S+:(\d+)")


class CoordinatorError(RuntimeError):
    """A coordinator process could not start, or exited on its own."""


def serve_flags(settings: Settings) -> list[str]:
    """``handoff serve`` flags for every setting that is not its default."""
    defaults = Settings()
    return [
        f"--{field.name.replace('_', '-')}={getattr(settings, field.name)}"
        for field in dataclasses.fields(Settings)
        if getattr(settings, field.name) != getattr(defaults, field.name)
    ]


class CoordinatorProcess:
    """One coordinator: a ``handoff serve`` process on loopback, with its state dir.

    ``settings`` gives the server's timers and limits; its host, ports,
    state dir and log settings are this class's to choose.
    """

    def __init__(self, name: str, settings: Settings, directory: Path) -> None:
        self.name = name
        self.state_dir = directory / f"{name}-state"
        self.log_path = directory / f"{name}.log"
        self._settings = dataclasses.replace(
            settings,
            host=HOST,
            port=0,
            metrics_host=HOST,
            metrics_port=0,
            state_dir=str(self.state_dir),
            log_format="text",
            log_level="info",  # the serving line, and recovery's
        )
        self._process: asyncio.subprocess.Process | None = None
        self._log_copy: asyncio.Task[None] | None = None
        self.port = 0
        self.metrics_port = 0
        self.starts = 0

    @property
    def address(self) -> str:
        return f"{HOST}:{self.port}"

    @property
    def metrics_url(self) -> str:
        return f"http://{HOST}:{self.metrics_port}/metrics"

    @property
    def pid(self) -> int | None:
        """The running process's id; None when none runs."""
        process = self._process
        return process.pid if process is not None and process.returncode is None else None

    async def start(self, timeout_s: float = STARTUP_TIMEOUT_S) -> None:
        """Start ``handoff serve`` (on the ports of the previous start, if any) until it serves.

        Raises CoordinatorError, naming its log, if it exits first or is not
        serving within ``timeout_s``; no process is left running then.
        """
        if self.pid is not None:
            raise CoordinatorError(f"{self.name} runs already (pid {self.pid})")
        settings = dataclasses.replace(
            self._settings, port=self.port, metrics_port=self.metrics_port
        )
        self.starts += 1
        self.state_dir.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("ab") as log:
            log.write(f"=== {self.name}: start {self.starts}\n".encode())
        process = await asyncio.create_subprocess_exec(
            *(sys.executable, "-m", "handoff_server.commands.cli", "serve", *serve_flags(settings)),
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.PIPE,
            env=_own_environment(),
        )
        self._process = process
        serving: asyncio.Future[tuple[int, int]] = asyncio.get_running_loop().create_future()
        self._log_copy = asyncio.create_task(self._copy_log(process, serving))
        try:
            async with asyncio.timeout(timeout_s):
                self.port, self.metrics_port = await serving
                await _until_serving(self.address)
        except BaseException as error:
            if serving.done() and not serving.cancelled():
                serving.exception()  # retrieved: the error raised here says it all
            with contextlib.suppress(ProcessLookupError):
                process.kill()
            await self._reaped(process)
            if isinstance(error, TimeoutError):
                raise CoordinatorError(
                    f"{self.name} not serving within {timeout_s:.0f} s; its log: {self.log_path}"
                ) from None
            raise

    async def kill(self) -> int:
        """SIGKILL the process, as a crash or the OOM killer would; the pid it had."""
        process = self._process
        if process is None:
            raise CoordinatorError(f"{self.name} was never started")
        with contextlib.suppress(ProcessLookupError):
            process.kill()
        await self._reaped(process)
        return process.pid

    async def restart(self, timeout_s: float = STARTUP_TIMEOUT_S) -> None:
        """Kill -9, then start again on the same ports and state dir."""
        await self.kill()
        await self.start(timeout_s)

    async def stop(self, grace_s: float = STOP_GRACE_S) -> int | None:
        """SIGTERM (the server drains), SIGKILL after ``grace_s``; its exit code.

        Cancelled meanwhile, it still kills the process before it returns.
        """
        process = self._process
        if process is None:
            return None
        try:
            with contextlib.suppress(ProcessLookupError):
                process.terminate()
            try:
                async with asyncio.timeout(grace_s):
                    await process.wait()
            except TimeoutError:
                pass
        finally:
            if process.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    process.kill()
        await self._reaped(process)
        return process.returncode

    async def _reaped(self, process: asyncio.subprocess.Process) -> None:
        await process.wait()
        if self._log_copy is not None:
            await self._log_copy  # the pipe closes with the process

    async def _copy_log(
        self, process: asyncio.subprocess.Process, serving: asyncio.Future[tuple[int, int]]
    ) -> None:
        """Append the process's stderr to the log file; resolve ``serving`` from its line."""
        assert process.stderr is not None
        with self.log_path.open("ab") as log:
            async for line in process.stderr:
                log.write(line)
                log.flush()
                match = SERVING.search(line)
                if match and not serving.done():
                    serving.set_result((int(match.group(1)), int(match.group(2))))
        if not serving.done():
            serving.set_exception(
                CoordinatorError(
                    f"{self.name} exited before serving (code {await process.wait()}); "
                    f"its log: {self.log_path}"
                )
            )


@contextlib.asynccontextmanager
async def coordinators(
    settings: Sequence[Settings], directory: Path
) -> AsyncIterator[list[CoordinatorProcess]]:
    """A coordinator per ``settings`` (each shard's own), started concurrently, each
    stopped on leaving however the block ends."""
    started = [
        CoordinatorProcess(f"coordinator-{index}", each, directory)
        for index, each in enumerate(settings)
    ]
    try:
        await asyncio.gather(*(c.start() for c in started))
        yield started
    finally:
        # Shielded: a Ctrl-C that cancels the block must not leave a process behind.
        stopping = asyncio.gather(*(c.stop() for c in started), return_exceptions=True)
        try:
            await asyncio.shield(stopping)
        except asyncio.CancelledError:
            await stopping
            raise


async def _until_serving(address: str) -> None:
    """Until the gRPC health service at ``address`` answers SERVING."""
    async with grpc.aio.insecure_channel(address) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        # Watch answers the status now, then each change.
        async for change in health.Watch(health_pb2.HealthCheckRequest(), wait_for_ready=True):
            if change.status == health_pb2.HealthCheckResponse.SERVING:
                return
    raise CoordinatorError(f"{address}: the health watch ended before SERVING")


def _own_environment() -> dict[str, str]:
    """This environment without HANDOFF_* settings: the flags alone configure the process."""
    prefix = env_name("")
    return {key: value for key, value in os.environ.items() if not key.startswith(prefix)}
