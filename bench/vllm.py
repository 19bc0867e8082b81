"""What coordination costs a real vLLM P/D request: TTFT and end-to-end, p50 and p99.

One coordinator, one prefill and one decode vLLM with HandoffConnector (the
tiny test model, tests/vllm/model.py), and two `handoff proxy` processes in
front of the same two engines: one **coordinated** (StartHandoff, the legs
with the handoff id: the decode waits for StartTransfer and
ActivateDestination) and one `--no-coordinator` (**plain** vLLM P/D: the same
two legs without a handoff id, which the connector leaves to NIXL alone).
Requests alternate between the two, one at a time, in one run, so drift and
noise fall on both. Every prompt is new (no prefix-cache hits). TTFT is from
sending the request to the first streamed token; e2e to the last.

    make bench-vllm            # .venv-vllm/bin/python -m bench.vllm
    .venv-vllm/bin/python -m bench.vllm --requests 60 --max-tokens 16

Figures go in bench/RESULTS.md with the command that made them.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

import httpx

from tests.vllm.model import build
from tests.vllm.support import Coordinator, Engine, LegError, Proxy


async def one(proxy: Proxy, http: httpx.AsyncClient, max_tokens: int) -> tuple[float, float]:
    prompt = f"Benchmark request {uuid.uuid4().hex}: the coordinator decides when"
    first: list[float] = []
    start = time.perf_counter()
    await proxy.complete(
        http, prompt, max_tokens, stream=True, first=lambda: first.append(time.perf_counter())
    )
    done = time.perf_counter()
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
    proxies: dict[bool, Proxy] = {}
    try:
        await asyncio.gather(prefill.ready(), decode.ready())
        proxies = {
            True: Proxy(workdir / "proxy", coordinator.address, prefill, decode),
            False: Proxy(workdir / "proxy-plain", None, prefill, decode),
        }
        for proxy in proxies.values():
            proxy.start()
        await asyncio.gather(*(proxy.ready() for proxy in proxies.values()))
        results: dict[bool, tuple[list[float], list[float]]] = {True: ([], []), False: ([], [])}
        async with httpx.AsyncClient(timeout=60.0) as http:
            for warm in range(4):  # NIXL handshakes, first-call costs
                await one(proxies[warm % 2 == 0], http, max_tokens)
            failures: dict[bool, list[str]] = {True: [], False: []}
            for n in range(requests * 2):
                if n % 20 == 0:
                    print(f"request {n} of {requests * 2}", file=sys.stderr, flush=True)
                coordinated = n % 2 == 0
                try:
                    ttft, e2e = await one(proxies[coordinated], http, max_tokens)
                except LegError as error:  # counted and shown: a figure without it would lie
                    failures[coordinated].append(str(error))
                    print(f"request {n} failed: {error}", file=sys.stderr, flush=True)
                    continue
                results[coordinated][0].append(ttft)
                results[coordinated][1].append(e2e)
        plain, coord = results[False], results[True]
        print(report("plain P/D", *plain))  # handoff proxy --no-coordinator
        print(report("coordinated", *coord))
        for coordinated, name in ((False, "plain P/D"), (True, "coordinated")):
            print(f"{name} failed: {len(failures[coordinated])}")
        for label, index in (("TTFT", 0), ("e2e", 1)):
            cost = statistics.median(coord[index]) - statistics.median(plain[index])
            ratio = statistics.median(coord[index]) / statistics.median(plain[index])
            print(f"coordination cost, {label} p50: {cost:+.1f} ms per request ({ratio:.2f}x)")
        await asyncio.gather(prefill.idle(), decode.idle())
        print("both engines idle by /metrics afterwards")
    finally:
        for proxy in proxies.values():
            proxy.stop()
        prefill.stop()
        decode.stop()
        coordinator.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=50, help="of each kind (default 50)")
    parser.add_argument("--max-tokens", type=int, default=16, help="per request (default 16)")
    parser.add_argument("--workdir", type=Path, help="keep logs here (default: a temporary one)")
    args = parser.parse_args()
    if args.workdir is not None:
        asyncio.run(run(args.requests, args.max_tokens, args.workdir))
        return
    with tempfile.TemporaryDirectory(prefix="bench-vllm-") as workdir:
        asyncio.run(run(args.requests, args.max_tokens, Path(workdir)))


if __name__ == "__main__":
    main()
