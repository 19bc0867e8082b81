"""The load generator: plays the frontend/router that starts and cancels handoffs.

Each handoff is one "journey": pick a stack and two live engines, start the
handoff, maybe cancel it mid-flight, wait until it completes, maybe cancel it
during decode (which reopens it), and wait again. Completion is learned from
the engines' COMPLETE notices, with GetHandoff as the truth (a notice can be
lost with a dropped stream, so a quiet wait falls back to polling).
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import uuid
from collections.abc import Callable
from dataclasses import dataclass

from handoff_client.client import HandoffClient
from handoff_client.errors import HandoffRpcError, NotFoundError
from handoff_client.model import (
    Completion,
    EngineType,
    Handoff,
    LifecycleEventKind,
    Phase,
    Role,
)
from handoff_client.sim.cluster import Cluster
from handoff_client.sim.config import SimConfig
from handoff_client.sim.workload import RequestBook, draw_request

POLL_S = 1.0  # how long a journey waits for a notice before asking the server
FALLBACK_TRANSFER_DELAY_MS = 5.0


class Notices:
    """COMPLETE notices from the engines, as per-handoff wake-ups."""

    def __init__(self) -> None:
        self._events: dict[str, asyncio.Event] = {}

    def watch(self, handoff_id: str) -> asyncio.Event:
        return self._events.setdefault(handoff_id, asyncio.Event())

    def notify(self, handoff_id: str) -> None:
        event = self._events.get(handoff_id)
        if event is not None:
            event.set()

    def forget(self, handoff_id: str) -> None:
        self._events.pop(handoff_id, None)


@dataclass(frozen=True, slots=True)
class Journey:
    """What happened to one handoff, from the frontend's side."""

    handoff_id: str
    stack: EngineType
    source_engine_id: str
    destination_engine_id: str
    canceled_in_flight: bool  # the frontend canceled it at a random point in its prefill
    canceled_in_decode: bool  # ... or once it succeeded, reopening it
    final: Handoff | None  # None: the server abandoned it
    finished: bool  # False: still not complete when the run ended

    @property
    def latency_s(self) -> float | None:
        """Start to first completion, by the server's clock."""
        if self.final is None or self.final.started_at is None:
            return None
        completed = self.final.first(LifecycleEventKind.COMPLETED)
        return None if completed is None else (completed - self.final.started_at).total_seconds()


@dataclass(slots=True)
class _Trip:
    """A journey while it runs (mutable); frozen into a :class:`Journey`."""

    handoff_id: str
    stack: EngineType
    source: str
    destination: str
    canceled_in_flight: bool = False
    canceled_in_decode: bool = False
    final: Handoff | None = None
    finished: bool = False

    def journey(self) -> Journey:
        return Journey(
            self.handoff_id,
            self.stack,
            self.source,
            self.destination,
            self.canceled_in_flight,
            self.canceled_in_decode,
            self.final,
            self.finished,
        )


def _complete(handoff: Handoff) -> bool:
    return handoff.phase is Phase.COMPLETE


def _canceled(handoff: Handoff) -> bool:
    return handoff.phase is Phase.COMPLETE and handoff.completion is Completion.CANCELED


@dataclass(slots=True)
class Counters:
    """Live totals for the progress line; mutable, owned by the frontend."""

    started: int = 0
    refused: int = 0  # StartHandoff refused (limits, shutdown)
    finished: int = 0
    success: int = 0
    canceled: int = 0
    abandoned: int = 0

    @property
    def in_flight(self) -> int:
        return self.started - self.finished


