"""EngineSidecar's tombstones, capacities, COMPLETE and fencing, action by action.

The sidecar is real; what it talks to is a scripted transport (the seam
every transport implements), so a test delivers exactly the order a
reconnect can produce: a cancel before the action it cancels, a cancel
while that action's handler runs, a COMPLETE while a handler runs. The
engine counts every block it holds, every acquisition after a free (how a
reordered redelivery leaks) and every double free (two frees of one side
at once, or a free while that side still acquires).

The same failures over a real server are in tests/client/test_sidecar_faults.py.
"""

from __future__ import annotations

import asyncio
import re
from collections import Counter
from collections.abc import AsyncGenerator, Callable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from handoff_client import (
    ACCEPTED,
    APPLIED,
    NOOP,
    SCHEDULED,
    SUBMITTED,
    Action,
    ActionKind,
    Backoff,
    Completion,
    EngineSidecar,
    Facts,
    Outcome,
    OutcomeKind,
    Role,
    new_incarnation,
)
from handoff_client.errors import (
    OlderIncarnationError,
    SessionConflictError,
    UnavailableError,
)
from handoff_client.model import Fact

TIMEOUT_S = 5.0
ENGINE = "engine-0"
QUICK = Backoff(initial_s=0.001, max_s=0.01)

Side = tuple[str, Role]


class ScriptedTransport:
    """Actions a test delivers, outcomes it can wait for; subscriptions it can refuse."""

    def __init__(self, refusals: list[Exception] | None = None) -> None:
        self.actions: asyncio.Queue[Action | Exception] = asyncio.Queue()
        self.outcomes: dict[tuple[str, int], Outcome] = {}
        self.facts: list[tuple[str, Fact]] = []
        self.subscriptions: list[tuple[str, str]] = []  # (incarnation, session id)
        self.refusals = list(refusals or [])
        self._reported = asyncio.Condition()

    def deliver(self, *actions: Action) -> None:
        for action in actions:
            self.actions.put_nowait(action)

    def drop(self) -> None:
        """End the live subscription with UNAVAILABLE, as a network fault would."""
        self.actions.put_nowait(UnavailableError("dropped by the test"))

    def subscribe(
        self,
        engine_id: str,
        on_subscribed: Callable[[], None],
        *,
        incarnation: str,
        session_id: str,
    ) -> AsyncGenerator[Action, None]:
        self.subscriptions.append((incarnation, session_id))
        return self._subscribe(on_subscribed)

    async def _subscribe(self, on_subscribed: Callable[[], None]) -> AsyncGenerator[Action, None]:
        if self.refusals:
            raise self.refusals.pop(0)
        on_subscribed()
        while True:
            item = await self.actions.get()
            if isinstance(item, Exception):
                raise item
            yield item

    async def report_fact(self, handoff_id: str, fact: Fact) -> None:
        self.facts.append((handoff_id, fact))

    async def report_outcome(self, handoff_id: str, action_id: int, outcome: Outcome) -> None:
        async with self._reported:
            self.outcomes[(handoff_id, action_id)] = outcome
            self._reported.notify_all()

    async def outcome(self, handoff_id: str, action_id: int) -> Outcome:
        async with self._reported:
            await self._reported.wait_for(lambda: (handoff_id, action_id) in self.outcomes)
        return self.outcomes[(handoff_id, action_id)]


