"""A hung handler never keeps its side's blocks: the free interrupts it (issue 23).

Real gRPC on loopback; engines that count every KV block and every engine
call (tests/support/lease.py's BlockEngine). One handler hangs for good:
``activate_destination``, ``start_transfer`` (the vLLM decode pulls),
``reserve_destination`` (after taking its blocks) or ``release_source``
(before freeing anything). Then the handoff is canceled, times out, has the
hung engine declared lost by the frontend, has its coordinator killed with
-9 for longer than the lease (and restarted on its journal), or has the hung
engine cut off by a real TCP proxy for longer than the delivery timeout.
Whatever the pair: every block is freed within the grace plus the timer in
play, every handoff ends, each side is freed by exactly one engine call, and
an activated decode is never freed by the sidecar on its own.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import subprocess
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from handoff_client import (
    APPLIED,
    Action,
    ActionKind,
    EngineLost,
    EngineSidecar,
    EngineType,
    Facts,
    HandoffClient,
    Origin,
    Outcome,
    Phase,
    Role,
)
from tests.support.fakes import free_port
from tests.support.lease import BlackHoleProxy, BlockEngine, Side, until
from tests.support.processes import serve_process
from tests.support.servers import FAST_RECONNECT, StartServer
from tests.support.sidecar import DESTINATION, QUICK, SOURCE

DELIVERY_TIMEOUT_S = 3.0  # the lease is 2 s
LEASE_S = 2.0
HANDLER_TIMEOUT_S = 1.5
GRACE_S = 0.2
HANDOFF_TIMEOUT_S = 1.0
SLACK_S = 2.5  # scheduling and round trips on a loaded 2-core machine
TIMEOUT_S = 40.0
SERVER = {"delivery_timeout_s": DELIVERY_TIMEOUT_S, "keepalive_time_s": 0.5}
SERVER |= {"keepalive_timeout_s": 0.5}

HANGS = {
    ActionKind.ACTIVATE_DESTINATION: Role.DESTINATION,
    ActionKind.START_TRANSFER: Role.DESTINATION,
    ActionKind.RESERVE_DESTINATION: Role.DESTINATION,
    ActionKind.RELEASE_SOURCE: Role.SOURCE,
}
TRIGGERS = ("canceled", "timed_out", "lost", "killed", "cut")


class HangingEngine(BlockEngine):
    """A BlockEngine whose ``hang`` handler never returns (it is cancellation-safe:
    cancelled, it unwinds having taken nothing more). ``frees`` counts, per
    side, the engine calls that freed something."""

    def __init__(self, hang: ActionKind) -> None:
        super().__init__()
        self.hang = hang
        self.hanging = asyncio.Event()
        self.frees: Counter[Side] = Counter()
        self.activated: set[str] = set()

    async def _park(self, action: Action) -> None:
        if action.kind is self.hang:
            self.hanging.set()
            await asyncio.Event().wait()  # forever, until cancelled

    def _free(self, side: Side) -> Outcome:
        outcome = super()._free(side)
        if outcome == APPLIED:
            self.frees[side] += 1
        return outcome

    async def reserve_destination(self, action: Action, facts: Facts) -> Outcome:
        self._take((action.handoff_id, Role.DESTINATION))
        await self._park(action)
        return await super().reserve_destination(action, facts)

    async def start_transfer(self, action: Action, facts: Facts) -> Outcome:
        await self._park(action)
        return await super().start_transfer(action, facts)

    async def activate_destination(self, action: Action, facts: Facts) -> Outcome:
        await self._park(action)
        outcome = await super().activate_destination(action, facts)
        self.activated.add(action.handoff_id)
        return outcome

    async def release_source(self, action: Action, facts: Facts) -> Outcome:
        await self._park(action)
        return await super().release_source(action, facts)


@dataclass
class World:
    client: HandoffClient
    prefill: HangingEngine
    decode: HangingEngine
    p: EngineSidecar
    d: EngineSidecar
    proxy: BlackHoleProxy | None = None


def sidecar(client: HandoffClient, engine_id: str, engine: HangingEngine) -> EngineSidecar:
    return EngineSidecar(
        client,
        engine_id,
        engine,
        reconnect_backoff=QUICK,
        handler_timeout_s=HANDLER_TIMEOUT_S,
        interrupt_grace_s=GRACE_S,
    )


@contextlib.asynccontextmanager
async def world(port: int, hang: ActionKind, *, cut: bool) -> AsyncIterator[World]:
    """A prefill and a decode; the hung engine behind a proxy when ``cut``."""
    prefill, decode = HangingEngine(hang), HangingEngine(hang)
    hung_role = HANGS[hang]
    proxy = BlackHoleProxy(port) if cut else None
    if proxy is not None:
        await proxy.start()
    hung_port = proxy.port if proxy is not None else port
    options = {"timeout_s": 5.0, "channel_options": FAST_RECONNECT}
    try:
        async with (
            HandoffClient(f"127.0.0.1:{port}", **options) as client,  # type: ignore[arg-type]
            HandoffClient(f"127.0.0.1:{hung_port}", **options) as hung,  # type: ignore[arg-type]
            sidecar(hung if hung_role is Role.SOURCE else client, SOURCE, prefill) as p,
            sidecar(hung if hung_role is Role.DESTINATION else client, DESTINATION, decode) as d,
        ):
            await p.wait_subscribed()
            await d.wait_subscribed()
            yield World(client, prefill, decode, p, d, proxy)
    finally:
        if proxy is not None:
            await proxy.close()


def kill(server: subprocess.Popen[bytes]) -> None:
    if server.poll() is None:
        server.send_signal(signal.SIGKILL)
        server.wait()


async def ended(client: HandoffClient, handoff_id: str) -> None:
    """Until the server says the handoff is over (its state has no event to await)."""
    while (await client.get_handoff(handoff_id)).phase is not Phase.COMPLETE:  # noqa: ASYNC110
        await asyncio.sleep(0.05)


def all_freed(w: World) -> bool:
    """Nothing held but a decode that owns its (activated) request."""
    decode_left = {side for side in w.decode.blocks if side[0] not in w.decode.activated}
    return not w.prefill.blocks and not decode_left


def check(w: World, handoff_id: str) -> None:
    for engine in (w.prefill, w.decode):
        assert engine.double_frees == 0
        assert all(n == 1 for n in engine.frees.values()), engine.frees
    for side in [(handoff_id, Role.SOURCE), (handoff_id, Role.DESTINATION)]:
        engine = w.prefill if side[1] is Role.SOURCE else w.decode
        if side in engine.blocks:  # an activated decode runs on
            assert handoff_id in w.decode.activated
    # The sidecar's own frees never touched a decode activated before them.
    made_up = [
        a
        for a in w.decode.calls
        if a.kind is ActionKind.CANCEL_DESTINATION and a.origin is not Origin.COORDINATOR
    ]
    for action in made_up:
        assert action.handoff_id not in w.decode.activated, action
        assert action.id < 0


async def trigger(w: World, how: str, handoff_id: str, role: Role) -> None:
    if how == "canceled":
        await w.client.cancel(handoff_id, "the frontend gave up")
    elif how == "lost":
        await w.client.report_fact(handoff_id, EngineLost(role))
    elif how == "cut":
        assert w.proxy is not None
        w.proxy.cut()


async def begin(w: World, hang: ActionKind, how: str) -> str:
    handoff_id = str(uuid.uuid4())
    await w.client.start_handoff(
        handoff_id,
        engine_type=EngineType.VLLM,
        source_engine_id=SOURCE,
        destination_engine_id=DESTINATION,
        transfer_executor=Role.DESTINATION,
        handoff_timeout_s=HANDOFF_TIMEOUT_S if how == "timed_out" else 60.0,
    )
    hung = w.prefill if HANGS[hang] is Role.SOURCE else w.decode
    await hung.hanging.wait()
    return handoff_id


def timer_s(how: str, hang: ActionKind) -> float:
    """How long the free may take: the timer in play, plus the grace (and for a
    hung release, which is a cleanup, the handler timeout it must wait out)."""
    timer = {"canceled": 0.0, "timed_out": HANDOFF_TIMEOUT_S, "lost": 0.0}.get(how, LEASE_S)
    waits = HANDLER_TIMEOUT_S if hang is ActionKind.RELEASE_SOURCE else 0.0
    return timer + waits + GRACE_S + SLACK_S


@pytest.mark.parametrize("how", ["canceled", "timed_out", "lost", "cut"])
@pytest.mark.parametrize("hang", HANGS, ids=lambda kind: kind.name.lower())
async def test_a_hung_handler_never_keeps_its_sides_blocks(
    start_lean_server: StartServer, hang: ActionKind, how: str
) -> None:
    server = await start_lean_server(**SERVER)
    async with asyncio.timeout(TIMEOUT_S), world(server.port, hang, cut=how == "cut") as w:
        handoff_id = await begin(w, hang, how)
        began = time.monotonic()
        await trigger(w, how, handoff_id, HANGS[hang])
        await until(lambda: all_freed(w))
        took = time.monotonic() - began
        assert took < timer_s(how, hang), f"freed after {took:.1f} s"
        if w.proxy is not None:
            w.proxy.heal()
        await ended(w.client, handoff_id)
        hung = w.p if HANGS[hang] is Role.SOURCE else w.d
        assert hung.stats.handlers_interrupted >= 1
    check(w, handoff_id)


@pytest.mark.parametrize("hang", HANGS, ids=lambda kind: kind.name.lower())
async def test_a_hung_handler_is_freed_by_the_lease_when_the_coordinator_is_killed(
    tmp_path: Path, hang: ActionKind
) -> None:
    port, state_dir, log = free_port(), tmp_path / "state", tmp_path / "serve.log"
    flags = ("--delivery-timeout-s", str(DELIVERY_TIMEOUT_S), "--state-dir", str(state_dir))
    server = serve_process(port, log, *flags)
    try:
        async with asyncio.timeout(TIMEOUT_S), world(port, hang, cut=False) as w:
            await w.client.wait_ready()
            handoff_id = await begin(w, hang, "killed")
            kill(server)
            began = time.monotonic()
            await until(lambda: all_freed(w))
            took = time.monotonic() - began
            assert took < timer_s("killed", hang), f"freed after {took:.1f} s"
            server = serve_process(port, log, *flags)  # back on its journal
            await w.client.wait_ready()
            await ended(w.client, handoff_id)
        check(w, handoff_id)
    finally:
        kill(server)