class Frontend:
    def __init__(
        self,
        client: HandoffClient,
        cluster: Cluster,
        book: RequestBook,
        notices: Notices,
        config: SimConfig,
        rng: random.Random,
    ) -> None:
        self._client = client
        self._cluster = cluster
        self._book = book
        self._notices = notices
        self._config = config
        self._rng = rng
        self._journeys: dict[str, Journey] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._crashes: list[BaseException] = []
        self.counters = Counters()

    async def generate(self) -> float:
        """Start handoffs until the duration or count is reached; returns the seconds it took.

        Open loop at ``rate`` (Poisson arrivals), never more than
        ``concurrency`` in flight; ``rate`` 0 keeps ``concurrency`` in flight.
        """
        load = self._config.load
        loop = asyncio.get_running_loop()
        began = loop.time()
        slots = asyncio.Semaphore(load.concurrency)
        count = 0
        while not (0 < load.max_handoffs <= count):
            elapsed = loop.time() - began
            if 0 < load.duration_s <= elapsed:
                break
            await slots.acquire()
            task = asyncio.create_task(self._journey())
            self._tasks.add(task)
            task.add_done_callback(self._finished)
            task.add_done_callback(lambda _: slots.release())
            count += 1
            if load.rate > 0:
                await asyncio.sleep(self._rng.expovariate(load.rate))
        return loop.time() - began

    async def settle(self, timeout_s: float) -> list[Journey]:
        """Wait (``timeout_s`` at most) for the journeys to finish; returns all of them.

        A journey that crashed is a bug in the simulator, not a result: it is raised.
        """
        pending = set(self._tasks)
        if pending:
            await asyncio.wait(pending, timeout=timeout_s)
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        if self._crashes:
            raise self._crashes[0]
        return list(self._journeys.values())

    def _finished(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and (error := task.exception()) is not None:
            self._crashes.append(error)

    async def _journey(self) -> None:
        rng = self._rng
        load = self._config.load
        stack = rng.choice(load.stacks)
        trip = _Trip(
            handoff_id=str(uuid.uuid4()),
            stack=stack,
            source=rng.choice(self._cluster.routable(stack, Role.SOURCE)).engine_id,
            destination=rng.choice(self._cluster.routable(stack, Role.DESTINATION)).engine_id,
        )
        request = draw_request(stack, load, self._config.engine, rng)
        self._book.add(trip.handoff_id, request)
        notice = self._notices.watch(trip.handoff_id)
        try:
            await self._client.start_handoff(
                trip.handoff_id,
                engine_type=stack,
                source_engine_id=trip.source,
                destination_engine_id=trip.destination,
                fallback_transfer_delay_ms=FALLBACK_TRANSFER_DELAY_MS,
                transfer_executor=request.transfer_executor,
                handoff_timeout_s=load.handoff_timeout_s,
            )
        except HandoffRpcError:
            self.counters.refused += 1
            self._notices.forget(trip.handoff_id)
            return
        self.counters.started += 1
        self._journeys[trip.handoff_id] = trip.journey()
        canceler = None
        if rng.random() < load.cancel_fraction:
            # Somewhere within the prefill: when users usually give up.
            prefill_ms = (
                request.prompt_tokens / 1000.0 * self._config.engine.prefill_ms_per_1k_tokens
            )
            delay_s = rng.uniform(0.0, 1.5 * prefill_ms / 1000.0 * self._config.time_scale)
            canceler = asyncio.create_task(self._cancel_in_flight(trip, delay_s))
        try:
            trip.final = await self._until(trip.handoff_id, notice, _complete)
            if (
                trip.final is not None
                and trip.final.completion is Completion.SUCCESS
                and rng.random() < load.cancel_after_success_fraction
                and await self._cancel(trip.handoff_id, "client disconnected during decode")
            ):
                trip.canceled_in_decode = True
                trip.final = await self._until(trip.handoff_id, notice, _canceled)
            trip.finished = True
        except asyncio.CancelledError:
            # The run ended first: keep what the server says now.
            with contextlib.suppress(HandoffRpcError):
                trip.final = await self._client.get_handoff(trip.handoff_id)
            raise
        finally:
            if canceler is not None:
                canceler.cancel()
            self._notices.forget(trip.handoff_id)
            self._journeys[trip.handoff_id] = trip.journey()
        self._count(trip.final)

    def _count(self, final: Handoff | None) -> None:
        counters = self.counters
        counters.finished += 1
        if final is None:
            counters.abandoned += 1
        elif final.completion is Completion.SUCCESS:
            counters.success += 1
        else:
            counters.canceled += 1

    async def _until(
        self, handoff_id: str, notice: asyncio.Event, done: Callable[[Handoff], bool]
    ) -> Handoff | None:
        """The handoff once ``done``; None if the server abandoned it.

        An abandoned handoff is answered with ``abandoned`` set while it is
        retained, and NOT_FOUND after that (or by a server that keeps none).
        """
        while True:
            notice.clear()
            try:
                handoff = await self._client.get_handoff(handoff_id)
            except NotFoundError:
                return None
            if handoff.abandoned:
                return None
            if done(handoff):
                return handoff
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(POLL_S):
                    await notice.wait()

    async def _cancel_in_flight(self, trip: _Trip, delay_s: float) -> None:
        await asyncio.sleep(delay_s)
        trip.canceled_in_flight = await self._cancel(trip.handoff_id, "client went away")

    async def _cancel(self, handoff_id: str, reason: str) -> bool:
        try:
            await self._client.cancel(handoff_id, reason)
        except HandoffRpcError:
            return False  # gone already (abandoned); nothing to cancel
        return True