class CountingEngine:
    """Both sides of a naive engine that holds blocks per (handoff, side).

    It trusts the sidecar for ordering: an acquiring handler allocates
    whatever came before it, so a cancel run first, or in the middle, leaks.
    ``gates`` hold an acquiring handler of a handoff until set.
    """

    BLOCKS = 4

    def __init__(self) -> None:
        self.held: Counter[Side] = Counter()
        self.freed: set[Side] = set()
        self.acquiring: Counter[Side] = Counter()
        self.freeing: set[Side] = set()
        self.acquired_after_free = 0
        self.double_frees = 0
        self.calls: list[Action] = []
        self.completed: list[Action] = []
        self.notified = asyncio.Event()  # a COMPLETE notice reached the engine
        self.gates: dict[str, asyncio.Event] = {}
        self.entered: dict[str, asyncio.Event] = {}

    @property
    def blocks(self) -> int:
        return sum(self.held.values())

    def kinds(self, handoff_id: str) -> list[tuple[ActionKind, int]]:
        return [(a.kind, a.attempt) for a in self.calls if a.handoff_id == handoff_id]

    def gate(self, handoff_id: str) -> asyncio.Event:
        self.entered[handoff_id] = asyncio.Event()
        gate = self.gates[handoff_id] = asyncio.Event()
        return gate

    async def _acquire(self, action: Action, role: Role, outcome: Outcome) -> Outcome:
        self.calls.append(action)
        side = (action.handoff_id, role)
        self.acquiring[side] += 1
        try:
            if action.handoff_id in self.gates:
                self.entered[action.handoff_id].set()
                await self.gates[action.handoff_id].wait()
            if side in self.freed:
                self.acquired_after_free += 1
            self.held[side] += self.BLOCKS
        finally:
            self.acquiring[side] -= 1
        return outcome

    async def _free(self, action: Action, role: Role) -> Outcome:
        self.calls.append(action)
        side = (action.handoff_id, role)
        if side in self.freeing or self.acquiring[side]:
            self.double_frees += 1
        self.freeing.add(side)
        await asyncio.sleep(0)  # a free takes a moment: overlapping ones would show
        self.freeing.discard(side)
        self.freed.add(side)
        return APPLIED if self.held.pop(side, 0) else NOOP

    async def submit_prefill(self, action: Action, facts: Facts) -> Outcome:
        return await self._acquire(action, Role.SOURCE, SUBMITTED)

    async def reserve_destination(self, action: Action, facts: Facts) -> Outcome:
        return await self._acquire(action, Role.DESTINATION, ACCEPTED)

    async def start_transfer(self, action: Action, facts: Facts) -> Outcome:
        self.calls.append(action)
        return SCHEDULED

    async def activate_destination(self, action: Action, facts: Facts) -> Outcome:
        self.calls.append(action)
        return APPLIED

    async def release_source(self, action: Action, facts: Facts) -> Outcome:
        return await self._free(action, Role.SOURCE)

    async def cancel_source(self, action: Action, facts: Facts) -> Outcome:
        return await self._free(action, Role.SOURCE)

    async def cancel_destination(self, action: Action, facts: Facts) -> Outcome:
        return await self._free(action, Role.DESTINATION)

    async def complete(self, action: Action) -> None:
        self.completed.append(action)
        self.notified.set()


class PrefillOnly:
    """A prefill-only engine: its side's handlers, nothing else."""

    async def submit_prefill(self, action: Action, facts: Facts) -> Outcome:
        return SUBMITTED

    async def release_source(self, action: Action, facts: Facts) -> Outcome:
        return NOOP

    async def cancel_source(self, action: Action, facts: Facts) -> Outcome:
        return NOOP

    async def complete(self, action: Action) -> None:
        pass


def act(
    handoff_id: str,
    action_id: int,
    kind: ActionKind,
    *,
    attempt: int = 1,
    completion: Completion | None = None,
) -> Action:
    target = {
        ActionKind.SUBMIT_PREFILL: Role.SOURCE,
        ActionKind.RELEASE_SOURCE: Role.SOURCE,
        ActionKind.CANCEL_SOURCE: Role.SOURCE,
        ActionKind.START_TRANSFER: Role.SOURCE,
        ActionKind.RESERVE_DESTINATION: Role.DESTINATION,
        ActionKind.ACTIVATE_DESTINATION: Role.DESTINATION,
        ActionKind.CANCEL_DESTINATION: Role.DESTINATION,
    }.get(kind, Role.BOTH)
    return Action(handoff_id, action_id, kind, target, ENGINE, attempt, completion=completion)


