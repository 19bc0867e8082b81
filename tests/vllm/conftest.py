"""Fixtures for `make test-vllm`: one coordinator and one prefill/decode pair per session.

The engines start once per module (about a minute each, cold) and only the
one a test kills is restarted. Run from .venv-vllm with --confcutdir
tests/vllm, so the main suite's conftest (which imports the server) is never
loaded; the coordinator runs from the main venv (HANDOFF_COORDINATOR).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import pytest
import pytest_asyncio

from handoff_client import HandoffClient
from tests.vllm.model import build
from tests.vllm.support import Coordinator, Engine, Pair, Proxy

# Every test here runs real engines: minutes, not the suite's 120 s default.
TEST_TIMEOUT_S = 600


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        item.add_marker(pytest.mark.timeout(TEST_TIMEOUT_S))


@pytest.fixture(scope="session")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build(tmp_path_factory.mktemp("model"))


@pytest.fixture(scope="session")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("vllm")


@pytest.fixture(scope="session")
def coordinator(workdir: Path) -> Iterator[Coordinator]:
    coordinator = Coordinator(workdir / "coordinator")
    coordinator.start()
    asyncio.run(coordinator.ready())
    yield coordinator
    coordinator.stop()


@pytest.fixture(scope="session")
def pair(model: Path, workdir: Path, coordinator: Coordinator) -> Iterator[Pair]:
    """prefill-0 on core 0, decode-0 on core 1, both under the coordinator."""
    prefill = Engine("prefill", model, workdir / "prefill", 0, coordinator.address, "prefill-0")
    decode = Engine("decode", model, workdir / "decode", 1, coordinator.address, "decode-0")
    prefill.start()
    decode.start()
    try:
        asyncio.run(_ready(prefill, decode))
        yield Pair(prefill, decode, coordinator)
    finally:
        prefill.stop()
        decode.stop()


@pytest.fixture(scope="session")
def proxy(workdir: Path, coordinator: Coordinator, pair: Pair) -> Iterator[Proxy]:
    """`handoff proxy` in front of the pair (restarted by a test that kills it)."""
    proxy = Proxy(workdir / "proxy", coordinator.address, pair.prefill, pair.decode)
    proxy.start()
    asyncio.run(proxy.ready())
    yield proxy
    proxy.stop()


async def _ready(*engines: Engine) -> None:
    await asyncio.gather(*(engine.ready() for engine in engines))


@pytest_asyncio.fixture
async def client(coordinator: Coordinator) -> AsyncIterator[HandoffClient]:
    async with HandoffClient(coordinator.address, timeout_s=10.0) as client:
        yield client


@pytest_asyncio.fixture
async def http() -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(timeout=httpx.Timeout(60.0)) as http:
        yield http
