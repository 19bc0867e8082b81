"""Load generation over plain grpc.aio stubs: a frontend and zero-work engines.

The same code drives the real service and the floor stub (bench/floor.py), so
the two differ only in what the server does. A frontend starts handoffs with
StartHandoff; each engine answers every action the moment it arrives:

- path "stream": one Connect stream per engine; reports go out on it without
  waiting for their acks (the stream keeps them in order). As the SDK's
  sidecar does, the reports ready at once share one message and the server
  packs its acks and actions (``ConnectHello.batch``), acks without the
  handoff (``lean_acks``); ``batch=False`` sends one item per message and
  takes full acks, as a plain Connect client would;
- path "unary": one StreamActions stream per engine; each report is a
  ReportOutcome / ReportFact call, the fact only after its outcome's answer.

Latencies are measured here, in the client, with one monotonic clock:
handoff latency is StartHandoff sent -> the last Complete received;
fact-to-action is fact sent -> the action it caused received by its engine.
Both include the client's own queueing, so they bound the server's share.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, TypeAlias

import grpc

from handoff_client.placement import place
from handoff_proto.v1 import coordinator_pb2 as pb
from handoff_proto.v1 import coordinator_pb2_grpc as pb_grpc

if TYPE_CHECKING:  # the async stub type exists only for the type checker
    Stub = pb_grpc.HandoffCoordinatorAsyncStub

# What a zero-work engine reports for each action: an outcome, then maybe a
# fact. The transfer executor (the source) reports TransferCompleted itself.
HELD = pb.Fact(
    source_held=pb.SourceHeld(
        transfer_timing=pb.TransferTiming(
            mode=pb.TRANSFER_TIMING_MODE_FULL_PROMPT,
            full_prompt_tokens=2048,
            kv_bytes_per_token=131072,
            bandwidth_gb_s=50.0,
        )
    )
)
RESERVED = pb.Fact(destination_reserved=pb.DestinationReserved(transferable_prompt_tokens=2048))
TRANSFERRED = pb.Fact(transfer_completed=pb.TransferCompleted())
OutcomeKind: TypeAlias = pb.OutcomeKind.ValueType
ANSWERS: dict[int, tuple[OutcomeKind, pb.Fact | None]] = {
    pb.ACTION_KIND_SUBMIT_PREFILL: (pb.OUTCOME_KIND_SUBMITTED, HELD),
    pb.ACTION_KIND_RESERVE_DESTINATION: (pb.OUTCOME_KIND_ACCEPTED, RESERVED),
    pb.ACTION_KIND_START_TRANSFER: (pb.OUTCOME_KIND_SCHEDULED, TRANSFERRED),
    pb.ACTION_KIND_ACTIVATE_DESTINATION: (pb.OUTCOME_KIND_APPLIED, None),
    pb.ACTION_KIND_RELEASE_SOURCE: (pb.OUTCOME_KIND_APPLIED, None),
    pb.ACTION_KIND_CANCEL_SOURCE: (pb.OUTCOME_KIND_APPLIED, None),
    pb.ACTION_KIND_CANCEL_DESTINATION: (pb.OUTCOME_KIND_APPLIED, None),
}
# The fact each answer carries, by name: the first half of a hop's label.
FACT_OF = {
    pb.ACTION_KIND_SUBMIT_PREFILL: "SourceHeld",
    pb.ACTION_KIND_RESERVE_DESTINATION: "DestinationReserved",
    pb.ACTION_KIND_START_TRANSFER: "TransferCompleted",
}
ACTION_NAME = {
    kind: pb.ActionKind.Name(kind).removeprefix("ACTION_KIND_").title().replace("_", "")
    for kind in pb.ActionKind.values()
}
COMPLETE = pb.ACTION_KIND_COMPLETE
ORDERS = (pb.HANDOFF_ORDER_SOURCE_FIRST, pb.HANDOFF_ORDER_DESTINATION_FIRST)
DRAIN_S = 30.0  # how long in-flight handoffs may take to finish after the window


@dataclass(frozen=True)
class LoadSpec:
    target: str  # host:port
    path: str  # "stream" or "unary"
    pairs: int = 4  # source engines and destination engines, each
    concurrency: int = 128  # handoffs in flight (closed loop)
    duration_s: float = 10.0  # measured window
    warmup_s: float = 2.0  # before the window; nothing recorded
    rate: float | None = None  # handoffs/s started at a fixed pace (open loop) when set
    count: int | None = None  # stop after this many handoffs (then no window)
    frontend_only: bool = False  # no engines: each handoff stays started, its first action queued
    shard: int = 0  # engine ids are distinct per shard, so shards never share a stream
    batch: bool = True  # stream path: several items per Connect message, lean acks
    # Sharded: the placing shards' names, and the one ``target`` is. The
    # frontend starts only ids that shard wins (a routing client sends the
    # others elsewhere), so each load process drives one shard.
    shard_names: tuple[str, ...] = ()
    shard_name: str = ""


@dataclass
class LoadResult:
    started: int = 0
    completed: int = 0  # inside the window (all of them with ``count``)
    total_completed: int = 0  # warm-up and drain included: what the server's CPU paid for
    window_s: float = 0.0
    handoff_s: list[float] = field(default_factory=list)
    fact_to_action_s: list[float] = field(default_factory=list)
    # The same samples by hop, "SourceHeld → ReserveDestination": the critical
    # path from a prefill's end to its decode's start, one hop at a time.
    hops: dict[str, list[float]] = field(default_factory=dict)
    rejected: int = 0  # StartHandoff refusals and rejected reports; should stay 0
    unfinished: int = 0  # still in flight when the drain gave up
    skipped: int = 0  # open-loop starts not made: a second's worth was already in flight
    client_cpu_s: float = 0.0
    # gRPC messages the load wrote and read (requests and responses, each stream
    # message or unary call counted once), warm-up and drain included, the
    # streams' openings not: per handoff, over ``total_completed``.
    sent: int = 0
    received: int = 0


class Flight:
    """One handoff the frontend started, until its Completes arrive."""

    __slots__ = ("started_at", "fact_at", "fact", "completes", "done")

    def __init__(self, completes: int, done: asyncio.Future[None]) -> None:
        self.started_at = time.perf_counter()
        self.fact_at: float | None = None
        self.fact = ""  # the name of the fact sent at ``fact_at``
        self.completes = completes
        self.done = done


class Book:
    """What is in flight, and the samples taken while ``recording``."""

    def __init__(self, result: LoadResult) -> None:
        self.flights: dict[str, Flight] = {}
        self.result = result
        self.recording = False
        self.counting = True  # count completions (the window, or every one with ``count``)

    def finish(self, handoff_id: str, flight: Flight) -> None:
        del self.flights[handoff_id]
        if self.recording:
            self.result.handoff_s.append(time.perf_counter() - flight.started_at)
        if self.counting:
            self.result.completed += 1
        self.result.total_completed += 1
        if not flight.done.done():  # canceled when the drain gave up on it
            flight.done.set_result(None)


class Engine:
    """A zero-work engine: every action is answered at once with the allowed outcome."""

    def __init__(self, stub: Stub, engine_id: str, book: Book) -> None:
        self.stub = stub
        self.engine_id = engine_id
        self.book = book

    def on_action(self, action: pb.Action) -> None:
        book = self.book
        flight = book.flights.get(action.handoff_id)
        if flight is None:
            return  # a redelivery after the frontend stopped caring
        if action.kind == COMPLETE:
            flight.completes -= 1
            if flight.completes == 0:
                book.finish(action.handoff_id, flight)
            return
        if flight.fact_at is not None:
            if book.recording:
                took = time.perf_counter() - flight.fact_at
                book.result.fact_to_action_s.append(took)
                hop = f"{flight.fact} → {ACTION_NAME[action.kind]}"
                book.result.hops.setdefault(hop, []).append(took)
            flight.fact_at = None
        outcome, fact = ANSWERS[action.kind]
        if fact is not None:
            flight.fact = FACT_OF[action.kind]
        self.report(action.handoff_id, action.id, outcome, fact, flight)

    def report(
        self,
        handoff_id: str,
        action_id: int,
        outcome: OutcomeKind,
        fact: pb.Fact | None,
        flight: Flight,
    ) -> None:
        raise NotImplementedError

    async def open(self) -> None:
        raise NotImplementedError

    async def close(self) -> None:
        raise NotImplementedError


class StreamEngine(Engine):
    """Reports and actions on one Connect stream; one request iterator keeps reports in order."""

    def __init__(self, stub: Stub, engine_id: str, book: Book, batch: bool) -> None:
        super().__init__(stub, engine_id, book)
        self.batch = batch
        self.hello = pb.ConnectHello(
            engine_id=engine_id, batch=batch, lean_acks=batch, heartbeats=True
        )
        self.pending = pb.ConnectRequest()  # batched: the reports of the next message
        self.singles: deque[pb.ConnectRequest] = deque()  # unbatched: one message each
        self.wake = asyncio.Event()
        self.unacked = 0
        self.acked = asyncio.Event()
        self.closing = False
        self.next_request = 0
        self.call = stub.Connect(self._requests())
        self.reader: asyncio.Task[None] | None = None

    async def open(self) -> None:
        await self.call.initial_metadata()  # the server sends headers once subscribed
        self.reader = asyncio.create_task(self._read())

    def report(
        self,
        handoff_id: str,
        action_id: int,
        outcome: OutcomeKind,
        fact: pb.Fact | None,
        flight: Flight,
    ) -> None:
        answer = pb.ReportOutcomeRequest(
            handoff_id=handoff_id, action_id=action_id, outcome=pb.Outcome(kind=outcome)
        )
        self.next_request += 1
        if self.batch:
            self.pending.reports.add(request_id=self.next_request, outcome=answer)
        else:
            self.singles.append(pb.ConnectRequest(request_id=self.next_request, outcome=answer))
        self.unacked += 1
        if fact is not None:
            observed = pb.ReportFactRequest(handoff_id=handoff_id, fact=fact)
            self.next_request += 1
            if self.batch:
                self.pending.reports.add(request_id=self.next_request, fact=observed)
            else:
                self.singles.append(pb.ConnectRequest(request_id=self.next_request, fact=observed))
            self.unacked += 1
            flight.fact_at = time.perf_counter()
        self.wake.set()

    async def _requests(self) -> AsyncIterator[pb.ConnectRequest]:
        yield pb.ConnectRequest(hello=self.hello)
        while True:
            # Cleared before looking, never after a yield: a report queued
            # while a message was being written must not be slept through.
            self.wake.clear()
            if self.pending.reports:
                message, self.pending = self.pending, pb.ConnectRequest()
                self.book.result.sent += 1
                yield message
                continue
            while self.singles:
                self.book.result.sent += 1
                yield self.singles.popleft()
            if self.closing:
                return  # the half-close
            await self.wake.wait()

    async def _read(self) -> None:
        async for response in self.call:
            self.book.result.received += 1
            acks = list(response.acks)
            if response.HasField("ack"):
                acks.append(response.ack)
            for ack in acks:
                if ack.code != 0:
                    self.book.result.rejected += 1
            self.unacked -= len(acks)
            if self.unacked == 0:
                self.acked.set()
            for action in response.actions:
                self.on_action(action)
            if response.HasField("action"):
                self.on_action(response.action)

    async def settle(self) -> None:
        """Until every report sent so far is acknowledged."""
        while self.unacked > 0:
            self.acked.clear()
            await self.acked.wait()

    async def close(self) -> None:
        await self.settle()
        self.closing = True
        self.wake.set()
        if self.reader is not None:
            await self.reader  # the server ends the stream after the half-close


class UnaryEngine(Engine):
    """Actions on StreamActions; each report is its own unary call."""

    def __init__(self, stub: Stub, engine_id: str, book: Book) -> None:
        super().__init__(stub, engine_id, book)
        self.call = stub.StreamActions(
            pb.StreamActionsRequest(engine_id=engine_id, heartbeats=True)
        )
        self.reports: set[asyncio.Task[None]] = set()
        self.reader: asyncio.Task[None] | None = None

    async def open(self) -> None:
        await self.call.initial_metadata()
        self.reader = asyncio.create_task(self._read())

    async def _read(self) -> None:
        with contextlib.suppress(asyncio.CancelledError):
            async for action in self.call:
                self.book.result.received += 1
                self.on_action(action)

    def report(
        self,
        handoff_id: str,
        action_id: int,
        outcome: OutcomeKind,
        fact: pb.Fact | None,
        flight: Flight,
    ) -> None:
        task = asyncio.create_task(self._report(handoff_id, action_id, outcome, fact, flight))
        self.reports.add(task)
        task.add_done_callback(self.reports.discard)

    async def _report(
        self,
        handoff_id: str,
        action_id: int,
        outcome: OutcomeKind,
        fact: pb.Fact | None,
        flight: Flight,
    ) -> None:
        result = self.book.result
        try:
            result.sent += 1
            await self.stub.ReportOutcome(
                pb.ReportOutcomeRequest(
                    handoff_id=handoff_id, action_id=action_id, outcome=pb.Outcome(kind=outcome)
                )
            )
            result.received += 1
            if fact is not None:
                flight.fact_at = time.perf_counter()
                result.sent += 1
                await self.stub.ReportFact(pb.ReportFactRequest(handoff_id=handoff_id, fact=fact))
                result.received += 1
        except grpc.aio.AioRpcError:
            self.book.result.rejected += 1

    async def close(self) -> None:
        while self.reports:
            await asyncio.gather(*self.reports)
        self.call.cancel()
        if self.reader is not None:
            await self.reader


class Frontend:
    """Starts handoffs alternating both orders over the engine pairs."""

    def __init__(self, stub: Stub, spec: LoadSpec, book: Book) -> None:
        self.stub = stub
        self.spec = spec
        self.book = book
        self.sequence = 0
        self.stopping = False

    async def one(self) -> None:
        index = self.sequence
        self.sequence += 1
        spec, book = self.spec, self.book
        pair = index % spec.pairs
        handoff_id = self.new_id()
        flight = Flight(2, asyncio.get_running_loop().create_future())
        book.flights[handoff_id] = flight
        book.result.started += 1
        book.result.sent += 1
        try:
            await self.stub.StartHandoff(
                pb.StartHandoffRequest(
                    handoff_id=handoff_id,
                    order=ORDERS[index & 1],
                    source_engine_id=f"prefill-{spec.shard}-{pair}",
                    destination_engine_id=f"decode-{spec.shard}-{pair}",
                    fallback_transfer_delay_ms=1.0,
                )
            )
        except grpc.aio.AioRpcError:
            book.result.rejected += 1
            book.flights.pop(handoff_id, None)
            return
        book.result.received += 1
        if spec.frontend_only:
            book.finish(handoff_id, flight)
        await flight.done

    def new_id(self) -> str:
        """A new id this frontend's shard wins (any new id when unsharded)."""
        names, mine = self.spec.shard_names, self.spec.shard_name
        while True:
            handoff_id = str(uuid.uuid4())
            if not names or place(handoff_id, names) == mine:
                return handoff_id

    async def closed_loop(self) -> None:
        """Keep ``concurrency`` handoffs in flight until stopped (or ``count`` started)."""
        limit = self.spec.count

        async def worker() -> None:
            while not self.stopping and (limit is None or self.sequence < limit):
                await self.one()

        await asyncio.gather(*(worker() for _ in range(self.spec.concurrency)))

    async def open_loop(self, rate: float) -> None:
        """Start handoffs at ``rate`` per second, whether or not earlier ones finished.

        At most one second's worth may be in flight: if the machine stalls (it
        is shared), starts are skipped and counted rather than piled up, so a
        soak measures the server's memory, not an unbounded backlog.
        """
        flying: set[asyncio.Task[None]] = set()
        cap = max(64, int(rate))
        began = time.perf_counter()
        launched = 0
        while not self.stopping:
            due = int((time.perf_counter() - began) * rate)
            for _ in range(due - launched):
                if len(flying) >= cap:
                    self.book.result.skipped += 1
                    continue
                task = asyncio.create_task(self.one())
                flying.add(task)
                task.add_done_callback(flying.discard)
            launched = max(launched, due)
            await asyncio.sleep(0.002)
        if flying:
            await asyncio.gather(*flying)


