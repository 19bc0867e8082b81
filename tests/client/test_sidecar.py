"""EngineSidecar against a real server: handlers, ordering, cache, reconnects, limits.

Every test that runs sidecars runs twice: on Connect (the default) and on the
unary RPCs plus StreamActions. Connect-only behaviour is in
tests/client/test_sidecar_connect.py.
"""

from __future__ import annotations

import asyncio
import random

import pytest

from handoff_client import (
    Action,
    ActionKind,
    Completion,
    EngineSidecar,
    EngineType,
    Facts,
    HandoffClient,
    LifecycleEventKind,
    Outcome,
    OutcomeKind,
    Phase,
    TransportKind,
)
from handoff_client.transport import make_transport
from tests.support.fakes import free_port
from tests.support.servers import FAST_RECONNECT, StartServer
from tests.support.sidecar import (
    DESTINATION,
    QUICK,
    SOURCE,
    TIMEOUT_S,
    ScriptedEngine,
    WatchedTransport,
    running,
    start,
)


@pytest.mark.parametrize("stack", [EngineType.VLLM, EngineType.SGLANG])
async def test_both_orders_run_to_success(
    client: HandoffClient, stack: EngineType, kind: TransportKind
) -> None:
    prefill, decode = ScriptedEngine(), ScriptedEngine()
    async with (
        running(client, SOURCE, prefill, transport=kind),
        running(client, DESTINATION, decode, transport=kind) as d,
    ):
        async with asyncio.timeout(TIMEOUT_S):
            handoff_id = await start(client, stack)
            await decode.notices[handoff_id].get()
            handoff = await client.get_handoff(handoff_id)
    assert handoff.completion is Completion.SUCCESS
    expected = (
        ["SOURCE_HELD", "DESTINATION_ACCEPTED", "DESTINATION_RESERVED"]
        if stack is EngineType.VLLM
        else ["DESTINATION_ACCEPTED", "DESTINATION_RESERVED", "SOURCE_HELD"]
    ) + ["DESTINATION_ACTIVATED", "SOURCE_RELEASED", "COMPLETED"]
    # Every fact was accepted first time: each followed its action's outcome.
    assert [event.kind.name for event in handoff.lifecycle] == expected
    transfer_on_decode = stack is EngineType.VLLM
    assert [a.kind for a in prefill.calls] == [ActionKind.SUBMIT_PREFILL] + (
        [] if transfer_on_decode else [ActionKind.START_TRANSFER]
    ) + [ActionKind.RELEASE_SOURCE]
    assert [a.kind for a in decode.calls] == [ActionKind.RESERVE_DESTINATION] + (
        [ActionKind.START_TRANSFER] if transfer_on_decode else []
    ) + [ActionKind.ACTIVATE_DESTINATION]
    assert d.stats.handlers_run == len(decode.calls)
    assert d.stats.reports_rejected == d.stats.handler_errors == 0


async def test_cancel_during_decode_reopens_and_cancels_the_destination(
    client: HandoffClient, kind: TransportKind
) -> None:
    prefill, decode = ScriptedEngine(), ScriptedEngine()
    async with (
        running(client, SOURCE, prefill, transport=kind),
        running(client, DESTINATION, decode, transport=kind),
    ):
        async with asyncio.timeout(TIMEOUT_S):
            handoff_id = await start(client)
            await decode.notices[handoff_id].get()
            reopened = await client.cancel(handoff_id, "user closed the tab")
            await decode.notices[handoff_id].get()
            handoff = await client.get_handoff(handoff_id)
    assert reopened.handoff.phase is Phase.CLEANING_UP
    assert decode.count(ActionKind.CANCEL_DESTINATION) == 1
    assert handoff.completion is Completion.CANCELED
    completions = [e for e in handoff.lifecycle if e.kind is LifecycleEventKind.COMPLETED]
    assert len(completions) == 2


