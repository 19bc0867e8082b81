"""Messages per handoff, each direction, counted where the coordinator reads and writes them.

gRPC costs about the same per message whatever it carries, so the message
count is what the service's CPU per handoff follows. It is deterministic
when handoffs run one at a time (nothing to share a message with), so this
counts them so: a real server in this process, whose servicer methods are
wrapped to count every request message read and every response message
written, per RPC; engines that answer at once; one handoff at a time,
alternating both orders, the full success path.

Two kinds of engine drive it, on both paths:

- ``sdk``: the SDK's ``EngineSidecar`` (ConnectTransport or UnaryTransport),
  the facts reported from a task the handler started, as the README's
  engine does;
- ``bench``: the plain-stub engines of ``bench/load.py`` that ``bench.service``
  measures (the outcome and its fact in one message on Connect).

Heartbeats are off the count (the heartbeat interval is an hour). Startup
(hellos, reconcile, shard map) is not counted: only what the handoffs cost.

Run: .venv/bin/python -m bench.messages [--handoffs 100] [--concurrency 128]
"""

from __future__ import annotations

import argparse
import asyncio
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Callable
from typing import Any

from bench.load import LoadSpec, run
from handoff_client import (
    ACCEPTED,
    APPLIED,
    SCHEDULED,
    SUBMITTED,
    Action,
    EngineSidecar,
    Facts,
    HandoffClient,
    Order,
    Outcome,
    TimingMode,
    TransferTiming,
)
from handoff_proto.v1 import coordinator_pb2 as pb
from handoff_server.ops.config import Settings
from handoff_server.service.app import Server
from handoff_server.service.servicer import Servicer

UNARY = ("StartHandoff", "ReportFact", "ReportOutcome", "GetHandoff", "Reconcile", "GetShardMap")

Count = Counter[tuple[str, str]]  # (rpc, "in" | "out") -> messages


def _is_heartbeat(message: Any) -> bool:
    if isinstance(message, pb.Action):
        return message.kind == pb.ACTION_KIND_HEARTBEAT
    if isinstance(message, pb.ConnectResponse):
        items = [*message.actions, *([message.action] if message.HasField("action") else [])]
        return (
            bool(items)
            and not message.acks
            and all(action.kind == pb.ACTION_KIND_HEARTBEAT for action in items)
        )
    return False


def _counted(servicer: Servicer, count: Count) -> Servicer:
    """``servicer`` with every RPC counting its messages (bound before gRPC sees it)."""

    def unary(name: str, method: Callable[..., Any]) -> Callable[..., Any]:
        async def counted(request: Any, context: Any) -> Any:
            count[name, "in"] += 1
            response = await method(request, context)
            count[name, "out"] += 1
            return response

        return counted

    def written(name: str, responses: AsyncIterator[Any]) -> AsyncIterator[Any]:
        async def counted() -> AsyncIterator[Any]:
            async for response in responses:
                if not _is_heartbeat(response):
                    count[name, "out"] += 1
                yield response

        return counted()

    def server_stream(name: str, method: Callable[..., Any]) -> Callable[..., Any]:
        def counted(request: Any, context: Any) -> AsyncIterator[Any]:
            count[name, "in"] += 1
            return written(name, method(request, context))

        return counted

    def bidi(name: str, method: Callable[..., Any]) -> Callable[..., Any]:
        def counted(requests: AsyncIterator[Any], context: Any) -> AsyncIterator[Any]:
            async def read() -> AsyncIterator[Any]:
                async for request in requests:
                    count[name, "in"] += 1
                    yield request

            return written(name, method(read(), context))

        return counted

    for name in UNARY:
        setattr(servicer, name, unary(name, getattr(servicer, name)))
    servicer.StreamActions = server_stream("StreamActions", servicer.StreamActions)  # type: ignore[method-assign]
    servicer.Connect = bidi("Connect", servicer.Connect)  # type: ignore[method-assign]
    return servicer


class CountingServer(Server):
    def __init__(self, settings: Settings, count: Count) -> None:
        super().__init__(settings)
        self.count = count

    def _servicer(self) -> Servicer:
        return _counted(super()._servicer(), self.count)


class ZeroWorkEngine:
    """Both roles; every action answered at once, facts from a task the handler started."""

    def __init__(self) -> None:
        self.completes: dict[str, asyncio.Future[None]] = {}
        self._tasks: set[asyncio.Task[None]] = set()

    def _later(self, report: Any) -> None:
        task = asyncio.ensure_future(report)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def submit_prefill(self, action: Action, facts: Facts) -> Outcome:
        timing = TransferTiming(TimingMode.FULL_PROMPT, 2048, 131072, 50.0)
        self._later(facts.source_held(action.handoff_id, timing))
        return SUBMITTED

    async def reserve_destination(self, action: Action, facts: Facts) -> Outcome:
        self._later(facts.destination_reserved(action.handoff_id, 2048))
        return ACCEPTED

    async def start_transfer(self, action: Action, facts: Facts) -> Outcome:
        self._later(facts.transfer_completed(action.handoff_id))
        return SCHEDULED

    async def activate_destination(self, action: Action, facts: Facts) -> Outcome:
        return APPLIED

    async def release_source(self, action: Action, facts: Facts) -> Outcome:
        return APPLIED

    async def cancel_source(self, action: Action, facts: Facts) -> Outcome:
        return APPLIED

    async def cancel_destination(self, action: Action, facts: Facts) -> Outcome:
        return APPLIED

    async def complete(self, action: Action) -> None:
        done = self.completes.get(action.handoff_id)
        if done is not None and not done.done():
            done.set_result(None)


