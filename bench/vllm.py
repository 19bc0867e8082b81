"""What coordination costs a real vLLM P/D request: TTFT and end-to-end, p50 and p99.

One coordinator, one prefill and one decode vLLM with HandoffConnector (the
tiny test model, tests/vllm/model.py), and a frontend that sends both legs
itself: **coordinated** (StartHandoff, then the legs with the handoff id:
the decode waits for StartTransfer and ActivateDestination) against **plain**
(the same two legs on the same engines without a handoff id: NIXL alone).
The two kinds alternate request by request in one run, so drift and noise
fall on both. Each request's prompt is new (no prefix-cache hits). TTFT is
from the request's start (before StartHandoff) to the first token of the
streamed decode leg; e2e to its last.

    make bench-vllm            # .venv-vllm/bin/python -m bench.vllm
    .venv-vllm/bin/python -m bench.vllm --requests 60 --max-tokens 16

Figures go in bench/RESULTS.md with the command that made them.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
import uuid
from pathlib import Path

import httpx

from handoff_client import HandoffClient
from tests.vllm.model import build
from tests.vllm.support import Coordinator, Engine, Pair, decode_stream, ended, prefill_leg


async def one(
    pair: Pair, client: HandoffClient, http: httpx.AsyncClient, coordinated: bool, max_tokens: int
) -> tuple[float, float]:
    prompt = f"Benchmark request {uuid.uuid4().hex}: the coordinator decides when"
    first: list[float] = []
    start = time.perf_counter()
    handoff_id = await pair.start_handoff(client) if coordinated else None
    params = await prefill_leg(http, pair.prefill.url, prompt, handoff_id)
    await decode_stream(
        http,
        pair.decode.url,
        prompt,
        params,
        max_tokens,
        first=lambda: first.append(time.perf_counter()),
    )
    done = time.perf_counter()
    if handoff_id is not None:
        await ended(client, handoff_id)
    return (first[0] - start) * 1000, (done - start) * 1000


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def report(name: str, ttft: list[float], e2e: list[float]) -> str:
    return (
        f"{name:<12} n={len(ttft):<4} TTFT p50 {statistics.median(ttft):7.1f} ms  "
        f"p99 {percentile(ttft, 0.99):7.1f} ms   e2e p50 {statistics.median(e2e):7.1f} ms  "
        f"p99 {percentile(e2e, 0.99):7.1f} ms"
    )


async def run(requests: int, max_tokens: int, workdir: Path) -> None:
    model = build(workdir / "model")
    coordinator = Coordinator(workdir / "coordinator")
    coordinator.start()
    await coordinator.ready()
    prefill = Engine("prefill", model, workdir / "prefill", 0, coordinator.address, "prefill-0")
    decode = Engine("decode", model, workdir / "decode", 1, coordinator.address, "decode-0")
    prefill.start()
    decode.start()
    try:
        await asyncio.gather(prefill.ready(), decode.ready())
        pair = Pair(prefill, decode, coordinator)
        results: dict[bool, tuple[list[float], list[float]]] = {True: ([], []), False: ([], [])}
        async with (
            HandoffClient(coordinator.address) as client,
            httpx.AsyncClient(timeout=60.0) as http,
        ):
            for warm in range(4):  # NIXL handshakes, first-call costs
                await one(pair, client, http, warm % 2 == 0, max_tokens)
            for n in range(requests * 2):
                coordinated = n % 2 == 0
                ttft, e2e = await one(pair, client, http, coordinated, max_tokens)
                results[coordinated][0].append(ttft)
                results[coordinated][1].append(e2e)
        plain, coord = results[False], results[True]
        print(report("plain P/D", *plain))
        print(report("coordinated", *coord))
        for label, index in (("TTFT", 0), ("e2e", 1)):
            cost = statistics.median(coord[index]) - statistics.median(plain[index])
            ratio = statistics.median(coord[index]) / statistics.median(plain[index])
            print(f"coordination cost, {label} p50: {cost:+.1f} ms per request ({ratio:.2f}x)")
        await asyncio.gather(prefill.idle(), decode.idle())
        print("both engines idle by /metrics afterwards")
    finally:
        prefill.stop()
        decode.stop()
        coordinator.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=50, help="of each kind (default 50)")
    parser.add_argument("--max-tokens", type=int, default=16, help="per request (default 16)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-vllm-") as workdir:
        asyncio.run(run(args.requests, args.max_tokens, Path(workdir)))


if __name__ == "__main__":
    main()