async def test_a_redelivered_action_is_answered_from_the_cache(
    client: HandoffClient, kind: TransportKind
) -> None:
    prefill, decode = ScriptedEngine(), ScriptedEngine()
    watched = WatchedTransport(make_transport(client, kind), hold_first_outcome=True)
    async with (
        running(client, SOURCE, prefill, transport=kind),
        running(watched, DESTINATION, decode) as d,
    ):
        async with asyncio.timeout(TIMEOUT_S):
            handoff_id = await start(client)
            await watched.holding.wait()  # ReserveDestination ran; its ACCEPTED is held back
            await replace_subscription(client, DESTINATION)  # the sidecar's stream ends
            await watched.redelivered.wait()  # ... it resubscribed and got the action again
            watched.release.set()
            await decode.notices[handoff_id].get()
            handoff = await client.get_handoff(handoff_id)
    assert handoff.completion is Completion.SUCCESS
    assert decode.count(ActionKind.RESERVE_DESTINATION) == 1  # the handler ran once
    assert d.stats.answered_from_cache == 1
    assert d.stats.reconnects >= 1


async def test_a_redelivery_while_the_handler_runs_is_ignored(
    client: HandoffClient, kind: TransportKind
) -> None:
    prefill, decode = ScriptedEngine(), ScriptedEngine()
    entered, finish = asyncio.Event(), asyncio.Event()

    async def slow_reserve(action: Action, facts: Facts) -> Outcome:
        entered.set()
        await finish.wait()
        return await decode.reserved(action, facts)

    decode.overrides[ActionKind.RESERVE_DESTINATION] = slow_reserve
    watched = WatchedTransport(make_transport(client, kind))
    async with (
        running(client, SOURCE, prefill, transport=kind),
        running(watched, DESTINATION, decode) as d,
    ):
        async with asyncio.timeout(TIMEOUT_S):
            handoff_id = await start(client)
            await entered.wait()
            await replace_subscription(client, DESTINATION)
            await watched.redelivered.wait()
            finish.set()
            await decode.notices[handoff_id].get()
    assert decode.count(ActionKind.RESERVE_DESTINATION) == 1
    assert d.stats.ignored_while_running == 1
    assert d.stats.answered_from_cache == 0


async def replace_subscription(client: HandoffClient, engine_id: str) -> None:
    """Subscribe as ``engine_id`` and leave: the sidecar's stream is replaced and ends."""
    subscribed = asyncio.Event()
    intruder = client.stream_actions(engine_id, on_subscribed=subscribed.set)
    reading = asyncio.create_task(anext(intruder))
    await subscribed.wait()
    reading.cancel()
    await asyncio.gather(reading, return_exceptions=True)
    await intruder.aclose()


async def test_sidecars_reconnect_to_a_restarted_server(
    start_lean_server: StartServer, kind: TransportKind
) -> None:
    port = free_port()
    prefill, decode = ScriptedEngine(), ScriptedEngine()
    first = await start_lean_server(port=port)
    async with (
        HandoffClient(f"127.0.0.1:{port}", channel_options=FAST_RECONNECT) as client,
        running(client, SOURCE, prefill, transport=kind) as p,
        running(client, DESTINATION, decode, transport=kind) as d,
        asyncio.timeout(TIMEOUT_S),
    ):
        await first.stop()  # the streams fail; the sidecars keep trying
        await start_lean_server(port=port)
        await client.wait_ready()  # StartHandoff is never retried
        handoff_id = await start(client)  # its actions wait for the engines
        await decode.notices[handoff_id].get()
        handoff = await client.get_handoff(handoff_id)
    assert handoff.completion is Completion.SUCCESS
    assert p.stats.reconnects >= 1
    assert d.stats.reconnects >= 1


