"""The handler runner's bounds, action by action (issue 23): a scripted transport, a real sidecar.

A handler past ``handler_timeout_s`` is cancelled and its action answered
FAILED naming the timeout; a handler that ignores its cancellation past
``interrupt_grace_s`` is logged and counted, the free runs anyway, and what
it takes afterwards is freed once more (origin LATE); a made-up free that
fails is tried again; a stop for good frees what is held (origin STOP) and
leaves an activated decode alone.
"""

from __future__ import annotations

import asyncio

import pytest

from handoff_client import (
    APPLIED,
    NOOP,
    SUBMITTED,
    Action,
    ActionKind,
    Completion,
    Facts,
    Origin,
    Outcome,
    OutcomeKind,
    Role,
)
from handoff_client.model import MADE_UP_ACTION_ID
from tests.client.test_sidecar_ordering import (
    TIMEOUT_S,
    CountingEngine,
    ScriptedTransport,
    act,
    idle,
    sidecar,
)


class Stubborn(CountingEngine):
    """submit_prefill ignores its cancellation until ``let_go`` is set, then takes its blocks."""

    def __init__(self) -> None:
        super().__init__()
        self.let_go = asyncio.Event()
        self.entered_submit = asyncio.Event()
        self.cancelled = 0

    async def submit_prefill(self, action: Action, facts: Facts) -> Outcome:
        self.entered_submit.set()
        while not self.let_go.is_set():
            try:
                await self.let_go.wait()
            except asyncio.CancelledError:
                self.cancelled += 1  # and carries on, as a handler stuck in a thread would
        return await super().submit_prefill(action, facts)


@pytest.fixture
def transport() -> ScriptedTransport:
    return ScriptedTransport()


async def test_a_handler_past_its_timeout_is_cancelled_and_its_action_failed(
    transport: ScriptedTransport, caplog: pytest.LogCaptureFixture
) -> None:
    engine = CountingEngine()
    engine.gate("h")  # never set
    async with (
        sidecar(transport, engine, handler_timeout_s=0.2) as car,
        asyncio.timeout(TIMEOUT_S),
    ):
        transport.deliver(act("h", 0, ActionKind.SUBMIT_PREFILL))
        outcome = await transport.outcome("h", 0)
    assert outcome.kind is OutcomeKind.FAILED
    assert "SUBMIT_PREFILL handler timed out after 0.2 s" in outcome.reason
    assert car.stats.handler_timeouts == car.stats.handlers_interrupted == 1
    assert car.stats.handlers_unresponsive == 0
    assert "handoff h, source side, SUBMIT_PREFILL (action 0)" in caplog.text
    assert engine.blocks == 0


async def test_a_handler_that_ignores_its_cancellation_is_freed_after_once_more(
    transport: ScriptedTransport, caplog: pytest.LogCaptureFixture
) -> None:
    engine = Stubborn()
    async with (
        sidecar(transport, engine, interrupt_grace_s=0.05) as car,
        asyncio.timeout(TIMEOUT_S),
    ):
        transport.deliver(act("h", 0, ActionKind.SUBMIT_PREFILL))
        await engine.entered_submit.wait()
        transport.deliver(act("h", 1, ActionKind.CANCEL_SOURCE))
        # The free runs past the grace, without the submit (nothing held yet).
        assert await transport.outcome("h", 1) == NOOP
        assert car.stats.handlers_unresponsive == 1
        engine.let_go.set()  # it takes its blocks after all...
        assert await transport.outcome("h", 0) == SUBMITTED
        await idle(car)  # ...and they are freed once more, on the sidecar's own
    assert engine.blocks == 0
    assert engine.cancelled == 1
    assert car.stats.freed_late == 1
    late = [a for a in engine.calls if a.origin is Origin.LATE]
    assert [(a.kind, a.id, a.attempt) for a in late] == [
        (ActionKind.CANCEL_SOURCE, MADE_UP_ACTION_ID, 0)
    ]
    assert engine.double_frees == 0
    assert "ignored their cancellation" in caplog.text
    assert "handoff h, source side, CANCEL_SOURCE (action 1)" in caplog.text


class Flaky(CountingEngine):
    """cancel_source raises the first ``failures`` times."""

    def __init__(self, failures: int) -> None:
        super().__init__()
        self.failures = failures

    async def cancel_source(self, action: Action, facts: Facts) -> Outcome:
        if self.failures:
            self.failures -= 1
            raise RuntimeError("the block manager is busy")
        return await super().cancel_source(action, facts)


async def test_a_made_up_free_that_fails_is_tried_again(transport: ScriptedTransport) -> None:
    engine = Flaky(failures=2)
    async with sidecar(transport, engine) as car, asyncio.timeout(TIMEOUT_S):
        transport.deliver(act("h", 0, ActionKind.SUBMIT_PREFILL))
        assert await transport.outcome("h", 0) == SUBMITTED
        transport.deliver(act("h", 1, ActionKind.COMPLETE, completion=Completion.CANCELED))
        await engine.notified.wait()
    assert engine.blocks == 0
    assert car.stats.frees_retried == 2
    assert car.stats.freed_on_complete == 1
    origins = {a.origin for a in engine.calls if a.kind is ActionKind.CANCEL_SOURCE}
    assert origins == {Origin.COMPLETE}


async def test_a_stop_for_good_frees_what_is_held_but_an_activated_decode(
    transport: ScriptedTransport,
) -> None:
    engine = CountingEngine()
    car = sidecar(transport, engine)
    async with asyncio.timeout(TIMEOUT_S):
        car.start()
        await car.wait_subscribed()
        transport.deliver(
            act("h", 0, ActionKind.SUBMIT_PREFILL),
            act("h", 1, ActionKind.RESERVE_DESTINATION),
            act("d", 0, ActionKind.RESERVE_DESTINATION),
            act("d", 1, ActionKind.ACTIVATE_DESTINATION),
        )
        for key in [("h", 0), ("h", 1), ("d", 0), ("d", 1)]:
            await transport.outcome(*key)
        await car.stop(free_held=True)
    assert engine.held == {("d", Role.DESTINATION): CountingEngine.BLOCKS}
    stops = {(a.handoff_id, a.kind) for a in engine.calls if a.origin is Origin.STOP}
    assert stops == {("h", ActionKind.CANCEL_SOURCE), ("h", ActionKind.CANCEL_DESTINATION)}


async def test_a_cleanup_of_a_side_already_freed_is_answered_noop_unrun(
    transport: ScriptedTransport,
) -> None:
    engine = CountingEngine()
    async with sidecar(transport, engine) as car, asyncio.timeout(TIMEOUT_S):
        transport.deliver(act("h", 0, ActionKind.SUBMIT_PREFILL))
        assert await transport.outcome("h", 0) == SUBMITTED
        transport.deliver(act("h", 1, ActionKind.RELEASE_SOURCE))
        assert await transport.outcome("h", 1) == APPLIED
        transport.deliver(act("h", 2, ActionKind.CANCEL_SOURCE))
        assert await transport.outcome("h", 2) == NOOP
    assert car.stats.answered_freed == 1
    assert [a.kind for a in engine.calls] == [ActionKind.SUBMIT_PREFILL, ActionKind.RELEASE_SOURCE]
