"""Sidecars against the real server's EngineLost and COMPLETE notices, end to end.

An engine the frontend declares lost while it is alive frees what it held
when the COMPLETE notice arrives; every notice says how the handoff ended.
Both transports. Incarnations and fencing: tests/test_sidecar_fencing.py.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator

import pytest

from handoff_client import (
    SUBMITTED,
    Action,
    ActionKind,
    Completion,
    EngineLost,
    EngineType,
    Facts,
    HandoffClient,
    Outcome,
    Role,
    TransportKind,
)
from handoff_client.transport import TRANSPORT_KINDS
from handoff_server.app import Server
from tests.sidecar_support import DESTINATION, SOURCE, TIMEOUT_S, ScriptedEngine, running


@pytest.fixture(params=TRANSPORT_KINDS)
def kind(request: pytest.FixtureRequest) -> TransportKind:
    """The transport the test's sidecars use."""
    kind: TransportKind = request.param
    return kind


@pytest.fixture
async def client(lean_server: Server) -> AsyncIterator[HandoffClient]:
    async with HandoffClient(f"127.0.0.1:{lean_server.port}", timeout_s=TIMEOUT_S) as client:
        yield client


def holding_prefill() -> tuple[ScriptedEngine, asyncio.Event]:
    """A prefill that answers SUBMITTED and never reports SourceHeld: it holds."""
    engine, submitted = ScriptedEngine(), asyncio.Event()

    async def submit(action: Action, facts: Facts) -> Outcome:
        submitted.set()
        return SUBMITTED

    engine.overrides[ActionKind.SUBMIT_PREFILL] = submit
    return engine, submitted


async def start(client: HandoffClient) -> str:
    handoff_id = str(uuid.uuid4())
    await client.start_handoff(
        handoff_id,
        engine_type=EngineType.VLLM,
        source_engine_id=SOURCE,
        destination_engine_id=DESTINATION,
    )
    return handoff_id


async def test_an_engine_declared_lost_while_alive_frees_on_the_notice(
    client: HandoffClient, kind: TransportKind
) -> None:
    prefill, submitted = holding_prefill()
    decode = ScriptedEngine()
    async with (
        running(client, SOURCE, prefill, transport=kind) as p,
        running(client, DESTINATION, decode, transport=kind),
        asyncio.timeout(TIMEOUT_S),
    ):
        handoff_id = await start(client)
        await submitted.wait()
        # The router hears from Kubernetes that the prefill pod died; it did not.
        await client.report_fact(handoff_id, EngineLost(Role.SOURCE))
        notice = await prefill.notices[handoff_id].get()
    assert notice.completion is Completion.CANCELED
    freed = [a for a in prefill.calls if a.kind is ActionKind.CANCEL_SOURCE]
    assert [a.attempt for a in freed] == [0]  # no CancelSource was owed: the sidecar's own
    assert p.stats.freed_on_complete == 1


async def test_complete_says_how_the_handoff_ended(
    client: HandoffClient, kind: TransportKind
) -> None:
    prefill, decode = ScriptedEngine(), ScriptedEngine()
    async with (
        running(client, SOURCE, prefill, transport=kind) as p,
        running(client, DESTINATION, decode, transport=kind) as d,
        asyncio.timeout(TIMEOUT_S),
    ):
        handoff_id = await start(client)
        notices = [await prefill.notices[handoff_id].get(), await decode.notices[handoff_id].get()]
    assert [n.completion for n in notices] == [Completion.SUCCESS] * 2
    assert p.stats.freed_on_complete == d.stats.freed_on_complete == 0  # all released