def sidecar(
    transport: ScriptedTransport, engine: object | None = None, **options: object
) -> EngineSidecar:
    return EngineSidecar(
        transport,
        ENGINE,
        engine or CountingEngine(),  # type: ignore[arg-type]
        reconnect_backoff=QUICK,
        stop_grace_s=0.0,
        **options,  # type: ignore[arg-type]
    )


async def idle(car: EngineSidecar) -> None:
    """Until every task the sidecar started has finished."""
    while car._tasks:
        await asyncio.wait(set(car._tasks))


@pytest.fixture
def transport() -> ScriptedTransport:
    return ScriptedTransport()


@pytest.fixture
def engine() -> CountingEngine:
    return CountingEngine()


async def test_a_cancel_redelivered_ahead_of_its_submit_leaks_nothing(
    transport: ScriptedTransport, engine: CountingEngine
) -> None:
    # The reorder of issue #11: the stream dropped after SubmitPrefill was
    # written, the frontend canceled, and the resubscription got both.
    async with sidecar(transport, engine) as car, asyncio.timeout(TIMEOUT_S):
        transport.deliver(
            act("h", 1, ActionKind.CANCEL_SOURCE),
            act("h", 0, ActionKind.SUBMIT_PREFILL, attempt=2),
        )
        assert await transport.outcome("h", 1) == NOOP
        submit = await transport.outcome("h", 0)
    assert submit.kind is OutcomeKind.FAILED
    assert "already canceled or released" in submit.reason
    assert engine.kinds("h") == [(ActionKind.CANCEL_SOURCE, 1)]  # the submit never ran
    assert engine.blocks == engine.acquired_after_free == 0
    assert car.stats.answered_closed == 1


async def test_a_cancel_interrupts_its_sides_running_handler_then_frees(
    transport: ScriptedTransport, engine: CountingEngine
) -> None:
    engine.gate("h")  # never set: the submit would wait forever
    async with sidecar(transport, engine), asyncio.timeout(TIMEOUT_S):
        transport.deliver(act("h", 0, ActionKind.SUBMIT_PREFILL))
        await engine.entered["h"].wait()
        transport.deliver(act("h", 1, ActionKind.CANCEL_SOURCE))
        # The submit is cancelled (it took nothing), then the cancel runs.
        assert await transport.outcome("h", 1) == NOOP
        submit = await transport.outcome("h", 0)
        assert submit.kind is OutcomeKind.FAILED
        assert "cancelled" in submit.reason
    assert engine.blocks == engine.double_frees == 0
    assert engine.kinds("h") == [(ActionKind.SUBMIT_PREFILL, 1), (ActionKind.CANCEL_SOURCE, 1)]


async def test_a_submit_still_queued_when_its_cancel_comes_never_runs(
    transport: ScriptedTransport, engine: CountingEngine
) -> None:
    stuck = engine.gate("stuck")
    async with sidecar(transport, engine, max_concurrency=1) as car, asyncio.timeout(TIMEOUT_S):
        transport.deliver(act("stuck", 0, ActionKind.SUBMIT_PREFILL))
        await engine.entered["stuck"].wait()
        transport.deliver(
            act("h", 0, ActionKind.SUBMIT_PREFILL), act("h", 1, ActionKind.CANCEL_SOURCE)
        )
        # The cancel does not wait for a submit that never started.
        assert await transport.outcome("h", 1) == NOOP
        stuck.set()
        assert (await transport.outcome("h", 0)).kind is OutcomeKind.FAILED
        await idle(car)
    assert engine.kinds("h") == [(ActionKind.CANCEL_SOURCE, 1)]
    assert engine.held == Counter({("stuck", Role.SOURCE): CountingEngine.BLOCKS})