async def test_a_handler_that_raises_fails_its_action(
    client: HandoffClient, kind: TransportKind
) -> None:
    prefill, decode = ScriptedEngine(), ScriptedEngine()

    async def broken(action: Action, facts: Facts) -> Outcome:
        raise RuntimeError("CUDA error: out of memory")

    decode.overrides[ActionKind.RESERVE_DESTINATION] = broken
    async with (
        running(client, SOURCE, prefill, transport=kind),
        running(client, DESTINATION, decode, transport=kind) as d,
    ):
        async with asyncio.timeout(TIMEOUT_S):
            handoff_id = await start(client)
            await decode.notices[handoff_id].get()
            handoff = await client.get_handoff(handoff_id)
    assert handoff.completion is Completion.CANCELED
    assert d.stats.handler_errors == 1
    assert prefill.count(ActionKind.CANCEL_SOURCE) == 1
    assert decode.count(ActionKind.CANCEL_DESTINATION) == 1


async def test_a_cleanup_handler_that_raises_runs_again_on_redelivery(
    start_lean_server: StartServer, kind: TransportKind
) -> None:
    server = await start_lean_server(cleanup_redelivery_s=0.05)
    prefill, decode = ScriptedEngine(), ScriptedEngine()

    async def refused(action: Action, facts: Facts) -> Outcome:
        return Outcome.failed("prompt too long")

    async def flaky_cancel(action: Action, facts: Facts) -> Outcome:
        if prefill.count(ActionKind.CANCEL_SOURCE) == 1:
            raise RuntimeError("engine busy")
        return Outcome(OutcomeKind.APPLIED)

    prefill.overrides[ActionKind.SUBMIT_PREFILL] = refused
    prefill.overrides[ActionKind.CANCEL_SOURCE] = flaky_cancel
    async with (
        HandoffClient(f"127.0.0.1:{server.port}") as client,
        running(client, SOURCE, prefill, transport=kind) as p,
        running(client, DESTINATION, decode, transport=kind),
    ):
        async with asyncio.timeout(TIMEOUT_S):
            handoff_id = await start(client)
            await prefill.notices[handoff_id].get()
            handoff = await client.get_handoff(handoff_id)
    assert handoff.completion is Completion.CANCELED
    assert prefill.count(ActionKind.CANCEL_SOURCE) == 2  # unacknowledged, then redelivered
    assert p.stats.handler_errors == 1


@pytest.mark.parametrize("terminal", ["failed", "canceled"])
async def test_engine_reported_terminal_facts_start_cleanup(
    client: HandoffClient, terminal: str, kind: TransportKind
) -> None:
    prefill, decode = ScriptedEngine(), ScriptedEngine()

    async def reserve_then_break(action: Action, facts: Facts) -> Outcome:
        report = facts.failed if terminal == "failed" else facts.canceled
        decode.later(report(action.handoff_id, "decode engine draining"))
        return Outcome(OutcomeKind.ACCEPTED)

    decode.overrides[ActionKind.RESERVE_DESTINATION] = reserve_then_break
    async with (
        running(client, SOURCE, prefill, transport=kind),
        running(client, DESTINATION, decode, transport=kind),
    ):
        async with asyncio.timeout(TIMEOUT_S):
            handoff_id = await start(client)
            await decode.notices[handoff_id].get()
            handoff = await client.get_handoff(handoff_id)
    assert handoff.completion is Completion.CANCELED
    assert decode.count(ActionKind.CANCEL_DESTINATION) == 1


async def test_handlers_run_at_most_max_concurrency_at_once(
    client: HandoffClient, kind: TransportKind
) -> None:
    prefill, decode = ScriptedEngine(), ScriptedEngine()
    active = peak = 0
    two_in, gate = asyncio.Event(), asyncio.Event()

    async def gated_submit(action: Action, facts: Facts) -> Outcome:
        nonlocal active, peak
        active += 1
        peak = max(peak, active)
        if active == 2:
            two_in.set()
        await gate.wait()
        active -= 1
        return await prefill.held(action, facts)

    prefill.overrides[ActionKind.SUBMIT_PREFILL] = gated_submit
    watched = WatchedTransport(make_transport(client, kind))
    async with running(client, DESTINATION, decode, transport=kind), asyncio.timeout(TIMEOUT_S):
        # Started before the prefill sidecar subscribes: the four actions queue
        # on the server and arrive together.
        handoff_ids = [await start(client) for _ in range(4)]
        async with running(watched, SOURCE, prefill, max_concurrency=2):
            await two_in.wait()
            # A third action was read from the stream; a sidecar without a
            # bound would start its handler before the gate opens.
            await watched.yielded_event[(ActionKind.SUBMIT_PREFILL, 3)].wait()
            gate.set()
            for handoff_id in handoff_ids:
                await decode.notices[handoff_id].get()
    assert peak == 2
    assert prefill.count(ActionKind.SUBMIT_PREFILL) == 4


