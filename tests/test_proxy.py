"""`handoff proxy` end to end: a real coordinator, stand-in engines (tests/proxy_support.py:
vLLM's two P/D legs over HTTP, reporting as real SDK engines; not vLLM, which
`make test-vllm` runs), and the proxy in between, all on loopback."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest

from handoff_client import Completion
from handoff_proxy.flow import Endpoint
from handoff_server.app import Server
from tests.conftest import free_port
from tests.proxy_support import TIMEOUT_S, Rig, rig, sse_events

PROMPT = {"model": "tiny", "prompt": "The KV moves", "max_tokens": 8, "temperature": 0}
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8}


def coordinator(server: Server) -> str:
    return f"127.0.0.1:{server.port}"


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as session:
        yield session


def request_for(endpoint: Endpoint, stream: bool) -> dict[str, Any]:
    body = dict(PROMPT if endpoint is Endpoint.COMPLETIONS else CHAT)
    if stream:
        body["stream"] = True
        body["stream_options"] = {"include_usage": True}
    return body


def text_of(endpoint: Endpoint, answer: dict[str, Any]) -> str:
    choice = answer["choices"][0]
    return str(choice["text"] if endpoint is Endpoint.COMPLETIONS else choice["message"]["content"])


def streamed_text(endpoint: Endpoint, events: list[Any]) -> str:
    parts = []
    for event in events:
        if event == "[DONE]":
            continue
        choice = event["choices"][0]
        parts.append(choice["text"] if endpoint is Endpoint.COMPLETIONS else choice["delta"]["content"])
    return "".join(parts)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("endpoint", list(Endpoint), ids=lambda e: e.label)
async def test_a_request_runs_one_handoff_through_both_legs(
    lean_server: Server, http: aiohttp.ClientSession, endpoint: Endpoint, stream: bool
) -> None:
    async with asyncio.timeout(TIMEOUT_S), rig(coordinator(lean_server)) as proxy:
        prefill, decode = proxy.prefills[0], proxy.decodes[0]
        body = request_for(endpoint, stream)
        async with http.post(proxy.url + endpoint.value, json=body) as response:
            assert response.status == 200, await response.text()
            handoff_id = response.headers["X-Request-Id"]
            if stream:
                events = sse_events(await response.text())
                assert events[-1] == "[DONE]"
                text = streamed_text(endpoint, events)
            else:
                text = text_of(endpoint, await response.json())
        # The decode answered with the KV the prefill held (its params came along).
        assert text == "Tokens decoded after prefill-0"
        # The prefill leg: one token, not streamed, asking for a remote decode.
        sent = prefill.bodies[0]
        assert sent["max_tokens"] == 1 and sent["stream"] is False
        assert "stream_options" not in sent
        if endpoint is Endpoint.CHAT:
            assert sent["max_completion_tokens"] == 1
        assert sent["kv_transfer_params"] == {
            "do_remote_decode": True,
            "do_remote_prefill": False,
            "remote_engine_id": None,
            "remote_block_ids": None,
            "remote_host": None,
            "remote_port": None,
            "handoff_id": handoff_id,
        }
        # The decode leg: the client's own body, with the prefill's params and the id.
        decoded = decode.bodies[0]
        assert {k: v for k, v in decoded.items() if k != "kv_transfer_params"} == body
        assert decoded["kv_transfer_params"]["remote_engine_id"] == "prefill-0"
        assert decoded["kv_transfer_params"]["handoff_id"] == handoff_id
        assert prefill.request_ids == decode.request_ids == [handoff_id]
        await decode.ended(handoff_id, Completion.SUCCESS)
        assert prefill.freed[handoff_id].is_set()  # ReleaseSource
        assert proxy.client is not None
        handoff = await proxy.client.get_handoff(handoff_id)
        assert handoff.source_engine_id == "prefill-0"
        assert handoff.destination_engine_id == "decode-0"
