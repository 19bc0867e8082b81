"""Sidecars and the client on the installed SDK, against a coordinator process."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator

import pytest

from handoff_client import (
    Action,
    ActionKind,
    Completion,
    EngineType,
    Facts,
    HandoffClient,
    Outcome,
    OutcomeKind,
)
from handoff_client.errors import NotFoundError
from handoff_client.transport import TRANSPORT_KINDS, TransportKind
from tests.support.sidecar import DESTINATION, SOURCE, TIMEOUT_S, ScriptedEngine, running, start


@pytest.fixture
async def client(coordinator: str) -> AsyncIterator[HandoffClient]:
    async with HandoffClient(coordinator, timeout_s=TIMEOUT_S) as client:
        yield client


@pytest.mark.parametrize("kind", TRANSPORT_KINDS)
@pytest.mark.parametrize("stack", [EngineType.VLLM, EngineType.SGLANG])
async def test_both_orders_run_to_success(
    client: HandoffClient, stack: EngineType, kind: TransportKind
) -> None:
    prefill, decode = ScriptedEngine(), ScriptedEngine()
    async with (
        running(client, SOURCE, prefill, transport=kind),
        running(client, DESTINATION, decode, transport=kind),
    ):
        async with asyncio.timeout(TIMEOUT_S):
            handoff_id = await start(client, stack)
            await decode.notices[handoff_id].get()
            handoff = await client.get_handoff(handoff_id)
    assert handoff.completion is Completion.SUCCESS
    assert prefill.count(ActionKind.RELEASE_SOURCE) == 1
    assert decode.count(ActionKind.ACTIVATE_DESTINATION) == 1


async def test_a_cancel_cleans_up_both_engines(client: HandoffClient) -> None:
    prefill, decode = ScriptedEngine(), ScriptedEngine()
    held = asyncio.Event()

    async def submitted_never_held(action: Action, facts: Facts) -> Outcome:
        held.set()
        return Outcome(OutcomeKind.SUBMITTED)  # and the prefill never finishes

    prefill.overrides[ActionKind.SUBMIT_PREFILL] = submitted_never_held
    async with (
        running(client, SOURCE, prefill),
        running(client, DESTINATION, decode),
    ):
        async with asyncio.timeout(TIMEOUT_S):
            handoff_id = await start(client)
            await held.wait()
            await client.cancel(handoff_id, "the user went away")
            await decode.notices[handoff_id].get()
            handoff = await client.get_handoff(handoff_id)
    assert handoff.completion is Completion.CANCELED


async def test_an_unknown_handoff_raises_not_found(client: HandoffClient) -> None:
    handoff_id = str(uuid.uuid4())
    with pytest.raises(NotFoundError, match=handoff_id):
        await client.get_handoff(handoff_id)
