"""One free per side reaches the engine, in an abort storm over real gRPC (issue 23).

When a cancel arrives while ReleaseSource is unacknowledged, the core issues
CancelSource as well (reference semantics); the sidecar must answer it NOOP
from its tombstone instead of running ``cancel_source`` after
``release_source`` freed the side. Deterministic first: every
``release_source`` is parked until the CancelSource of its handoff has been
delivered to the sidecar. Then a random storm, 20 times: each handoff is
canceled at a drawn point of its life (as a drawn handler starts), with the
frees running as they come. Whatever the order: no side freed twice, each
side that took something freed by exactly one engine call, every handoff
ends, nothing held but the decodes that own their requests.
"""

from __future__ import annotations

import asyncio
import random
import uuid
from collections import Counter, defaultdict
from collections.abc import AsyncGenerator, Callable

import pytest

from handoff_client import (
    Action,
    ActionKind,
    EngineSidecar,
    EngineType,
    Fact,
    Facts,
    HandoffClient,
    Outcome,
    Phase,
    Role,
    SidecarTransport,
)
from tests.support.lease import BlockEngine, Side, until
from tests.support.servers import FAST_RECONNECT, StartServer
from tests.support.sidecar import DESTINATION, QUICK, SOURCE

STORM = 200
RANDOM_STORM, RANDOM_RUNS = 40, 20
TIMEOUT_S = 60.0
CLEANUPS = {ActionKind.RELEASE_SOURCE, ActionKind.CANCEL_SOURCE, ActionKind.CANCEL_DESTINATION}


class Deliveries:
    """A transport wrapper that sets an event per (handoff, kind) as each action
    is handed to the sidecar."""

    def __init__(self) -> None:
        self.seen: defaultdict[tuple[str, ActionKind], asyncio.Event] = defaultdict(asyncio.Event)

    def wrap(self, name: str, inner: SidecarTransport) -> SidecarTransport:
        return _Watched(inner, self)


class _Watched:
    def __init__(self, inner: SidecarTransport, deliveries: Deliveries) -> None:
        self._inner = inner
        self._deliveries = deliveries

    def subscribe(
        self,
        engine_id: str,
        on_subscribed: Callable[[], None],
        *,
        incarnation: str,
        session_id: str,
    ) -> AsyncGenerator[Action, None]:
        inner = self._inner.subscribe(
            engine_id, on_subscribed, incarnation=incarnation, session_id=session_id
        )
        return self._watch(inner)

    async def _watch(self, inner: AsyncGenerator[Action, None]) -> AsyncGenerator[Action, None]:
        async for action in inner:
            yield action
            # After the yield: the sidecar has dispatched it.
            self._deliveries.seen[(action.handoff_id, action.kind)].set()

    async def report_fact(self, handoff_id: str, fact: Fact) -> None:
        await self._inner.report_fact(handoff_id, fact)

    async def report_outcome(self, handoff_id: str, action_id: int, outcome: Outcome) -> None:
        await self._inner.report_outcome(handoff_id, action_id, outcome)


class StormEngine(BlockEngine):
    """Counts every cleanup call per side; ``on_enter`` is told as each handler starts;
    ``park_release`` holds each release until that handoff's CancelSource was delivered."""

    def __init__(self, deliveries: Deliveries, *, park_release: bool = False) -> None:
        super().__init__()
        self.cleanup_calls: Counter[Side] = Counter()
        self.deliveries = deliveries
        self.park_release = park_release
        self.on_enter: Callable[[Action], None] = lambda action: None
        self.activated: set[str] = set()

    async def _enter(self, action: Action) -> None:
        self.on_enter(action)
        if action.kind in CLEANUPS:
            self.cleanup_calls[(action.handoff_id, action.target)] += 1
        if self.park_release and action.kind is ActionKind.RELEASE_SOURCE:
            await self.deliveries.seen[(action.handoff_id, ActionKind.CANCEL_SOURCE)].wait()

    async def submit_prefill(self, action: Action, facts: Facts) -> Outcome:
        await self._enter(action)
        return await super().submit_prefill(action, facts)

    async def reserve_destination(self, action: Action, facts: Facts) -> Outcome:
        await self._enter(action)
        return await super().reserve_destination(action, facts)

    async def start_transfer(self, action: Action, facts: Facts) -> Outcome:
        await self._enter(action)
        return await super().start_transfer(action, facts)

    async def activate_destination(self, action: Action, facts: Facts) -> Outcome:
        await self._enter(action)
        self.activated.add(action.handoff_id)
        return await super().activate_destination(action, facts)

    async def release_source(self, action: Action, facts: Facts) -> Outcome:
        await self._enter(action)
        return await super().release_source(action, facts)

    async def cancel_source(self, action: Action, facts: Facts) -> Outcome:
        await self._enter(action)
        return await super().cancel_source(action, facts)

    async def cancel_destination(self, action: Action, facts: Facts) -> Outcome:
        await self._enter(action)
        return await super().cancel_destination(action, facts)


async def start(client: HandoffClient) -> str:
    handoff_id = str(uuid.uuid4())
    await client.start_handoff(
        handoff_id,
        engine_type=EngineType.VLLM,
        source_engine_id=SOURCE,
        destination_engine_id=DESTINATION,
        transfer_executor=Role.DESTINATION,
    )
    return handoff_id


