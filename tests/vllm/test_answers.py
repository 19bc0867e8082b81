"""Through `handoff proxy` and the coordinated P/D pair, greedy answers equal one vLLM's alone.

The KV moved: the tiny model has real random weights, so an answer decoded
from the wrong KV differs. References come from the prefill engine as a plain
request (one vLLM computing everything itself); each prompt is new to the
decode, so its KV is read over NIXL, not found in its prefix cache.
"""

from __future__ import annotations

import asyncio

import httpx

from handoff_client import Completion, HandoffClient, LifecycleEventKind
from tests.vllm.support import Pair, Proxy, complete, ended

MAX_TOKENS = 12
# Lengths from a few tokens to several 32-token blocks.
PROMPTS = [
    f"{lead} {body}"
    for lead, body in zip(
        [f"Request {n}:" for n in range(24)],
        [
            "The coordinator decides",
            "A decode engine pulls the key value cache",
            "Every handoff ends released or canceled",
            "Prefill computes the prompt; decode writes the answer one token at a time, and",
            "The quick brown fox jumps over the lazy dog while the lease runs out " * 2,
            "Numbers like 12345 and 67890",
            "Disaggregated serving splits the prompt from the answer across machines " * 3,
            "alpha beta gamma delta",
            "A frontend that disconnects cancels the handoff",
            "The prefill frees its blocks when",
            "decode decode decode decode",
            "Whatever fails, nothing leaks: " * 4,
            "lease heartbeat deadline",
            "The answer one token at a time",
            "key value cache over NIXL before it runs " * 5,
            "12345 67890 12345",
            "machines across answer the from prompt the splits",
            "The lazy dog",
            "exactly once, whatever fails, exactly once",
            "Prefill computes",
            "The coordinator decides when the prefill may free its blocks. " * 3,
            "gamma",
            "blocks blocks blocks held",
            "When the decode reads, the prefill",
        ],
        strict=True,
    )
]


async def test_greedy_answers_through_the_proxy_equal_one_vllm_alone(
    pair: Pair, proxy: Proxy, client: HandoffClient, http: httpx.AsyncClient
) -> None:
    references = [await complete(http, pair.prefill.url, p, MAX_TOKENS) for p in PROMPTS]
    results: list[tuple[str, str]] = []
    for start in range(0, len(PROMPTS), 4):  # a few at once; half of them streamed
        batch = PROMPTS[start : start + 4]
        results += await asyncio.gather(
            *(proxy.complete(http, p, MAX_TOKENS, stream=n % 2 == 1) for n, p in enumerate(batch))
        )
    answers = [text for _, text in results]
    assert answers == references
    for handoff_id, _ in results:
        handoff = await ended(client, handoff_id)
        assert handoff.completion is Completion.SUCCESS, handoff
        kinds = [event.kind for event in handoff.lifecycle]
        assert LifecycleEventKind.SOURCE_HELD in kinds
        assert LifecycleEventKind.DESTINATION_RESERVED in kinds
        assert LifecycleEventKind.DESTINATION_ACTIVATED in kinds
    await asyncio.gather(pair.prefill.idle(), pair.decode.idle())


async def test_a_prefix_cache_hit_on_the_decode_reads_nothing_and_answers_right(
    pair: Pair, client: HandoffClient, http: httpx.AsyncClient
) -> None:
    # Two full blocks and a bit: the second time the decode has the blocks itself.
    prompt = "Cached on the decode after the first time: " + "tokens of a prefix " * 12
    reference = await complete(http, pair.prefill.url, prompt, MAX_TOKENS)
    for _ in range(2):
        handoff_id, text = await pair.generate(client, http, prompt, MAX_TOKENS)
        assert text == reference
        handoff = await ended(client, handoff_id)
        assert handoff.completion is Completion.SUCCESS, handoff
    await asyncio.gather(pair.prefill.idle(), pair.decode.idle())
