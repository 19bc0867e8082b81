"""Fixtures for `make test-vllm`: one coordinator and one prefill/decode pair per session.

The engines start once per module (about a minute each, cold) and only the
one a test kills is restarted. Run from .venv-vllm with --confcutdir
tests/vllm, so the main suite's conftest (which imports the server) is never
loaded; the coordinator runs from the main venv (HANDOFF_COORDINATOR).
"""

from __future__ import annotations

import asyncio
import subprocess
from collections.abc import AsyncIterator, Generator, Iterator
from pathlib import Path

import httpx
import pytest
import pytest_asyncio

from handoff_client import HandoffClient
from tests.vllm.model import build
from tests.vllm.support import Coordinator, Engine, Pair, Proxy

# Every test here runs real engines: minutes, not the suite's 120 s default.
TEST_TIMEOUT_S = 600


# What ran, for a failure's report: CI shows only the test's output.
RUNNING: dict[str, Coordinator | Engine | Proxy] = {}
LOG_LINES = 60
FAILED = pytest.StashKey[bool]()


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        item.add_marker(pytest.mark.timeout(TEST_TIMEOUT_S))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    """A failed test's report carries each process's log tail and what used the CPU."""
    report = yield
    if report.failed:
        item.stash[FAILED] = True
        for name, process in RUNNING.items():
            report.sections.append(
                (f"{name} log (last {LOG_LINES} lines)", process.log_tail(LOG_LINES))
            )
        top = subprocess.run(
            ["ps", "-eo", "pid,ni,pcpu,rss,etimes,args", "--sort=-pcpu"],
            capture_output=True,
            text=True,
            check=False,
        ).stdout
        report.sections.append(("processes by CPU", "\n".join(top.splitlines()[:15])))
    return report


@pytest.fixture(autouse=True)
def fresh_after_a_failure(request: pytest.FixtureRequest) -> Iterator[None]:
    """A test that failed leaves the engines restarted: one failure, not a cascade."""
    yield
    pair = getattr(request.node, "funcargs", {}).get("pair")
    if request.node.stash.get(FAILED, False) and isinstance(pair, Pair):
        for engine in (pair.prefill, pair.decode):
            engine.kill()
            engine.start()
        asyncio.run(_ready(pair.prefill, pair.decode))


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
    RUNNING["coordinator"] = coordinator
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
    RUNNING.update(prefill=prefill, decode=decode)
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
    RUNNING["proxy"] = proxy
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