async def ended(client: HandoffClient, handoffs: list[str]) -> None:
    """Until the server says every handoff is over (its state has no event to await)."""
    for handoff_id in handoffs:
        while (await client.get_handoff(handoff_id)).phase is not Phase.COMPLETE:  # noqa: ASYNC110
            await asyncio.sleep(0.02)


def check(prefill: StormEngine, decode: StormEngine, handoffs: list[str]) -> None:
    assert prefill.double_frees == decode.double_frees == 0
    for engine, role in ((prefill, Role.SOURCE), (decode, Role.DESTINATION)):
        for handoff_id in handoffs:
            side = (handoff_id, role)
            calls = engine.cleanup_calls[side]
            assert calls <= 1, (side, calls)
            if side in engine.freed_at:
                assert calls == 1, (side, calls)
    left = {h for h, _ in decode.blocks}
    assert not prefill.blocks
    assert left <= decode.activated  # a decode that owns its request runs on


def cancel_soon(client: HandoffClient, handoff_id: str, tasks: set[asyncio.Task[None]]) -> None:
    """Cancel ``handoff_id`` in a task of its own: a handler must not wait for it."""

    async def cancel() -> None:
        await client.cancel(handoff_id, "abort storm")

    task = asyncio.create_task(cancel())
    tasks.add(task)
    task.add_done_callback(tasks.discard)


async def test_an_abort_storm_while_releases_are_in_flight_frees_each_side_once(
    start_lean_server: StartServer,
) -> None:
    server = await start_lean_server()
    deliveries = Deliveries()
    prefill = StormEngine(deliveries, park_release=True)
    decode = StormEngine(deliveries)
    target = f"127.0.0.1:{server.port}"
    cancels: set[asyncio.Task[None]] = set()

    def on_enter(action: Action) -> None:
        # The release is in flight (parked): cancel now, so the core issues
        # CancelSource for a side release_source is freeing.
        if action.kind is ActionKind.RELEASE_SOURCE:
            cancel_soon(client, action.handoff_id, cancels)

    prefill.on_enter = on_enter
    async with (
        asyncio.timeout(TIMEOUT_S),
        HandoffClient(target, timeout_s=10.0, channel_options=FAST_RECONNECT) as client,
        EngineSidecar(
            client, SOURCE, prefill, reconnect_backoff=QUICK, wrap_transport=deliveries.wrap
        ) as p,
        EngineSidecar(client, DESTINATION, decode, reconnect_backoff=QUICK) as d,
    ):
        await p.wait_subscribed()
        await d.wait_subscribed()
        handoffs = list(await asyncio.gather(*(start(client) for _ in range(STORM))))
        await ended(client, handoffs)
        await until(lambda: not cancels)
        assert p.stats.answered_freed == STORM  # every CancelSource: NOOP, unrun
    check(prefill, decode, handoffs)
    assert sum(n for (_, role), n in prefill.cleanup_calls.items() if role is Role.SOURCE) == STORM
    assert not any(a.kind is ActionKind.CANCEL_SOURCE for a in prefill.calls)


CANCEL_POINTS = (
    ActionKind.SUBMIT_PREFILL,
    ActionKind.RESERVE_DESTINATION,
    ActionKind.START_TRANSFER,
    ActionKind.ACTIVATE_DESTINATION,
    ActionKind.RELEASE_SOURCE,
    None,  # never canceled
)


@pytest.mark.parametrize("run", range(RANDOM_RUNS))
async def test_a_random_abort_storm_frees_each_side_once(
    start_lean_server: StartServer, run: int
) -> None:
    rng = random.Random(run)
    server = await start_lean_server()
    deliveries = Deliveries()
    prefill, decode = StormEngine(deliveries), StormEngine(deliveries)
    points: dict[str, ActionKind | None] = {}
    cancels: set[asyncio.Task[None]] = set()
    target = f"127.0.0.1:{server.port}"

    def on_enter(action: Action) -> None:
        if points.get(action.handoff_id) is action.kind:
            points[action.handoff_id] = None  # once
            cancel_soon(client, action.handoff_id, cancels)

    prefill.on_enter = decode.on_enter = on_enter
    async with (
        asyncio.timeout(TIMEOUT_S),
        HandoffClient(target, timeout_s=10.0, channel_options=FAST_RECONNECT) as client,
        EngineSidecar(client, SOURCE, prefill, reconnect_backoff=QUICK) as p,
        EngineSidecar(client, DESTINATION, decode, reconnect_backoff=QUICK) as d,
    ):
        await p.wait_subscribed()
        await d.wait_subscribed()
        ids = [str(uuid.uuid4()) for _ in range(RANDOM_STORM)]
        for handoff_id in ids:
            points[handoff_id] = rng.choice(CANCEL_POINTS)
        starts = [
            client.start_handoff(
                h,
                engine_type=EngineType.VLLM,
                source_engine_id=SOURCE,
                destination_engine_id=DESTINATION,
                transfer_executor=Role.DESTINATION,
            )
            for h in ids
        ]
        await asyncio.gather(*starts)
        await ended(client, ids)
        await until(lambda: not cancels)
        await ended(client, ids)  # a cancel after success reopens; it ends again
    check(prefill, decode, ids)
