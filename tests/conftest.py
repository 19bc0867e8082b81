"""Fixtures: real servers on loopback ports."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest

from handoff_server.app import Server
from handoff_server.config import Settings

StartServer = Callable[..., Awaitable[Server]]


@pytest.fixture
async def start_server() -> AsyncIterator[StartServer]:
    """Start real servers on free loopback ports; each is stopped at teardown."""
    servers: list[Server] = []

    async def start(**overrides: Any) -> Server:
        settings = Settings(
            host="127.0.0.1",
            port=0,
            metrics_host="127.0.0.1",
            metrics_port=0,
            drain_grace_s=overrides.pop("drain_grace_s", 0.1),
            **overrides,
        )
        server = Server(settings)
        await server.start()
        servers.append(server)
        return server

    yield start
    for server in servers:
        await server.stop()


@pytest.fixture
async def server(start_server: StartServer) -> Server:
    """One real server with default settings."""
    return await start_server()
