"""Sidecars against the real server's EngineLost and COMPLETE notices, end to end.

An engine the frontend declares lost while it is alive frees what it held
when the COMPLETE notice arrives; every notice says how the handoff ended.
Both transports. Incarnations and fencing: tests/client/test_sidecar_fencing.py.
"""

from __future__ import annotations

import asyncio

from handoff_client import (
    ActionKind,
    Completion,
    EngineLost,
    HandoffClient,
    Role,
    TransportKind,
)
from tests.support.sidecar import (
    DESTINATION,
    SOURCE,
    TIMEOUT_S,
    ScriptedEngine,
    holding_prefill,
    running,
    start,
)


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
