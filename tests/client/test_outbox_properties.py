"""The outbox's ordering rule, over a wire that keeps order, under any faults.

The rule (docs/sdk.md, "Order"): the server handles a handoff's reports
first in the order the engine made them, and each report's future ends, in
that order, once it landed. On an ordered wire (a Connect stream) a report
goes out behind the previous one before that one's ack, but only on the
same stream; a report whose stream was cut, or whose ack came too late,
goes again and takes every report behind it along, after it.

The wire is scripted (the seam ConnectTransport implements: ``Sent.on`` is
the stream, the server handles each stream's reports in order), so
hypothesis can cut streams, lose acks and expire deadlines at every point.
The same rule over a real server is in tests/client/test_sidecar_connect.py.
"""

from __future__ import annotations

import asyncio
import random
from collections import defaultdict
from typing import Literal

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from handoff_client import Backoff
from handoff_client.errors import (
    DeadlineExceededError,
    FailedPreconditionError,
    UnavailableError,
)
from handoff_client.outbox import Outbox, Report, Sent, landing

TIMEOUT_S = 10.0
NOW = Backoff(initial_s=1e-6, max_s=1e-6)
HANDOFFS = ("h-0", "h-1")

Item = tuple[str, int]  # (handoff, its report's index in the order made)


class Stream:
    def __init__(self) -> None:
        self.live = True
        self.unhandled: list[tuple[Item, asyncio.Future[None]]] = []
        self.unacked: list[asyncio.Future[None]] = []


class Wire:
    """Streams one at a time; the test's server handles and acknowledges in order."""

    def __init__(self) -> None:
        self.stream = Stream()
        self.opened = asyncio.Event()
        self.opened.set()
        self.handled: list[Item] = []
        self.refuse: set[Item] = set()
        self.messages = 0  # sends that found nothing unhandled on the stream before them

    def report(self, item: Item) -> Report:
        async def send(after: Sent | None) -> Sent:
            if after is not None and (after.on is not self.stream or not self.stream.live):
                raise UnavailableError("the report before it is on a stream that ended")
            while not self.stream.live:  # as ConnectTransport waits for a live stream
                await self.opened.wait()
            stream = self.stream
            if not stream.unhandled:
                self.messages += 1
            landed: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            stream.unhandled.append((item, landed))
            return Sent(landed, stream)

        return send

    def handle(self, count: int) -> None:
        stream = self.stream
        for item, landed in stream.unhandled[:count]:
            self.handled.append(item)
            if item in self.refuse and not landed.done():
                landed.set_exception(FailedPreconditionError(f"{item} refused"))
            else:
                stream.unacked.append(landed)
        del stream.unhandled[:count]

    def ack(self, count: int) -> None:
        stream = self.stream
        for landed in stream.unacked[:count]:
            if not landed.done():  # not expired meanwhile
                landed.set_result(None)
        del stream.unacked[:count]

    def cut(self) -> None:
        stream = self.stream
        if not stream.live:
            return
        stream.live = False
        self.opened.clear()
        for landed in [*stream.unacked, *(landed for _, landed in stream.unhandled)]:
            if not landed.done():
                landed.set_exception(UnavailableError("cut"))

    def reopen(self) -> None:
        if not self.stream.live:
            self.stream = Stream()
            self.opened.set()

    def expire(self, which: int) -> None:
        """The deadline of one unanswered report passes (the server may still handle it)."""
        waiting = [
            landed
            for landed in [*self.stream.unacked, *(landed for _, landed in self.stream.unhandled)]
            if not landed.done()
        ]
        if waiting:
            waiting[which % len(waiting)].set_exception(DeadlineExceededError("late"))


async def settle() -> None:
    """Let every task run until it waits on the wire (no time passes)."""
    for _ in range(20):
        await asyncio.sleep(0)


# (what happens, how many or which, whether the tasks run before the next step:
# without, two steps land in one turn of the loop, as a cut and a report can)
Step = tuple[Literal["report", "handle", "ack", "cut", "reopen", "expire"], int, bool]
steps = st.lists(
    st.tuples(
        st.sampled_from(["report", "report", "handle", "ack", "cut", "reopen", "expire"]),
        st.integers(min_value=0, max_value=3),
        st.booleans(),
    ),
    max_size=40,
)


