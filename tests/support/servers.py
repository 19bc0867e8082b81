"""Real servers in the test's own process, on free loopback ports."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest

from handoff_server.ops.config import Settings
from handoff_server.service import app
from handoff_server.service.app import Server
from handoff_server.service.guard import EngineStreams

StartServer = Callable[..., Awaitable[Server]]


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


# Let a channel whose server was down try again soon (gRPC's default waits 1 s).
FAST_RECONNECT = (("grpc.initial_reconnect_backoff_ms", 50), ("grpc.max_reconnect_backoff_ms", 200))
