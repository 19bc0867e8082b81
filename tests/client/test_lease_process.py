"""The lease and reconcile against a real `handoff serve` killed with -9 (issue 12).

SDK sidecars run KV-counting engines (tests/support/lease.py): a few
handoffs succeed first (their decodes own the requests and keep running), the
rest are left holding on both engines (the decode never reports its
reservation). Then the server is killed with -9. Every held side must be
freed by the sidecars' leases, before the server's delivery timeout would
have run out, without touching the running decodes; nothing leaks, nothing
is freed twice. Restarted without a journal, the server is told what was
freed; restarted on its journal, it reports those sides lost at once and
every handoff ends CANCELED without waiting for its deadline.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import subprocess
import time
from collections.abc import AsyncIterator
from pathlib import Path

from handoff_client import (
    Completion,
    EngineSidecar,
    EngineType,
    HandoffClient,
    Phase,
    Role,
    TransportKind,
)
from tests.support.fakes import free_port
from tests.support.lease import BlockEngine, until
from tests.support.processes import serve_process
from tests.support.servers import FAST_RECONNECT
from tests.support.sidecar import DESTINATION, QUICK, SOURCE, start

DELIVERY_TIMEOUT_S = 3.0  # the lease is 2 s
HELD, DECODING = 20, 3
TIMEOUT_S = 60.0


def serve(port: int, log: Path, state_dir: Path | None) -> subprocess.Popen[bytes]:
    journal = ["--state-dir", str(state_dir)] if state_dir is not None else []
    return serve_process(port, log, "--delivery-timeout-s", str(DELIVERY_TIMEOUT_S), *journal)


def kill(server: subprocess.Popen[bytes]) -> None:
    if server.poll() is None:
        server.send_signal(signal.SIGKILL)
        server.wait()


class Fleet:
    """A prefill and a decode: their sidecars and their KV-counting engines."""

    def __init__(
        self, p: EngineSidecar, d: EngineSidecar, prefill: BlockEngine, decode: BlockEngine
    ) -> None:
        self.p, self.d = p, d
        self.prefill, self.decode = prefill, decode

    @property
    def engines(self) -> tuple[BlockEngine, BlockEngine]:
        return self.prefill, self.decode


@contextlib.asynccontextmanager
async def fleet(port: int, kind: TransportKind) -> AsyncIterator[tuple[HandoffClient, Fleet]]:
    prefill, decode = BlockEngine(), BlockEngine()
    target = f"127.0.0.1:{port}"
    async with (
        HandoffClient(target, timeout_s=5.0, channel_options=FAST_RECONNECT) as client,
        EngineSidecar(client, SOURCE, prefill, transport=kind, reconnect_backoff=QUICK) as p,
        EngineSidecar(client, DESTINATION, decode, transport=kind, reconnect_backoff=QUICK) as d,
    ):
        world = Fleet(p, d, prefill, decode)
        await p.wait_subscribed()
        await d.wait_subscribed()
        yield client, world


async def hold(client: HandoffClient, world: Fleet) -> tuple[list[str], list[str]]:
    """DECODING handoffs that succeed, then HELD ones left holding on both engines."""
    prefill, decode = world.engines
    decoding = [await start(client, EngineType.VLLM) for _ in range(DECODING)]
    await until(lambda: len(prefill.freed_at) == DECODING)  # released after success
    decode.stall.add(Role.DESTINATION)
    held = [await start(client, EngineType.VLLM) for _ in range(HELD)]
    await until(lambda: all((h, Role.DESTINATION) in decode.blocks for h in held))
    await until(lambda: all((h, Role.SOURCE) in prefill.blocks for h in held))
    return decoding, held


async def leases_fire(world: Fleet, held: list[str], killed_at: float) -> None:
    prefill, decode = world.engines
    sides = [(prefill, (h, Role.SOURCE)) for h in held] + [
        (decode, (h, Role.DESTINATION)) for h in held
    ]
    await until(lambda: all(side in engine.freed_at for engine, side in sides))
    # Within the lease of the last sign of life (before the kill), plus the
    # handlers' time: well before the server's own delivery timeout would end.
    latest = max(engine.freed_at[side] for engine, side in sides)
    assert latest - killed_at < DELIVERY_TIMEOUT_S
    # A lease counts what it freed once its last cancel handler has returned,
    # a moment after that handler recorded the free.
    await until(lambda: min(world.p.stats.freed_on_lease, world.d.stats.freed_on_lease) >= HELD)
    assert world.p.stats.freed_on_lease == world.d.stats.freed_on_lease == HELD


def settle(world: Fleet, decoding: list[str]) -> None:
    prefill, decode = world.engines
    assert all((h, Role.DESTINATION) in decode.blocks for h in decoding)  # decodes ran on
    for h in decoding:
        decode.finish_decode(h)
    assert prefill.held_blocks == decode.held_blocks == 0
    assert prefill.double_frees == decode.double_frees == 0


async def test_kill_9_without_a_journal_every_held_block_is_freed_within_the_lease(
    tmp_path: Path,
) -> None:
    port = free_port()
    server = serve(port, tmp_path / "serve.log", None)
    try:
        async with asyncio.timeout(TIMEOUT_S), fleet(port, "connect") as (client, world):
            decoding, held = await hold(client, world)
            kill(server)
            await leases_fire(world, held, time.monotonic())
            assert world.p.stats.freed_unreported == world.d.stats.freed_unreported == HELD
            reconciles = world.p.stats.reconciles, world.d.stats.reconciles
            server = serve(port, tmp_path / "serve.log", None)  # empty
            await until(lambda: world.p.stats.reconciles > reconciles[0])
            await until(lambda: world.d.stats.reconciles > reconciles[1])
            # The new coordinator was told what was freed (it knew none of it).
            assert world.p.stats.freed_unreported == world.d.stats.freed_unreported == 0
            assert world.p.stats.orphans_reclaimed == world.d.stats.orphans_reclaimed == 0
        settle(world, decoding)
    finally:
        kill(server)


async def test_a_coordinator_recovered_after_the_leases_fired_ends_those_handoffs_at_once(
    tmp_path: Path,
) -> None:
    port, state_dir = free_port(), tmp_path / "state"
    server = serve(port, tmp_path / "serve.log", state_dir)
    try:
        async with asyncio.timeout(TIMEOUT_S), fleet(port, "unary") as (client, world):
            decoding, held = await hold(client, world)
            kill(server)
            await leases_fire(world, held, time.monotonic())
            server = serve(port, tmp_path / "serve.log", state_dir)
            restarted = time.monotonic()
            await client.wait_ready()
            for h in held:
                state = await client.get_handoff(h)
                while state.phase is not Phase.COMPLETE:
                    await asyncio.sleep(0.05)
                    state = await client.get_handoff(h)
                assert state.completion is Completion.CANCELED
            # Reported lost as the sidecars reconciled: no deadline (600 s) and
            # no delivery timeout was waited out.
            assert time.monotonic() - restarted < DELIVERY_TIMEOUT_S + 5.0
            for h in decoding:
                assert (await client.get_handoff(h)).completion is Completion.SUCCESS
            assert world.p.stats.freed_unreported == world.d.stats.freed_unreported == 0
        settle(world, decoding)
    finally:
        kill(server)
