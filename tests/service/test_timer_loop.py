"""The server's timer loop is supervised: a failure is logged and counted, the loop
goes on, and stop() still runs the whole shutdown."""

from __future__ import annotations

import asyncio
import uuid

import pytest

from handoff_server.domain.entries import StartRequest
from handoff_server.domain.model import Order
from tests.support.servers import StartServer


async def test_a_failing_timer_round_is_counted_and_the_loop_goes_on(
    start_lean_server: StartServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    server = await start_lean_server()
    registry = server.registry
    fire_due = registry.fire_due
    calls = 0
    went_on = asyncio.Event()

    def flaky() -> None:
        nonlocal calls
        calls += 1
        if calls == 1:
            raise RuntimeError("boom")
        fire_due()
        went_on.set()

    monkeypatch.setattr(registry, "fire_due", flaky)
    async with asyncio.timeout(10):
        # A deadline 0.2 s away: the loop wakes for it, fails, and tries again.
        registry.start(
            StartRequest(str(uuid.uuid4()), Order.SOURCE_FIRST, "p", "d", 5.0, timeout_s=0.2)
        )
        await went_on.wait()
        assert server.metrics.registry.get_sample_value("handoff_timer_errors_total") == 1
        await server.stop()
    assert server._timers is not None
    assert server._timers.done()