async def test_cleanup_and_complete_flow_while_every_handler_slot_is_stuck(
    transport: ScriptedTransport, engine: CountingEngine
) -> None:
    gates = [engine.gate(f"stuck-{i}") for i in range(2)]
    async with sidecar(transport, engine, max_concurrency=2) as car, asyncio.timeout(TIMEOUT_S):
        transport.deliver(*(act(f"stuck-{i}", 0, ActionKind.SUBMIT_PREFILL) for i in range(2)))
        await asyncio.gather(*(engine.entered[f"stuck-{i}"].wait() for i in range(2)))
        # Healthy handoffs further on: their cleanups and notices must not queue behind.
        transport.deliver(
            act("queued", 0, ActionKind.SUBMIT_PREFILL),
            act("a", 5, ActionKind.RELEASE_SOURCE),
            act("b", 3, ActionKind.CANCEL_SOURCE),
            act("c", 4, ActionKind.CANCEL_DESTINATION),
            act("d", 7, ActionKind.COMPLETE, completion=Completion.SUCCESS),
        )
        for handoff_id, action_id in (("a", 5), ("b", 3), ("c", 4)):
            assert await transport.outcome(handoff_id, action_id) == NOOP
        await engine.notified.wait()
        assert car.stats.actions_received == 7  # the stream was read to the end
        assert ("queued", 0) not in transport.outcomes
        for gate in gates:
            gate.set()
        assert await transport.outcome("queued", 0) == SUBMITTED


@pytest.mark.parametrize("completion", [Completion.SUCCESS, Completion.CANCELED])
async def test_complete_frees_a_source_still_held(
    transport: ScriptedTransport, engine: CountingEngine, completion: Completion
) -> None:
    # The server declared this engine lost (so no release was owed) while it was alive.
    async with sidecar(transport, engine) as car, asyncio.timeout(TIMEOUT_S):
        transport.deliver(act("h", 0, ActionKind.SUBMIT_PREFILL))
        await transport.outcome("h", 0)
        transport.deliver(act("h", 4, ActionKind.COMPLETE, completion=completion))
        await engine.notified.wait()
    assert engine.blocks == 0
    assert engine.kinds("h")[-1] == (ActionKind.CANCEL_SOURCE, 0)  # the sidecar's own
    assert ("h", 4) not in transport.outcomes  # nothing reported for it
    assert car.stats.freed_on_complete == 1


@pytest.mark.parametrize(
    ("completion", "activated", "freed"),
    [
        (Completion.CANCELED, False, True),
        (Completion.CANCELED, True, False),  # the decode owns the request
        (Completion.SUCCESS, True, False),
    ],
)
async def test_complete_frees_a_destination_only_if_canceled_before_activation(
    transport: ScriptedTransport,
    engine: CountingEngine,
    completion: Completion,
    activated: bool,
    freed: bool,
) -> None:
    async with sidecar(transport, engine), asyncio.timeout(TIMEOUT_S):
        transport.deliver(act("h", 1, ActionKind.RESERVE_DESTINATION))
        await transport.outcome("h", 1)
        if activated:
            transport.deliver(act("h", 3, ActionKind.ACTIVATE_DESTINATION))
            await transport.outcome("h", 3)
        transport.deliver(act("h", 5, ActionKind.COMPLETE, completion=completion))
        await engine.notified.wait()
    assert engine.blocks == (0 if freed else CountingEngine.BLOCKS)
    assert ((ActionKind.CANCEL_DESTINATION, 0) in engine.kinds("h")) is freed


async def test_complete_interrupts_a_running_handler_then_frees(
    transport: ScriptedTransport, engine: CountingEngine
) -> None:
    engine.gate("h")  # never set
    async with sidecar(transport, engine), asyncio.timeout(TIMEOUT_S):
        transport.deliver(act("h", 0, ActionKind.SUBMIT_PREFILL))
        await engine.entered["h"].wait()
        transport.deliver(act("h", 2, ActionKind.COMPLETE, completion=Completion.CANCELED))
        await engine.notified.wait()
        # A redelivery after the notice runs nothing.
        transport.deliver(act("h", 0, ActionKind.SUBMIT_PREFILL, attempt=2))
        assert (await transport.outcome("h", 0)).kind is OutcomeKind.FAILED
    assert engine.blocks == engine.double_frees == engine.acquired_after_free == 0
    assert [kind for kind, _ in engine.kinds("h")] == [
        ActionKind.SUBMIT_PREFILL,
        ActionKind.CANCEL_SOURCE,
    ]