async def play(program: list[Step]) -> tuple[Wire, dict[str, list[int]], dict[str, int]]:
    wire = Wire()
    outbox = Outbox(NOW, random.Random(0))
    made: dict[str, int] = defaultdict(int)
    landed_order: dict[str, list[int]] = defaultdict(list)
    futures: list[asyncio.Future[None]] = []

    def make(handoff_id: str) -> None:
        index = made[handoff_id]
        made[handoff_id] += 1
        future = outbox.send(handoff_id, wire.report((handoff_id, index)))

        def landed(_: asyncio.Future[None]) -> None:
            landed_order[handoff_id].append(index)

        future.add_done_callback(landed)
        futures.append(future)

    for step, n, then_settle in program:
        if step == "report":
            make(HANDOFFS[n % 2])
        elif step == "handle":
            wire.handle(n)
        elif step == "ack":
            wire.ack(n)
        elif step == "cut":
            wire.cut()
        elif step == "reopen":
            wire.reopen()
        else:
            wire.expire(n)
        if then_settle:
            await settle()
    # Then the network heals: everything is handled and acknowledged.
    wire.reopen()
    while not all(future.done() for future in futures):
        wire.handle(1000)
        wire.ack(1000)
        await settle()
    for future in futures:
        assert future.result() is None
    await outbox.close(0)
    return wire, landed_order, made


@settings(max_examples=300, deadline=None)
@given(steps)
def test_reports_are_first_handled_and_land_in_the_order_made(program: list[Step]) -> None:
    async def run() -> None:
        wire, landed_order, made = await play(program)
        for handoff_id, count in made.items():
            # Each report lands, its future in the order made.
            assert landed_order[handoff_id] == list(range(count))
            # The server first handled each one after every earlier one: none overtook.
            first: list[int] = []
            for handled_id, index in wire.handled:
                if handled_id == handoff_id and index not in first:
                    first.append(index)
            assert first == list(range(count))

    asyncio.run(asyncio.wait_for(run(), TIMEOUT_S))


async def test_an_outcome_and_the_fact_after_it_share_one_message() -> None:
    async with asyncio.timeout(TIMEOUT_S):
        wire = Wire()
        outbox = Outbox(NOW, random.Random(0))
        outcome = outbox.send("h-0", wire.report(("h-0", 0)))
        fact = outbox.send("h-0", wire.report(("h-0", 1)))
        await settle()
        # Both on the stream before any answer: one message, not a round trip apart.
        assert [item for item, _ in wire.stream.unhandled] == [("h-0", 0), ("h-0", 1)]
        assert wire.messages == 1
        wire.handle(2)
        wire.ack(2)
        await asyncio.gather(outcome, fact)
        await outbox.close(0)


async def test_a_refused_report_fails_alone_and_the_next_goes_on() -> None:
    async with asyncio.timeout(TIMEOUT_S):
        wire = Wire()
        wire.refuse.add(("h-0", 0))
        outbox = Outbox(NOW, random.Random(0))
        refused = outbox.send("h-0", wire.report(("h-0", 0)))
        after = outbox.send("h-0", wire.report(("h-0", 1)))
        await settle()
        wire.handle(2)
        wire.ack(2)
        with pytest.raises(FailedPreconditionError):
            await refused
        await after
        assert wire.handled == [("h-0", 0), ("h-0", 1)]  # refused once, never sent again
        await outbox.close(0)


async def test_over_an_unordered_transport_each_report_waits_for_the_one_before() -> None:
    async with asyncio.timeout(TIMEOUT_S):
        calls: list[str] = []
        first_lands = asyncio.Event()

        async def first() -> None:
            calls.append("first sent")
            await first_lands.wait()
            calls.append("first landed")

        async def second() -> None:
            calls.append("second sent")

        outbox = Outbox(NOW, random.Random(0))
        landings = [outbox.send("h-0", landing(first)), outbox.send("h-0", landing(second))]
        await settle()
        assert calls == ["first sent"]
        first_lands.set()
        await asyncio.gather(*landings)
        assert calls == ["first sent", "first landed", "second sent"]
        await outbox.close(0)
