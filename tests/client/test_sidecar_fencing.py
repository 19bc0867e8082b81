"""Sidecars against the real server's incarnations and fencing, end to end.

A sidecar that comes back under a new incarnation gets its old handoffs
settled at once; an older incarnation is refused and frees what it held; two
sidecars sharing one incarnation do not flap; a StartHandoff sent twice says
the second time that it was already started. Both transports.
"""

from __future__ import annotations

import asyncio
import uuid

import pytest

from handoff_client import (
    ActionKind,
    Completion,
    EngineSidecar,
    EngineType,
    HandoffClient,
    LifecycleEventKind,
    TransportKind,
    new_incarnation,
)
from handoff_client.errors import OlderIncarnationError
from tests.support.sidecar import (
    DESTINATION,
    QUICK,
    SOURCE,
    TIMEOUT_S,
    ScriptedEngine,
    holding_prefill,
    running,
    start,
)


async def test_a_new_incarnation_gets_the_old_ones_handoffs_settled_at_once(
    client: HandoffClient, kind: TransportKind
) -> None:
    old, submitted = holding_prefill()
    decode = ScriptedEngine()
    async with running(client, DESTINATION, decode, transport=kind), asyncio.timeout(TIMEOUT_S):
        async with running(client, SOURCE, old, transport=kind):
            handoff_id = await start(client)
            await submitted.wait()
        # The engine process restarts: its memory, and its prefill, are gone.
        new = ScriptedEngine()
        async with running(client, SOURCE, new, transport=kind):
            await decode.notices[handoff_id].get()  # COMPLETE, at once
            handoff = await client.get_handoff(handoff_id)
    assert handoff.completion is Completion.CANCELED
    assert handoff.first(LifecycleEventKind.SOURCE_LOST) is not None
    assert new.calls == []  # nothing of the old process's work reaches the new one


async def test_an_older_incarnation_is_refused_and_frees_what_it_held(
    client: HandoffClient, kind: TransportKind
) -> None:
    older_engine, submitted = holding_prefill()
    older = EngineSidecar(
        client,
        SOURCE,
        older_engine,
        transport=kind,
        reconnect_backoff=QUICK,
        incarnation="0000000000001-older",
    )
    decode = ScriptedEngine()
    async with (
        running(client, DESTINATION, decode, transport=kind),
        older,
        asyncio.timeout(TIMEOUT_S),
    ):
        await older.wait_subscribed()
        handoff_id = await start(client)
        await submitted.wait()
        # A newer process of the same engine subscribes; the older one's
        # stream is replaced, and its resubscription refused.
        async with running(client, SOURCE, ScriptedEngine(), transport=kind):
            with pytest.raises(OlderIncarnationError):
                await older.wait()
            await decode.notices[handoff_id].get()  # settled: the older one's memory is lost
    freed = [a for a in older_engine.calls if a.kind is ActionKind.CANCEL_SOURCE]
    assert [(a.handoff_id, a.attempt) for a in freed] == [(handoff_id, 0)]
    assert older.stats.reconnects >= 1


async def test_two_sidecars_with_one_incarnation_do_not_flap(
    client: HandoffClient, kind: TransportKind
) -> None:
    incarnation = new_incarnation()
    first_engine, second_engine = ScriptedEngine(), ScriptedEngine()
    decode = ScriptedEngine()
    first = EngineSidecar(
        client,
        SOURCE,
        first_engine,
        transport=kind,
        reconnect_backoff=QUICK,
        incarnation=incarnation,
    )
    second = EngineSidecar(
        client,
        SOURCE,
        second_engine,
        transport=kind,
        reconnect_backoff=QUICK,
        incarnation=incarnation,
    )
    async with running(client, DESTINATION, decode, transport=kind), asyncio.timeout(TIMEOUT_S):
        first.start()
        await first.wait_subscribed()
        second.start()
        try:
            await asyncio.sleep(0.5)  # the second keeps being refused
            handoff_id = await start(client)
            await decode.notices[handoff_id].get()
            conflicts = second.stats.session_conflicts
            await first.stop()  # the first is gone: the second gets in
            await second.wait_subscribed()
        finally:
            await first.stop()
            await second.stop()
    assert first.stats.reconnects == 0
    assert conflicts >= 1
    assert second_engine.calls == []  # no handoff was split between the twins
    assert (await client.get_handoff(handoff_id)).completion is Completion.SUCCESS


async def test_a_start_sent_twice_says_already_started(client: HandoffClient) -> None:
    handoff_id = str(uuid.uuid4())
    calls = [
        client.start_handoff(
            handoff_id,
            engine_type=EngineType.VLLM,
            source_engine_id=SOURCE,
            destination_engine_id=DESTINATION,
        )
        for _ in range(2)
    ]
    async with asyncio.timeout(TIMEOUT_S):
        first = await calls[0]
        again = await calls[1]
    assert not first.already_started
    assert first.actions
    assert again.already_started
    assert again.actions == ()
    assert again.handoff.handoff_id == handoff_id