async def test_an_unknown_action_kind_is_skipped_and_counted(
    transport: ScriptedTransport, engine: CountingEngine, caplog: pytest.LogCaptureFixture
) -> None:
    async with sidecar(transport, engine) as car, asyncio.timeout(TIMEOUT_S):
        transport.deliver(act("h", 0, ActionKind.UNKNOWN), act("h", 1, ActionKind.SUBMIT_PREFILL))
        assert await transport.outcome("h", 1) == SUBMITTED
    assert car.stats.unknown_actions == 1
    assert car.stats.reconnects == 0
    assert ("h", 0) not in transport.outcomes
    assert "does not know" in caplog.text


async def test_a_one_sided_engine_fails_the_other_sides_work_clearly(
    transport: ScriptedTransport, caplog: pytest.LogCaptureFixture
) -> None:
    async with sidecar(transport, PrefillOnly()) as car, asyncio.timeout(TIMEOUT_S):
        transport.deliver(act("h", 1, ActionKind.RESERVE_DESTINATION))
        reserve = await transport.outcome("h", 1)
        transport.deliver(
            act("h", 2, ActionKind.CANCEL_DESTINATION), act("h", 3, ActionKind.SUBMIT_PREFILL)
        )
        assert await transport.outcome("h", 2) == NOOP  # a cleanup may not fail
        assert await transport.outcome("h", 3) == SUBMITTED
    assert reserve.kind is OutcomeKind.FAILED
    assert f"engine {ENGINE} does not implement reserve_destination" == reserve.reason
    assert car.stats.unimplemented == 2
    assert "has no reserve_destination handler" in caplog.text


async def test_an_older_incarnation_frees_everything_and_stops(engine: CountingEngine) -> None:
    refused = OlderIncarnationError("engine engine-0: incarnation A is older than live B")
    transport = ScriptedTransport()
    car = sidecar(transport, engine)
    async with car, asyncio.timeout(TIMEOUT_S):
        transport.deliver(
            act("held", 0, ActionKind.SUBMIT_PREFILL),
            act("reserved", 1, ActionKind.RESERVE_DESTINATION),
            act("released", 0, ActionKind.SUBMIT_PREFILL),
            act("released", 3, ActionKind.RELEASE_SOURCE),
        )
        await transport.outcome("released", 3)
        await transport.outcome("reserved", 1)
        await transport.outcome("held", 0)
        # The stream drops; the resubscription is refused as older.
        transport.refusals.append(refused)
        transport.drop()
        with pytest.raises(OlderIncarnationError, match="older than live"):
            await car.wait()
        with pytest.raises(OlderIncarnationError):
            await car.wait_subscribed()
    assert engine.blocks == 0
    assert sorted(a.kind.name for a in engine.calls if a.attempt == 0) == [
        "CANCEL_DESTINATION",
        "CANCEL_SOURCE",
    ]
    assert len(transport.subscriptions) == 2  # no retry after the refusal


async def test_a_session_conflict_is_retried_until_the_twin_is_gone(
    caplog: pytest.LogCaptureFixture,
) -> None:
    conflict = SessionConflictError("engine engine-0: incarnation A is live in another session")
    transport = ScriptedTransport(refusals=[conflict, conflict])
    async with sidecar(transport) as car, asyncio.timeout(TIMEOUT_S):
        await car.wait_subscribed()
    assert car.stats.session_conflicts == 2
    assert "another live sidecar" in caplog.text
    assert len(set(transport.subscriptions)) == 1  # the same incarnation and session each time


