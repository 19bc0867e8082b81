"""The SDK's lease, heartbeats and reconcile against a real server, over real
sockets: a TCP proxy black-holes one engine's connection (issue 12).

The server's delivery timeout is 3 s, so the sidecars' lease is 2 s (docs/sdk.md);
the server notices a black-holed connection by its keepalive (0.5 s + 0.5 s),
then waits out the delivery timeout. Timings are generous: the tests assert
orders (the cut engine freed before the server freed the other side), not
durations.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator

from handoff_client import (
    ActionKind,
    Completion,
    EngineSidecar,
    EngineType,
    HandoffClient,
    Phase,
    Role,
    TransportKind,
)
from handoff_client.link import lease_s
from handoff_client.transport import make_transport
from tests.support.fakes import free_port
from tests.support.lease import BLOCKS, BlackHoleProxy, BlockEngine, until
from tests.support.servers import StartServer
from tests.support.sidecar import DESTINATION, QUICK, SOURCE, running, start

TIMEOUT_S = 30.0
CUT_SERVER = {
    "delivery_timeout_s": 3.0,
    "keepalive_time_s": 0.5,
    "keepalive_timeout_s": 0.5,
}


def test_the_lease_keeps_a_margin_before_the_delivery_timeout() -> None:
    assert lease_s(10.0) == 8.0  # 20 %
    assert lease_s(3.0) == 2.0  # at least 1 s
    assert lease_s(1.0) == 0.5  # never below half of a very short timeout


async def test_an_idle_stream_gets_heartbeats_that_never_reach_the_engine(
    start_lean_server: StartServer, kind: TransportKind
) -> None:
    server = await start_lean_server(heartbeat_s=0.05, delivery_timeout_s=7.0)
    engine = BlockEngine()
    async with (
        HandoffClient(f"127.0.0.1:{server.port}") as client,
        asyncio.timeout(TIMEOUT_S),
    ):
        transport = make_transport(client, kind)
        async with running(transport, SOURCE, engine) as sidecar:
            liveness = getattr(transport, "liveness")  # noqa: B009 - both built-ins have one
            assert liveness.heartbeat_s == 0.05
            assert liveness.delivery_timeout_s == 7.0
            heard = [liveness.last_heard]
            for _ in range(3):
                await until(lambda: liveness.last_heard != heard[-1])
                heard.append(liveness.last_heard)
            stats = sidecar.stats
    assert engine.calls == []
    assert stats.actions_received == 0
    assert stats.unknown_actions == 0
    assert stats.lease_expiries == 0


async def test_reconcile_frees_what_a_surviving_engine_holds_for_an_unknown_handoff(
    client: HandoffClient, kind: TransportKind
) -> None:
    """A sidecar restarted beside an engine that kept its memory, against a
    coordinator that does not know the handoff: freed, attempt 0, once."""
    engine = BlockEngine()
    orphan = (str(uuid.uuid4()), Role.SOURCE)
    engine.blocks[orphan] = BLOCKS
    engine.surviving = [orphan]
    async with asyncio.timeout(TIMEOUT_S), running(client, SOURCE, engine, transport=kind) as s:
        await until(lambda: s.stats.orphans_reclaimed == 1)
        assert s.stats.reconciles >= 1
    cancels = [a for a in engine.calls if a.kind is ActionKind.CANCEL_SOURCE]
    assert [(a.handoff_id, a.attempt) for a in cancels] == [(orphan[0], 0)]
    assert engine.held_blocks == 0
    assert engine.double_frees == 0


async def test_a_known_handoff_is_not_released_by_reconcile(
    client: HandoffClient, kind: TransportKind
) -> None:
    prefill, decode = BlockEngine(stall={Role.SOURCE}), BlockEngine()
    async with (
        asyncio.timeout(TIMEOUT_S),
        running(client, SOURCE, prefill, transport=kind) as p,
        running(client, DESTINATION, decode, transport=kind),
    ):
        handoff_id = await start(client)
        await until(lambda: prefill.held_blocks == BLOCKS)
        # A reconnect reconciles the held prefill: the handoff is active, it stays.
        reconciles = p.stats.reconciles
        await p.stop(grace_s=0)
        async with running(
            client, SOURCE, prefill, transport=kind, incarnation=p.incarnation
        ) as again:
            await until(lambda: again.stats.reconciles > 0)
            assert again.stats.orphans_reclaimed == 0
        assert reconciles >= 1
    assert prefill.held_blocks == BLOCKS
    assert (await client.get_handoff(handoff_id)).phase is Phase.ACTIVE


@contextlib.asynccontextmanager
async def cut_world(
    start_lean_server: StartServer, kind: TransportKind
) -> AsyncIterator[tuple[HandoffClient, BlackHoleProxy, EngineSidecar, EngineSidecar]]:
    """A server, a prefill connected straight to it, and a decode behind a proxy."""
    server = await start_lean_server(**CUT_SERVER)
    proxy = BlackHoleProxy(server.port)
    await proxy.start()
    prefill, decode = BlockEngine(), BlockEngine()
    try:
        async with (
            HandoffClient(f"127.0.0.1:{server.port}", timeout_s=5.0) as client,
            HandoffClient(f"127.0.0.1:{proxy.port}", timeout_s=5.0) as cut_client,
            running(client, SOURCE, prefill, transport=kind) as p,
            running(cut_client, DESTINATION, decode, transport=kind) as d,
        ):
            yield client, proxy, p, d
    finally:
        await proxy.close()


async def test_a_cut_longer_than_the_delivery_timeout_frees_the_cut_engine_first(
    start_lean_server: StartServer, kind: TransportKind
) -> None:
    async with asyncio.timeout(TIMEOUT_S), cut_world(start_lean_server, kind) as world:
        client, proxy, p, d = world
        prefill, decode = p._engine, d._engine
        assert isinstance(prefill, BlockEngine)
        assert isinstance(decode, BlockEngine)
        # One handoff succeeds first: its decode owns the request and keeps running.
        decoding = await start(client, EngineType.VLLM)
        await until(lambda: prefill.count(ActionKind.RELEASE_SOURCE) == 1)
        await until(lambda: (decoding, Role.DESTINATION) in decode.blocks)
        # Another stays reserved on the decode, the prefill holding its KV.
        decode.stall.add(Role.DESTINATION)
        reserved = await start(client, EngineType.VLLM)
        await until(lambda: (reserved, Role.DESTINATION) in decode.blocks)
        proxy.cut()
        await until(lambda: (reserved, Role.SOURCE) in prefill.freed_at)
        # The server freed the prefill's side only after the decode freed its own.
        assert (
            decode.freed_at[(reserved, Role.DESTINATION)]
            < prefill.freed_at[(reserved, Role.SOURCE)]
        )
        assert d.stats.lease_expiries >= 1
        assert d.stats.freed_on_lease == 1
        assert (decoding, Role.DESTINATION) in decode.blocks  # the activated decode runs on
        reconciles = d.stats.reconciles
        proxy.heal()
        await until(lambda: d.stats.reconciles > reconciles)
        state = await client.get_handoff(reserved)
        assert state.phase is Phase.COMPLETE
        assert state.completion is Completion.CANCELED
    decode.finish_decode(decoding)
    assert prefill.held_blocks == decode.held_blocks == 0
    assert prefill.double_frees == decode.double_frees == 0
    cancels = [a for a in decode.calls if a.kind is ActionKind.CANCEL_DESTINATION]
    assert [(a.handoff_id, a.attempt) for a in cancels] == [(reserved, 0)]


async def test_a_cut_shorter_than_the_lease_frees_nothing(
    start_lean_server: StartServer, kind: TransportKind
) -> None:
    async with asyncio.timeout(TIMEOUT_S), cut_world(start_lean_server, kind) as world:
        client, proxy, p, d = world
        prefill, decode = p._engine, d._engine
        assert isinstance(prefill, BlockEngine)
        assert isinstance(decode, BlockEngine)
        proxy.cut()
        handoff_id = await start(client, EngineType.VLLM)
        await asyncio.sleep(0.8)  # the cut lasts this long: well inside the 2 s lease
        proxy.heal()
        # The notice comes once ReleaseSource's outcome landed; the handler's
        # call alone comes before its report, which a loaded machine delays.
        await prefill.notices[handoff_id].get()
        assert prefill.count(ActionKind.RELEASE_SOURCE) == 1
        state = await client.get_handoff(handoff_id)
        assert state.completion is Completion.SUCCESS
        assert d.stats.lease_expiries == p.stats.lease_expiries == 0
    decode.finish_decode(handoff_id)
    assert prefill.held_blocks == decode.held_blocks == 0
    assert not [a for a in prefill.calls + decode.calls if a.attempt == 0]


async def test_no_lease_before_the_first_subscription() -> None:
    """A sidecar that never reached a coordinator has heard no delivery timeout:
    what its surviving engine holds stays held (nothing says it should go)."""
    engine = BlockEngine()
    side = (str(uuid.uuid4()), Role.SOURCE)
    engine.blocks[side] = BLOCKS
    engine.surviving = [side]
    async with (
        HandoffClient(f"127.0.0.1:{free_port()}", timeout_s=0.5) as nowhere,
        EngineSidecar(nowhere, SOURCE, engine, reconnect_backoff=QUICK) as sidecar,
    ):
        await until(lambda: sidecar.stats.reconnects >= 3)
        await asyncio.sleep(1.0)  # twice the shortest lease there could be
        assert sidecar.stats.lease_expiries == 0
    assert engine.blocks[side] == BLOCKS
    assert engine.calls == []
