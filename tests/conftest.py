"""Fixtures: real servers on loopback ports."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest

from handoff_client import HandoffClient, TransportKind
from handoff_client.transport import TRANSPORT_KINDS
from handoff_server import app
from handoff_server.app import Server
from handoff_server.config import Settings
from handoff_server.guard import EngineStreams
from tests.sidecar_support import TIMEOUT_S as SIDECAR_TIMEOUT_S

StartServer = Callable[..., Awaitable[Server]]

# Real vLLM engines: `make test-vllm`, from its own venv (tests/vllm/conftest.py).
collect_ignore = ["vllm"]


LOOPBACK: dict[str, Any] = {
    "host": "127.0.0.1",
    "port": 0,
    "metrics_host": "127.0.0.1",
    "metrics_port": 0,
    "drain_grace_s": 0.1,
}


class WatchedStreams(EngineStreams):
    """The guard's live engine streams, which a test can await the end of."""

    def __init__(self, limit: int) -> None:
        super().__init__(limit)
        self._changed = asyncio.Event()

    def release(self, engine_id: str) -> None:
        super().release(engine_id)
        self._changed.set()

    async def wait_until(self, predicate: Callable[[dict[str, int]], bool]) -> None:
        while not predicate(self.live):
            self._changed.clear()
            await self._changed.wait()


async def streams_until(server: Server, predicate: Callable[[dict[str, int]], bool]) -> None:
    """Until ``predicate(live engine streams)`` holds on a server made by ``servers``."""
    streams = server.engine_streams
    assert isinstance(streams, WatchedStreams)
    await streams.wait_until(predicate)


@contextlib.asynccontextmanager
async def servers(defaults: dict[str, Any]) -> AsyncIterator[StartServer]:
    """A starter of real servers (``defaults`` | overrides); all are stopped on exit."""
    started: list[Server] = []

    async def start(**overrides: Any) -> Server:
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(app, "EngineStreams", WatchedStreams)
            server = Server(Settings(**(defaults | overrides)))
        await server.start()
        started.append(server)
        return server

    try:
        yield start
    finally:
        for server in started:
            await server.stop()


@pytest.fixture
async def start_server() -> AsyncIterator[StartServer]:
    """Start real servers on free loopback ports; each is stopped at teardown."""
    async with servers(LOOPBACK) as start:
        yield start


@pytest.fixture
async def server(start_server: StartServer) -> Server:
    """One real server with default settings."""
    return await start_server()


# --- SDK, sidecar and simulator tests -------------------------------------------

# Let a channel whose server was down try again soon (gRPC's default waits 1 s).
FAST_RECONNECT = (("grpc.initial_reconnect_backoff_ms", 50), ("grpc.max_reconnect_backoff_ms", 200))


def free_port() -> int:
    """A loopback port nothing listens on (for a server to come later, or never)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


@pytest.fixture
async def start_lean_server() -> AsyncIterator[StartServer]:
    """Like ``start_server``, without a metrics endpoint (stopping one takes 0.5 s)."""
    async with servers(LOOPBACK | {"metrics_port": -1}) as start:
        yield start


@pytest.fixture
async def lean_server(start_lean_server: StartServer) -> Server:
    return await start_lean_server()


# --- sidecar tests ------------------------------------------------------------


@pytest.fixture(params=TRANSPORT_KINDS)
def kind(request: pytest.FixtureRequest) -> TransportKind:
    """The transport the test's sidecars use."""
    kind: TransportKind = request.param
    return kind


@pytest.fixture
async def client(lean_server: Server) -> AsyncIterator[HandoffClient]:
    """An SDK client of a lean server (no metrics endpoint)."""
    async with HandoffClient(
        f"127.0.0.1:{lean_server.port}", timeout_s=SIDECAR_TIMEOUT_S
    ) as client:
        yield client