def test_incarnations_sort_by_start_and_sessions_are_per_sidecar() -> None:
    first = new_incarnation()
    assert re.fullmatch(r"\d{13}-[0-9a-f]{16}", first)
    assert new_incarnation()[:13] >= first[:13]
    one, two = sidecar(ScriptedTransport()), sidecar(ScriptedTransport())
    assert one.incarnation != two.incarnation
    assert one.session_id != two.session_id
    given = sidecar(ScriptedTransport(), incarnation="1764547200000-engine")
    assert given.incarnation == "1764547200000-engine"


async def test_the_subscription_names_incarnation_and_session(transport: ScriptedTransport) -> None:
    async with sidecar(transport, incarnation="1764547200000-abc") as car:
        async with asyncio.timeout(TIMEOUT_S):
            await car.wait_subscribed()
    assert transport.subscriptions == [("1764547200000-abc", car.session_id)]


# --- any order, any interleaving --------------------------------------------------

# One handoff's deliveries to an engine that is both its source and its
# destination: each acquiring action, each cancel (either may come twice),
# and the COMPLETE notice of a canceled handoff.
DELIVERIES = (
    (0, ActionKind.SUBMIT_PREFILL),
    (1, ActionKind.RESERVE_DESTINATION),
    (2, ActionKind.ACTIVATE_DESTINATION),
    (3, ActionKind.CANCEL_SOURCE),
    (4, ActionKind.CANCEL_DESTINATION),
    (5, ActionKind.COMPLETE),
)


class SlowCountingEngine(CountingEngine):
    """Acquiring handlers take a drawn number of loop turns, so cancels land mid-way."""

    def __init__(self, turns: list[int]) -> None:
        super().__init__()
        self._turns = turns

    async def _acquire(self, action: Action, role: Role, outcome: Outcome) -> Outcome:
        self.calls.append(action)
        side = (action.handoff_id, role)
        self.acquiring[side] += 1
        try:
            for _ in range(self._turns.pop() if self._turns else 0):
                await asyncio.sleep(0)
            if side in self.freed:
                self.acquired_after_free += 1
            self.held[side] += self.BLOCKS
        finally:
            self.acquiring[side] -= 1
        return outcome


@st.composite
def schedules(draw: st.DrawFn) -> tuple[list[tuple[str, int, ActionKind]], list[int], list[int]]:
    """Deliveries of three handoffs in any order (some twice), with pauses and handler lengths."""
    deliveries = [(f"h{n}", action_id, kind) for n in range(3) for action_id, kind in DELIVERIES]
    deliveries += draw(st.lists(st.sampled_from(deliveries), max_size=6))  # redeliveries
    order = draw(st.permutations(deliveries))
    pauses = draw(st.lists(st.integers(0, 3), min_size=len(order), max_size=len(order)))
    turns = draw(st.lists(st.integers(0, 4), max_size=len(order)))
    return list(order), pauses, turns


@settings(max_examples=150, deadline=None)
@given(schedules())
def test_no_order_of_deliveries_leaks_or_frees_twice(
    schedule: tuple[list[tuple[str, int, ActionKind]], list[int], list[int]],
) -> None:
    deliveries, pauses, turns = schedule

    async def run() -> SlowCountingEngine:
        transport, engine = ScriptedTransport(), SlowCountingEngine(turns)
        car = sidecar(transport, engine)
        async with car, asyncio.timeout(TIMEOUT_S):
            for (handoff_id, action_id, kind), pause in zip(deliveries, pauses, strict=True):
                completion = Completion.CANCELED if kind is ActionKind.COMPLETE else None
                transport.deliver(act(handoff_id, action_id, kind, completion=completion))
                for _ in range(pause):
                    await asyncio.sleep(0)
            while transport.actions.qsize() or car._tasks:
                await asyncio.sleep(0)
                await idle(car)
        return engine

    engine = asyncio.run(run())
    assert engine.blocks == 0, engine.held
    assert engine.double_frees == 0
    assert engine.acquired_after_free == 0