async def test_stop_cancels_handlers_still_running_after_the_grace(
    client: HandoffClient, kind: TransportKind
) -> None:
    prefill = ScriptedEngine()
    entered, cancelled = asyncio.Event(), asyncio.Event()

    async def stuck(action: Action, facts: Facts) -> Outcome:
        entered.set()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            cancelled.set()
            raise
        raise AssertionError("unreachable")

    prefill.overrides[ActionKind.SUBMIT_PREFILL] = stuck
    sidecar = EngineSidecar(client, SOURCE, prefill, stop_grace_s=0.05, transport=kind)
    sidecar.start()
    async with asyncio.timeout(TIMEOUT_S):
        await start(client)
        await entered.wait()
        await sidecar.stop()
    assert cancelled.is_set()


async def test_stop_lets_a_finishing_handler_report_within_the_grace(
    client: HandoffClient, kind: TransportKind
) -> None:
    prefill = ScriptedEngine()
    entered, finish = asyncio.Event(), asyncio.Event()

    async def slow_submit(action: Action, facts: Facts) -> Outcome:
        entered.set()
        await finish.wait()
        return Outcome(OutcomeKind.SUBMITTED)  # no SourceHeld: only the outcome matters

    prefill.overrides[ActionKind.SUBMIT_PREFILL] = slow_submit
    # A grace well below the report's deadline (TIMEOUT_S): a report that
    # cannot go out (no stream left on Connect) is cut by the grace, not sent.
    sidecar = EngineSidecar(client, SOURCE, prefill, stop_grace_s=2.0, transport=kind)
    sidecar.start()
    async with asyncio.timeout(TIMEOUT_S):
        await sidecar.wait_subscribed()
        handoff_id = await start(client)
        await entered.wait()
        finish.set()  # the handler returns during stop's grace ...
        await sidecar.stop()
        handoff = await client.get_handoff(handoff_id)
    # ... and its SUBMITTED reached the server before the sidecar unsubscribed.
    assert handoff.outstanding_actions == ()
    assert sidecar.stats.reports_rejected == 0


class CapRecorder(random.Random):
    """Records the cap of every backoff draw; ``enough`` is set at the ``wanted``-th."""

    def __init__(self, wanted: int) -> None:
        super().__init__(0)
        self.caps: list[float] = []
        self.wanted = wanted
        self.enough = asyncio.Event()

    def uniform(self, a: float, b: float) -> float:
        self.caps.append(b)
        if len(self.caps) >= self.wanted:
            self.enough.set()
        return super().uniform(a, b)


async def test_reconnect_backoff_grows_while_the_server_is_down(kind: TransportKind) -> None:
    rng = CapRecorder(wanted=4)
    async with HandoffClient(f"127.0.0.1:{free_port()}") as client:
        sidecar = EngineSidecar(
            client, SOURCE, ScriptedEngine(), reconnect_backoff=QUICK, rng=rng, transport=kind
        )
        sidecar.start()
        async with asyncio.timeout(TIMEOUT_S):
            await rng.enough.wait()
        await sidecar.stop()
    # A refused call is no subscription: the failures add up and the cap doubles.
    assert rng.caps[:4] == [0.01, 0.02, 0.04, 0.08]
    assert sidecar.stats.reconnects >= 4
