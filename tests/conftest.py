"""Fixtures: real servers on loopback ports (their helpers: tests/support/servers.py)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from handoff_client import HandoffClient, TransportKind
from handoff_client.transport import TRANSPORT_KINDS
from handoff_server.service.app import Server
from tests.support.servers import LOOPBACK, StartServer, servers
from tests.support.sidecar import TIMEOUT_S as SIDECAR_TIMEOUT_S

# Real vLLM engines: `make test-vllm`, from its own venv (tests/vllm/conftest.py).
collect_ignore = ["vllm"]


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