async def _sdk(target: str, transport: str, handoffs: int, server: CountingServer) -> Count:
    source, destination = ZeroWorkEngine(), ZeroWorkEngine()
    async with (
        HandoffClient(target, timeout_s=10.0) as client,
        EngineSidecar(client, "prefill-0", source, transport=transport) as s,  # type: ignore[arg-type]
        EngineSidecar(client, "decode-0", destination, transport=transport) as d,  # type: ignore[arg-type]
    ):
        await s.wait_subscribed()
        await d.wait_subscribed()
        await asyncio.sleep(0.1)  # the reconciles after subscribing
        before = Counter(server.count)
        for index in range(handoffs):
            handoff_id = str(uuid.uuid4())
            loop = asyncio.get_running_loop()
            ends = [loop.create_future(), loop.create_future()]
            source.completes[handoff_id], destination.completes[handoff_id] = ends
            await client.start_handoff(
                handoff_id,
                order=(Order.SOURCE_FIRST, Order.DESTINATION_FIRST)[index & 1],
                source_engine_id="prefill-0",
                destination_engine_id="decode-0",
                fallback_transfer_delay_ms=0.0,
            )
            await asyncio.gather(*ends)
            await asyncio.sleep(0.01)  # the last acks
        await asyncio.sleep(0.1)
        return server.count - before


async def _bench(
    target: str, path: str, handoffs: int, server: CountingServer, concurrency: int
) -> Count:
    before = Counter(server.count)
    pairs = 1 if concurrency == 1 else 4  # as bench.service runs under load
    spec = LoadSpec(
        target=target,
        path=path,
        pairs=pairs,
        concurrency=concurrency,
        count=handoffs,
        warmup_s=0,
    )
    result = await run(spec)
    if result.rejected or result.completed != handoffs:
        raise RuntimeError(f"the load went wrong: {result}")
    # Opening the engines' streams is startup: one request each (the hello or
    # the subscription), not a handoff's.
    count = server.count - before
    count["Connect" if path == "stream" else "StreamActions", "in"] -= 2 * pairs
    return count


async def measure(engines: str, path: str, handoffs: int, concurrency: int = 1) -> Count:
    count: Count = Counter()
    settings = Settings(
        host="127.0.0.1", port=0, metrics_port=0, drain_grace_s=0.1, heartbeat_s=3600.0
    )
    server = CountingServer(settings, count)
    await server.start()
    try:
        target = f"127.0.0.1:{server.port}"
        if engines == "sdk":
            transport = "connect" if path == "stream" else "unary"
            return await _sdk(target, transport, handoffs, server)
        return await _bench(target, path, handoffs, server, concurrency)
    finally:
        await server.stop()


def _row(engines: str, path: str, count: Count, handoffs: int) -> str:
    into = sum(n for (_, way), n in count.items() if way == "in") / handoffs
    out = sum(n for (_, way), n in count.items() if way == "out") / handoffs
    parts = ", ".join(
        f"{rpc} {count[rpc, 'in'] / handoffs:g}/{count[rpc, 'out'] / handoffs:g}"
        for rpc in sorted({rpc for rpc, _ in count})
        if count[rpc, "in"] or count[rpc, "out"]
    )
    return f"| {engines} | {path} | {into:g} | {out:g} | {into + out:g} | {parts} |"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--handoffs", type=int, default=100, help="per row, one at a time")
    parser.add_argument(
        "--concurrency",
        type=int,
        default=0,
        help="also count the bench's engines with this many handoffs in flight (4 pairs): "
        "messages then carry several handoffs' items, so the count depends on timing",
    )
    args = parser.parse_args()
    print(f"messages per handoff, {args.handoffs} handoffs one at a time, both orders alternating")
    print("| engines | path | engine→server | server→engine | total | per RPC (in/out) |")
    print("|---|---|---|---|---|---|")
    for engines in ("sdk", "bench"):
        for path in ("stream", "unary"):
            count = asyncio.run(measure(engines, path, args.handoffs))
            print(_row(engines, path, count, args.handoffs), flush=True)
    if args.concurrency:
        print(f"\nthe bench's engines, {args.concurrency} in flight over 4 pairs")
        for path in ("stream", "unary"):
            count = asyncio.run(measure("bench", path, args.handoffs, args.concurrency))
            print(_row("bench", path, count, args.handoffs), flush=True)


if __name__ == "__main__":
    main()