async def run(spec: LoadSpec) -> LoadResult:
    result = LoadResult()
    book = Book(result)
    cpu_before = os.times()
    # One channel per role, as separate frontend and sidecar processes would have.
    async with (
        grpc.aio.insecure_channel(spec.target) as frontend_channel,
        grpc.aio.insecure_channel(spec.target) as engine_channel,
    ):
        engine_stub: Stub = pb_grpc.HandoffCoordinatorStub(engine_channel)
        engines: list[Engine] = [
            StreamEngine(engine_stub, engine_id, book, spec.batch)
            if spec.path == "stream"
            else UnaryEngine(engine_stub, engine_id, book)
            for pair in range(0 if spec.frontend_only else spec.pairs)
            for role in ("prefill", "decode")
            for engine_id in [f"{role}-{spec.shard}-{pair}"]
        ]
        for engine in engines:
            await engine.open()
        frontend = Frontend(pb_grpc.HandoffCoordinatorStub(frontend_channel), spec, book)
        if spec.count is not None:
            began = time.perf_counter()
            await frontend.closed_loop()
            result.window_s = time.perf_counter() - began
        else:
            book.counting = False
            load = asyncio.create_task(
                frontend.open_loop(spec.rate) if spec.rate else frontend.closed_loop()
            )
            await asyncio.sleep(spec.warmup_s)
            book.recording = book.counting = True
            began = time.perf_counter()
            await asyncio.sleep(spec.duration_s)
            book.recording = book.counting = False
            result.window_s = time.perf_counter() - began
            frontend.stopping = True
            # wait_for cancels the load if the drain gives up; what is left is counted.
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(load, DRAIN_S)
        result.unfinished = len(book.flights)
        for flight in book.flights.values():
            flight.done.cancel()
        for engine in engines:
            await engine.close()
    cpu_after = os.times()
    result.client_cpu_s = (cpu_after.user - cpu_before.user) + (
        cpu_after.system - cpu_before.system
    )
    return result


def run_in_process(spec: LoadSpec) -> LoadResult:
    """Entry point for a load process (multiprocessing, spawn)."""
    return asyncio.run(run(spec))
