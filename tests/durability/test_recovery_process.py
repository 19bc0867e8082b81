"""A real `handoff serve --state-dir` killed with -9 mid-flight, restarted on its dir.

Scripted engines (StreamActions plus unary reports, over real gRPC) hold
"KV" for each handoff and park it at a chosen step, so that when the server
is killed 240 handoffs are spread over every phase: both orders, each step
of the way, canceled ones cleaning up, retained successes, and reopened
successes cleaning up. The server is restarted on the same state dir and
port; the engines reconnect, resend what was not acknowledged, and go on.
Every handoff must end as in a crash-free run of the same script, with no
report refused, nothing held, and nothing freed twice.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import subprocess
import uuid
from collections import Counter, defaultdict
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

import grpc
import pytest

from handoff_proto.v1 import coordinator_pb2 as pb
from handoff_proto.v1 import coordinator_pb2_grpc as pb_grpc
from tests.support.fakes import free_port
from tests.support.processes import serve_process

T = TypeVar("T")
K = pb.ActionKind
PREFILLS = ["prefill-0", "prefill-1"]
DECODES = ["decode-0", "decode-1"]
RETRYABLE = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED}
TIMING = pb.TransferTiming(
    mode=pb.TRANSFER_TIMING_MODE_FULL_PROMPT,
    full_prompt_tokens=512,
    kv_bytes_per_token=1024,
    bandwidth_gb_s=100.0,
)
# Where a handoff is parked when the server dies: (action kind, before its
# outcome or before the fact that follows it), or a scenario of the frontend.
STALLS: list[tuple[str, int, str]] = [
    ("park", K.ACTION_KIND_SUBMIT_PREFILL, "outcome"),
    ("park", K.ACTION_KIND_SUBMIT_PREFILL, "fact"),
    ("park", K.ACTION_KIND_RESERVE_DESTINATION, "outcome"),
    ("park", K.ACTION_KIND_RESERVE_DESTINATION, "fact"),
    ("park", K.ACTION_KIND_START_TRANSFER, "outcome"),
    ("park", K.ACTION_KIND_START_TRANSFER, "fact"),
    ("park", K.ACTION_KIND_ACTIVATE_DESTINATION, "outcome"),
    ("park", K.ACTION_KIND_RELEASE_SOURCE, "outcome"),
    ("retained", 0, ""),  # complete before the crash
    ("cancel", 0, ""),  # canceled once its first action is out; its cleanup parked
    ("reopen", 0, ""),  # canceled after success; the decode's cancel parked
    ("fail", K.ACTION_KIND_START_TRANSFER, "outcome"),  # the transfer fails; cleanup parked
]
CLEANUP = (K.ACTION_KIND_CANCEL_SOURCE, K.ACTION_KIND_CANCEL_DESTINATION)


@dataclass
class Plan:
    order: int
    scenario: str
    kind: int
    stage: str
    source: str
    destination: str


@dataclass
class Ledger:
    """What the engines hold and freed, and what the server refused."""

    held: set[tuple[str, str]] = field(default_factory=set)
    freed: Counter[tuple[str, str]] = field(default_factory=Counter)
    aborted: set[tuple[str, str]] = field(default_factory=set)
    refused: list[str] = field(default_factory=list)
    parked: set[str] = field(default_factory=set)

    def acquire(self, handoff_id: str, side: str) -> None:
        if (handoff_id, side) not in self.aborted:
            self.held.add((handoff_id, side))

    def free(self, handoff_id: str, side: str) -> bool:
        self.aborted.add((handoff_id, side))
        if (handoff_id, side) not in self.held:
            return False
        self.held.discard((handoff_id, side))
        self.freed[(handoff_id, side)] += 1
        return True


async def persist(call: Callable[[], Awaitable[T]], ledger: Ledger, what: str) -> T | None:
    """At least once: retry through the restart; any other refusal is recorded."""
    while True:
        try:
            return await call()
        except grpc.aio.AioRpcError as error:
            if error.code() in RETRYABLE:
                await asyncio.sleep(0.05)
                continue
            ledger.refused.append(f"{what}: {error.code().name} {error.details()}")
            return None


class Engine:
    """One scripted engine: executes each action once, answers redeliveries alike."""

    def __init__(
        self, engine_id: str, stub: pb_grpc.HandoffCoordinatorAsyncStub, world: World
    ) -> None:
        self.engine_id = engine_id
        self.stub = stub
        self.world = world
        self.done: dict[tuple[str, int], asyncio.Task[None]] = {}
        self.headers: list[dict[str, str]] = []

    async def run(self) -> None:
        while True:
            stream = self.stub.StreamActions(
                pb.StreamActionsRequest(engine_id=self.engine_id), wait_for_ready=True
            )
            try:
                metadata = await stream.initial_metadata()
                self.headers.append({k: str(v) for k, v in metadata})
                self.world.subscribed.add(self.engine_id)
                if len(self.world.subscribed) == len(PREFILLS + DECODES):
                    self.world.all_subscribed.set()
                async for action in stream:
                    self.world.delivered[action.handoff_id].set()
                    key = (action.handoff_id, action.id)
                    if action.kind == K.ACTION_KIND_COMPLETE:
                        if self.engine_id == self.world.plans[action.handoff_id].destination:
                            await self.world.completed(action.handoff_id)
                    elif key not in self.done:
                        self.done[key] = asyncio.create_task(self.execute(action))
            except grpc.aio.AioRpcError as error:
                if error.code() not in RETRYABLE:
                    raise
            await asyncio.sleep(0.05)

    async def execute(self, action: pb.Action) -> None:
        world, h, kind = self.world, action.handoff_id, action.kind
        plan = world.plans[h]
        parked = plan.kind == kind or (
            plan.scenario in ("cancel", "reopen", "fail") and kind in CLEANUP
        )
        if plan.scenario == "fail" and kind == plan.kind:
            await self.outcome(action, pb.OUTCOME_KIND_FAILED, "transfer link down")
            return
        if parked and plan.stage in ("outcome", ""):
            await world.park(h)
        ledger = world.ledger
        if kind == K.ACTION_KIND_SUBMIT_PREFILL:
            await self.outcome(action, pb.OUTCOME_KIND_SUBMITTED)
            if parked and plan.stage == "fact":
                await world.park(h)
            ledger.acquire(h, "source")
            await self.fact(h, pb.Fact(source_held=pb.SourceHeld(transfer_timing=TIMING)))
        elif kind == K.ACTION_KIND_RESERVE_DESTINATION:
            ledger.acquire(h, "destination")
            await self.outcome(action, pb.OUTCOME_KIND_ACCEPTED)
            if parked and plan.stage == "fact":
                await world.park(h)
            reserved = pb.DestinationReserved(transferable_prompt_tokens=512)
            await self.fact(h, pb.Fact(destination_reserved=reserved))
        elif kind == K.ACTION_KIND_START_TRANSFER:
            await self.outcome(action, pb.OUTCOME_KIND_SCHEDULED)
            if parked and plan.stage == "fact":
                await world.park(h)
            await self.fact(h, pb.Fact(transfer_completed=pb.TransferCompleted()))
        elif kind == K.ACTION_KIND_ACTIVATE_DESTINATION:
            # From here the decode owns the request; its reservation is its own.
            ledger.free(h, "destination")
            ledger.acquire(h, "decode")
            world.decodes.add(h)
            await self.outcome(action, pb.OUTCOME_KIND_APPLIED)
        elif kind in (K.ACTION_KIND_RELEASE_SOURCE, K.ACTION_KIND_CANCEL_SOURCE):
            freed = ledger.free(h, "source")
            await self.outcome(action, pb.OUTCOME_KIND_APPLIED if freed else pb.OUTCOME_KIND_NOOP)
        elif kind == K.ACTION_KIND_CANCEL_DESTINATION:
            freed = ledger.free(h, "destination") | ledger.free(h, "decode")
            await self.outcome(action, pb.OUTCOME_KIND_APPLIED if freed else pb.OUTCOME_KIND_NOOP)

    async def outcome(self, action: pb.Action, kind: int, reason: str = "") -> None:
        request = pb.ReportOutcomeRequest(
            handoff_id=action.handoff_id,
            action_id=action.id,
            outcome=pb.Outcome(kind=kind, reason=reason),  # type: ignore[arg-type]
        )
        await persist(
            lambda: self.stub.ReportOutcome(request, timeout=5, wait_for_ready=True),
            self.world.ledger,
            f"{action.handoff_id} outcome of {pb.ActionKind.Name(action.kind)}",
        )

    async def fact(self, handoff_id: str, fact: pb.Fact) -> None:
        request = pb.ReportFactRequest(handoff_id=handoff_id, fact=fact)
        await persist(
            lambda: self.stub.ReportFact(request, timeout=5, wait_for_ready=True),
            self.world.ledger,
            f"{handoff_id} fact {fact.WhichOneof('kind')}",
        )


class World:
    def __init__(self, count: int) -> None:
        self.ledger = Ledger()
        self.resume = asyncio.Event()
        self.decodes: set[str] = set()
        self.plans: dict[str, Plan] = {}
        for i in range(count):
            scenario, kind, stage = STALLS[(i // 2) % len(STALLS)]
            self.plans[str(uuid.UUID(int=i + 1))] = Plan(
                pb.HANDOFF_ORDER_SOURCE_FIRST if i % 2 else pb.HANDOFF_ORDER_DESTINATION_FIRST,
                scenario,
                kind,
                stage,
                PREFILLS[i % 2],
                DECODES[(i // 3) % 2],
            )

        self.all_parked = asyncio.Event()
        # Every engine subscribed before any handoff starts: a cancel for a side
        # whose first action never reached a stream is settled by the server
        # (NOOP, nothing held), so that handoff would never park.
        self.subscribed: set[str] = set()
        self.all_subscribed = asyncio.Event()
        # A handoff's first action reached an engine's stream. Canceled any
        # sooner, the server withdraws that action instead (nothing held).
        self.delivered: defaultdict[str, asyncio.Event] = defaultdict(asyncio.Event)
        self.notices: Counter[str] = Counter()  # Complete notices, per handoff
        self.noticed = asyncio.Condition()

    async def park(self, handoff_id: str) -> None:
        self.ledger.parked.add(handoff_id)
        if self.ledger.parked == {h for h, p in self.plans.items() if p.scenario != "retained"}:
            self.all_parked.set()
        await self.resume.wait()

    async def completed(self, handoff_id: str) -> None:
        async with self.noticed:
            self.notices[handoff_id] += 1
            self.noticed.notify_all()

    async def until_complete(self, handoff_id: str, times: int = 1) -> None:
        async with self.noticed:
            await self.noticed.wait_for(lambda: self.notices[handoff_id] >= times)


async def frontend(stub: pb_grpc.HandoffCoordinatorAsyncStub, world: World, h: str) -> None:
    plan = world.plans[h]
    start = pb.StartHandoffRequest(
        handoff_id=h,
        order=plan.order,  # type: ignore[arg-type]
        source_engine_id=plan.source,
        destination_engine_id=plan.destination,
        fallback_transfer_delay_ms=1.0,
        timeout_s=600.0,
    )
    await persist(lambda: stub.StartHandoff(start, wait_for_ready=True), world.ledger, h)
    canceled = pb.ReportFactRequest(handoff_id=h, fact=pb.Fact(canceled=pb.Canceled()))
    if plan.scenario == "cancel":
        await world.delivered[h].wait()
        await persist(lambda: stub.ReportFact(canceled, wait_for_ready=True), world.ledger, h)
    elif plan.scenario == "reopen":
        await world.until_complete(h)
        await persist(lambda: stub.ReportFact(canceled, wait_for_ready=True), world.ledger, h)


async def view(stub: pb_grpc.HandoffCoordinatorAsyncStub, h: str) -> pb.Handoff:
    request = pb.GetHandoffRequest(handoff_id=h)
    response = await stub.GetHandoff(request, timeout=10, wait_for_ready=True)
    return response.handoff


def serve(port: int, state_dir: Path, log: Path) -> subprocess.Popen[bytes]:
    return serve_process(port, log, "--state-dir", str(state_dir))


@contextlib.asynccontextmanager
async def engines(
    port: int, world: World
) -> AsyncIterator[tuple[pb_grpc.HandoffCoordinatorAsyncStub, list[Engine]]]:
    # Retries here are the test's own, so the channel must not add its own.
    async with grpc.aio.insecure_channel(
        f"127.0.0.1:{port}", options=[("grpc.enable_retries", 0)]
    ) as channel:
        stub = pb_grpc.HandoffCoordinatorStub(channel)
        fleet = [Engine(e, stub, world) for e in PREFILLS + DECODES]
        tasks = [asyncio.create_task(engine.run()) for engine in fleet]
        try:
            yield stub, fleet
        finally:
            for task in tasks:
                task.cancel()
            for engine in fleet:
                for job in engine.done.values():
                    job.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)


async def run(
    tmp: Path, count: int, crash: bool
) -> tuple[dict[str, tuple[int, int]], World, Counter[int], str]:
    """Drive ``count`` handoffs to their parking spots; crash (or not); let them finish."""
    port, state_dir, log = free_port(), tmp / "state", tmp / "serve.log"
    world = World(count)
    server = serve(port, state_dir, log)
    try:
        async with engines(port, world) as (stub, fleet):
            async with asyncio.timeout(60):
                await world.all_subscribed.wait()
            await asyncio.gather(*(frontend(stub, world, h) for h in world.plans))
            try:
                async with asyncio.timeout(90):
                    await world.all_parked.wait()
            except TimeoutError:
                unparked = Counter(
                    p.scenario
                    for h, p in world.plans.items()
                    if p.scenario != "retained" and h not in world.ledger.parked
                )
                pytest.fail(f"handoffs never reached their parking spot, by scenario: {unparked}")
            for h, plan in world.plans.items():
                if plan.scenario == "retained":
                    await world.until_complete(h)
            phases: Counter[int] = Counter([(await view(stub, h)).phase for h in world.plans])
            if crash:
                server.send_signal(signal.SIGKILL)
                server.wait(10)
                server = serve(port, state_dir, log)
            world.resume.set()
            finals: dict[str, tuple[int, int]] = {}
            try:
                async with asyncio.timeout(90):
                    for h, plan in world.plans.items():
                        await world.until_complete(h, 2 if plan.scenario == "reopen" else 1)
                        handoff = await view(stub, h)
                        finals[h] = (handoff.phase, handoff.completion)
            except TimeoutError:
                late = Counter(world.plans[h].scenario for h in world.plans if h not in finals)
                pytest.fail(f"handoffs unfinished 90 s after resuming, by scenario: {late}")
            for engine in fleet:
                assert engine.headers, engine.engine_id
                incarnations = [int(hd["handoff-coordinator-incarnation"]) for hd in engine.headers]
                assert incarnations == sorted(incarnations)
                assert len(set(incarnations)) == (2 if crash else 1)
                assert engine.headers[-1]["handoff-recovered"] == ("true" if crash else "false")
                assert engine.headers[-1]["handoff-delivery-timeout-ms"] == "10000"
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(30)
    # Decodes end on their own once activated; the rest must all be freed.
    world.ledger.held -= {(h, "decode") for h in world.decodes}
    return finals, world, phases, log.read_text()


@pytest.mark.slow
@pytest.mark.timeout(300)
async def test_kill_9_with_240_handoffs_in_flight_then_restart_on_the_state_dir(
    tmp_path: Path,
) -> None:
    count = 240
    (tmp_path / "control").mkdir()
    (tmp_path / "crash").mkdir()
    expected, _, _, _ = await run(tmp_path / "control", count, crash=False)
    finals, world, phases, log = await run(tmp_path / "crash", count, crash=True)

    assert phases[pb.PHASE_ACTIVE] >= 100
    assert phases[pb.PHASE_CLEANING_UP] >= 40
    assert phases[pb.PHASE_COMPLETE] >= 20
    assert f"recovered {count} handoffs" in log
    assert finals == expected
    assert Counter(c for _, c in finals.values())[pb.COMPLETION_CANCELED] >= 40
    assert world.ledger.refused == []
    assert world.ledger.held == set()
    assert max(world.ledger.freed.values()) == 1
