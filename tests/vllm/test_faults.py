"""Faults with real engines: each placed by watching the coordinator, never by a sleep.

After each: the handoff ended on the coordinator with the expected completion
(`expect_end`: once GetHandoff gives an end reason, one line there checks it
too), both engines idle by vLLM's own /metrics, and the next request answered.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import signal
import time
import uuid
from typing import Any

import httpx
import pytest

from handoff_client import Completion, Handoff, HandoffClient, LifecycleEventKind
from tests.vllm.support import (
    Engine,
    LegError,
    Pair,
    Proxy,
    complete,
    decode_leg,
    ended,
    lifecycle_has,
    poll,
    prefill_leg,
)

MAX_TOKENS = 8
HANDOFF = re.compile(r"handoff ([0-9a-f-]{36})")


async def expect_end(client: HandoffClient, handoff_id: str, completion: Completion) -> Handoff:
    handoff = await ended(client, handoff_id)
    assert handoff.completion is completion, handoff
    return handoff


async def answered(pair: Pair, client: HandoffClient, http: httpx.AsyncClient) -> None:
    """The next request through the pair is answered, and right."""
    prompt = f"After the fault {uuid.uuid4().hex[:6]}: the coordinator decides"
    reference = await complete(http, pair.prefill.url, prompt, MAX_TOKENS)
    handoff_id, text = await pair.generate(client, http, prompt, MAX_TOKENS)
    assert text == reference
    await expect_end(client, handoff_id, Completion.SUCCESS)


async def held(
    pair: Pair,
    client: HandoffClient,
    http: httpx.AsyncClient,
    prompt: str,
    event: str = "SOURCE_HELD",
) -> tuple[str, dict[str, Any]]:
    """A handoff whose prefill leg ran, once ``event`` is in its lifecycle on the
    coordinator: (handoff id, the params for its decode leg)."""
    handoff_id = await pair.start_handoff(client)
    params = await prefill_leg(http, pair.prefill.url, prompt, handoff_id)
    await poll(
        f"{event} on the coordinator", lambda: lifecycle_has(client, handoff_id, event), 30.0
    )
    return handoff_id, params


async def restart(engine: Engine) -> None:
    engine.kill()
    engine.start()
    await engine.ready()


async def test_kill_decode_after_source_held_frees_the_prefill_within_the_delivery_timeout(
    pair: Pair, client: HandoffClient, http: httpx.AsyncClient
) -> None:
    handoff_id, _ = await held(pair, client, http, "Held for a decode that dies " * 4)
    assert not await pair.prefill.idle_now()  # the prefill holds the blocks
    pair.decode.kill()
    killed = time.monotonic()
    await pair.prefill.idle(timeout_s=30.0)
    freed_after_s = time.monotonic() - killed
    # The coordinator's delivery timeout (10 s) and a few steps, not NIXL's lease (70 s).
    assert freed_after_s < pair.coordinator.delivery_timeout_s + 10.0, freed_after_s
    await expect_end(client, handoff_id, Completion.CANCELED)
    pair.decode.start()
    await pair.decode.ready()
    await answered(pair, client, http)


async def test_kill_prefill_before_the_read_fails_the_decode_instead_of_decoding(
    pair: Pair, client: HandoffClient, http: httpx.AsyncClient
) -> None:
    prompt = "A prefill that dies before its KV is read " * 3
    handoff_id, params = await held(pair, client, http, prompt)
    pair.prefill.kill()
    await expect_end(client, handoff_id, Completion.CANCELED)
    # The decode leg of an ended handoff fails its load: no token decoded.
    with pytest.raises(LegError) as failure:
        await decode_leg(http, pair.decode.url, prompt, params, MAX_TOKENS)
    assert failure.value.leg == "decode"
    await pair.decode.idle()
    assert pair.prefill.engine_id is not None
    connected = pair.coordinator.connections(pair.prefill.engine_id)
    pair.prefill.start()
    await pair.prefill.ready()
    # Healthy only once live on the coordinator: a handoff started now is not
    # canceled for an unreachable prefill (subscribe_timeout_s).
    assert pair.coordinator.connections(pair.prefill.engine_id) == connected + 1
    await pair.prefill.idle()
    await answered(pair, client, http)


async def test_a_decode_for_a_handoff_the_coordinator_never_heard_of_fails_its_load(
    pair: Pair, client: HandoffClient, http: httpx.AsyncClient
) -> None:
    prompt = "Nobody started this handoff " * 3
    params = await prefill_leg(http, pair.prefill.url, prompt, None)  # plain NIXL prefill
    with pytest.raises(LegError):
        await decode_leg(
            http, pair.decode.url, prompt, {**params, "handoff_id": str(uuid.uuid4())}, MAX_TOKENS
        )
    await pair.decode.idle()
    # The same legs without a handoff id are plain vLLM P/D, untouched: its read
    # frees the prefill now, not at NIXL's lease.
    reference = await complete(http, pair.prefill.url, prompt, MAX_TOKENS)
    assert await decode_leg(http, pair.decode.url, prompt, params, MAX_TOKENS) == reference
    await asyncio.gather(pair.prefill.idle(), pair.decode.idle())


async def test_canceled_before_the_decode_leg_frees_the_prefill_at_once(
    pair: Pair, client: HandoffClient, http: httpx.AsyncClient
) -> None:
    handoff_id, _ = await held(pair, client, http, "A client that goes away " * 4)
    await client.cancel(handoff_id, "client disconnected")
    await expect_end(client, handoff_id, Completion.CANCELED)
    await asyncio.gather(pair.prefill.idle(), pair.decode.idle())
    await answered(pair, client, http)


async def stream_until_first_token(proxy: Proxy, http: httpx.AsyncClient, prompt: str) -> str:
    """Open a long streamed completion through the proxy; its handoff id at the first token.

    The caller then breaks the stream off (leaving the ``async with`` closes it).
    ``ignore_eos``: 200 tokens whatever the model says, so the answer is still
    being written when the client goes (a short one can end first: SUCCESS)."""
    body = {
        "model": "tiny",
        "prompt": prompt,
        "max_tokens": 200,
        "temperature": 0.0,
        "ignore_eos": True,
    }
    async with http.stream(
        "POST", f"{proxy.url}/v1/completions", json={**body, "stream": True}
    ) as answer:
        assert answer.status_code == 200, await answer.aread()
        handoff_id = answer.headers["x-request-id"]
        async for line in answer.aiter_lines():
            if line.startswith("data: ") and '"text"' in line:
                return handoff_id
    raise AssertionError("the stream ended before its first token")


async def test_a_client_that_disconnects_during_the_prefill_frees_both_engines(
    pair: Pair, proxy: Proxy, client: HandoffClient, http: httpx.AsyncClient
) -> None:
    began = await proxy.metric(http, "handoff_proxy_leg_duration_seconds_count", leg="start")
    gone = await proxy.metric(http, "handoff_proxy_client_disconnects_total", leg="prefill")
    pair.prefill.pause_server()  # the prefill leg waits, unread, until resumed
    try:
        request = asyncio.ensure_future(
            proxy.complete(http, "A client that leaves before its prefill " * 3, 40, stream=True)
        )
        # The start leg's duration is observed as the prefill leg begins.
        await proxy.metric_above(
            http,
            "the proxy in the prefill leg",
            "handoff_proxy_leg_duration_seconds_count",
            began,
            leg="start",
        )
        request.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await request
        await proxy.metric_above(
            http,
            "the proxy saw the client go",
            "handoff_proxy_client_disconnects_total",
            gone,
            leg="prefill",
        )
    finally:
        pair.prefill.pause_server(resume=True)
    (handoff_id,) = proxy.handoff_ids("client disconnected during the prefill leg")[-1:]
    # Whatever the resumed prefill makes of the request it reads now (an abort,
    # or a prefill whose blocks the canceled handoff frees at once): nothing held.
    await ended(client, handoff_id, completion=Completion.CANCELED)
    await asyncio.gather(pair.prefill.idle(), pair.decode.idle())
    await answered(pair, client, http)


async def test_a_client_that_disconnects_during_the_decode_frees_both_engines(
    pair: Pair, proxy: Proxy, client: HandoffClient, http: httpx.AsyncClient
) -> None:
    handoff_id = await stream_until_first_token(proxy, http, "A client that leaves " * 3)
    # Activated and its source released, the handoff may be COMPLETE with
    # SUCCESS already; the proxy's Canceled then reopens it (semantics.md,
    # correction 1): it ends CANCELED either way.
    await ended(client, handoff_id, completion=Completion.CANCELED)
    await asyncio.gather(pair.prefill.idle(), pair.decode.idle())
    await answered(pair, client, http)


async def test_kill_prefill_during_the_decode_leg_answers_502_naming_the_prefill(
    pair: Pair, proxy: Proxy, client: HandoffClient, http: httpx.AsyncClient
) -> None:
    began = await proxy.metric(http, "handoff_proxy_leg_duration_seconds_count", leg="prefill")
    pair.decode.pause_server()  # the decode leg waits, unread: its KV not read yet
    try:
        request = asyncio.ensure_future(
            proxy.complete(http, "A prefill that dies under the proxy " * 3, MAX_TOKENS, False)
        )
        # The prefill leg's duration is observed as the decode leg begins.
        await proxy.metric_above(
            http,
            "the proxy in the decode leg",
            "handoff_proxy_leg_duration_seconds_count",
            began,
            leg="prefill",
        )
        pair.prefill.kill()
        # The coordinator declares the prefill lost (its delivery timeout) and
        # cancels; the proxy, watching, closes the decode leg and says why.
        with pytest.raises(LegError) as failure:
            await asyncio.wait_for(request, pair.coordinator.delivery_timeout_s + 30.0)
    finally:
        pair.decode.pause_server(resume=True)
    assert failure.value.status == 502, failure.value
    assert pair.prefill.engine_id is not None
    assert f"lost prefill engine {pair.prefill.engine_id}" in failure.value.body, failure.value
    match = HANDOFF.search(failure.value.body)
    assert match is not None, failure.value
    handoff = await expect_end(client, match.group(1), Completion.CANCELED)
    assert LifecycleEventKind.SOURCE_LOST in {event.kind for event in handoff.lifecycle}
    await pair.decode.idle()
    pair.prefill.start()
    await pair.prefill.ready()
    await pair.prefill.idle()
    await answered(pair, client, http)


async def test_a_handful_at_once_two_of_them_cut_off_mid_stream(
    pair: Pair, proxy: Proxy, client: HandoffClient, http: httpx.AsyncClient
) -> None:
    prompts = [f"At once, number {n}: the coordinator decides " * 2 for n in range(4)]
    references = [await complete(http, pair.prefill.url, p, MAX_TOKENS) for p in prompts]
    answers, *cut = await asyncio.gather(
        asyncio.gather(
            *(proxy.complete(http, p, MAX_TOKENS, stream=n % 2 == 0) for n, p in enumerate(prompts))
        ),
        stream_until_first_token(proxy, http, "Cut off at once, first " * 3),
        stream_until_first_token(proxy, http, "Cut off at once, second " * 3),
    )
    assert [text for _, text in answers] == references
    for handoff_id, _ in answers:
        await expect_end(client, handoff_id, Completion.SUCCESS)
    for handoff_id in cut:
        await ended(client, handoff_id, completion=Completion.CANCELED)
    await asyncio.gather(pair.prefill.idle(), pair.decode.idle())
    await answered(pair, client, http)


async def test_kill_the_proxy_mid_stream_leaves_both_engines_idle(
    pair: Pair, proxy: Proxy, client: HandoffClient, http: httpx.AsyncClient
) -> None:
    handoff_id = await stream_until_first_token(proxy, http, "A proxy that dies " * 3)
    proxy.kill()
    # Activated and released: SUCCESS; vLLM aborts the decode whose client is gone.
    await ended(client, handoff_id)
    await asyncio.gather(pair.prefill.idle(), pair.decode.idle())
    proxy.start()
    await proxy.ready()
    reference = await complete(http, pair.prefill.url, "After the proxy's restart", MAX_TOKENS)
    _, text = await proxy.complete(http, "After the proxy's restart", MAX_TOKENS, stream=False)
    assert text == reference


async def test_kill_9_of_the_coordinator_mid_flight_then_a_restart_on_its_state_dir(
    pair: Pair, client: HandoffClient, http: httpx.AsyncClient
) -> None:
    prompt = "The coordinator dies while the prefill holds " * 3
    reference = await complete(http, pair.prefill.url, prompt, MAX_TOKENS)
    handoff_id, params = await held(pair, client, http, prompt)
    pair.coordinator.kill()
    pair.coordinator.start()  # the same port and --state-dir
    await pair.coordinator.ready()
    # The restarted coordinator resumes the handoff from its journal; the
    # sidecars resubscribe; the decode leg is answered, and right.
    assert await decode_leg(http, pair.decode.url, prompt, params, MAX_TOKENS) == reference
    await expect_end(client, handoff_id, Completion.SUCCESS)
    await asyncio.gather(pair.prefill.idle(), pair.decode.idle())
    await answered(pair, client, http)


async def test_a_decode_stopped_past_the_delivery_timeout_never_reads_the_freed_prefill(
    pair: Pair, client: HandoffClient, http: httpx.AsyncClient
) -> None:
    prompt = "A decode that stops while its prefill waits " * 3
    handoff_id, params = await held(pair, client, http, prompt, "DESTINATION_ACCEPTED")
    pair.decode.signal(signal.SIGSTOP)  # the engine and its sidecar: a stalled host
    try:
        # Its leg waits in the stopped server's backlog.
        leg = asyncio.ensure_future(decode_leg(http, pair.decode.url, prompt, params, MAX_TOKENS))
        # Keepalive (Coordinator's 5 s + 5 s) ends its stream, the delivery
        # timeout declares it lost, and the prefill is freed by CancelSource.
        handoff = await ended(client, handoff_id, timeout_s=60.0)
        assert handoff.completion is Completion.CANCELED, handoff
        assert LifecycleEventKind.DESTINATION_LOST in {e.kind for e in handoff.lifecycle}
        await pair.prefill.idle(timeout_s=30.0)
    finally:
        pair.decode.signal(signal.SIGCONT)
    # Resumed, the decode fails its load (its lease and reconcile say the
    # handoff ended): no token decoded from blocks the prefill freed.
    with pytest.raises(LegError) as failure:
        await leg
    assert failure.value.leg == "decode"
    await asyncio.gather(pair.prefill.idle(), pair.decode.idle())
    await answered(pair, client, http)
