"""The ledger under the lease and reconcile, for any order of events (Hypothesis).

A real EngineSidecar over a scripted transport that also leases and
reconciles (tests/client/test_sidecar_ordering.py's, plus a Liveness it stamps and
a Reconcile the test answers). Handoffs' acquiring actions, cancels,
releases and COMPLETE notices arrive in a drawn order, mixed with lease
expiries (the transport goes silent) and reconciles that release drawn
sides. Whatever the order: no side is freed twice, an activated decode is
never freed by the sidecar on its own, nothing is acquired after a free,
and every side the engine held is freed exactly once by whichever of
cancel, release, COMPLETE, lease or reconcile came first.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Callable

from hypothesis import given, settings
from hypothesis import strategies as st

from handoff_client import Action, ActionKind, Completion, EngineSidecar, Outcome, Role
from handoff_client.client import Side
from handoff_client.liveness import DELIVERY_TIMEOUT_MS, HEARTBEAT_MS, Liveness
from handoff_client.model import Reconciled, Release, ReleaseReason
from tests.client.test_sidecar_ordering import CountingEngine, ScriptedTransport, act, idle, sidecar
from tests.support.lease import until

TIMEOUT_S = 10.0
# A 40 ms delivery timeout: the lease is 20 ms (half of it), so a drawn
# silence expires it at once.
HEADERS = [(DELIVERY_TIMEOUT_MS, "40"), (HEARTBEAT_MS, "10")]
HANDOFFS = ("h0", "h1", "h2")


class LeasedScriptedTransport(ScriptedTransport):
    """Stamps a Liveness on every subscription and delivery and, while
    ``beating``, every few ms as heartbeats would; answers Reconcile with
    ``releases`` among the held sides it is sent."""

    def __init__(self) -> None:
        super().__init__()
        self.liveness = Liveness()
        self.beating = True
        self.releases: set[Side] = set()
        self.reconciled: list[tuple[list[Side], list[Side]]] = []

    async def _subscribe(self, on_subscribed: Callable[[], None]) -> AsyncGenerator[Action, None]:
        self.liveness.subscribed(HEADERS)
        async for action in super()._subscribe(on_subscribed):
            self.liveness.heard()
            yield action

    async def heartbeats(self) -> None:
        while True:
            if self.beating:
                self.liveness.heard()
            await asyncio.sleep(0.002)

    async def reconcile(
        self,
        engine_id: str,
        *,
        incarnation: str,
        session_id: str,
        held: list[Side],
        freed: list[Side],
    ) -> Reconciled:
        self.reconciled.append((held, freed))
        releases = tuple(
            Release(h, role, ReleaseReason.UNKNOWN_HANDOFF)
            for h, role in held
            if (h, role) in self.releases
        )
        return Reconciled(releases, len(freed))


class StrictCountingEngine(CountingEngine):
    """Also counts a free, through any handler, of a side already freed."""

    def __init__(self) -> None:
        super().__init__()
        self.refreed = 0

    async def _free(self, action: Action, role: Role) -> Outcome:
        if (action.handoff_id, role) in self.freed:
            self.refreed += 1
        return await super()._free(action, role)


ACQUIRE = {
    Role.SOURCE: ActionKind.SUBMIT_PREFILL,
    Role.DESTINATION: ActionKind.RESERVE_DESTINATION,
}
CLEANUP = (
    (Role.SOURCE, ActionKind.CANCEL_SOURCE),
    (Role.SOURCE, ActionKind.RELEASE_SOURCE),
    (Role.DESTINATION, ActionKind.CANCEL_DESTINATION),
)
Step = tuple[str, str, Role | None, ActionKind | Completion | None]


@st.composite
def programs(draw: st.DrawFn) -> list[Step]:
    """Each handoff: its acquisitions, maybe an activation, at most one cleanup
    per side and at most one COMPLETE (as the coordinator sends them); in any
    order, with lease expiries and reconciles in between."""
    steps: list[Step] = []
    for h in HANDOFFS:
        steps += [("deliver", h, role, kind) for role, kind in ACQUIRE.items()]
        if draw(st.booleans()):
            steps.append(("deliver", h, Role.DESTINATION, ActionKind.ACTIVATE_DESTINATION))
        for role in Role.SOURCE, Role.DESTINATION:
            kinds = [kind for r, kind in CLEANUP if r is role]
            choice = draw(st.sampled_from([None, *kinds]))
            if choice is not None:
                steps.append(("deliver", h, role, choice))
        completion = draw(st.sampled_from([None, Completion.SUCCESS, Completion.CANCELED]))
        if completion is not None:
            steps.append(("complete", h, None, completion))
    steps += [("lease", "", None, None)] * draw(st.integers(0, 2))
    for _ in range(draw(st.integers(0, 2))):
        role = draw(st.sampled_from([Role.SOURCE, Role.DESTINATION]))
        steps.append(("reconcile", draw(st.sampled_from(HANDOFFS)), role, None))
    return list(draw(st.permutations(steps)))


async def play(program: list[Step]) -> tuple[StrictCountingEngine, EngineSidecar, set[Side]]:
    transport, engine = LeasedScriptedTransport(), StrictCountingEngine()
    car = sidecar(transport, engine)
    beats = asyncio.create_task(transport.heartbeats())
    activated: set[Side] = set()
    try:
        async with car, asyncio.timeout(TIMEOUT_S):
            await car.wait_subscribed()
            for action_id, (step, h, role, what) in enumerate(program):
                if step == "deliver":
                    assert isinstance(what, ActionKind)
                    transport.deliver(act(h, action_id, what))
                    if what is ActionKind.ACTIVATE_DESTINATION:
                        activated.add((h, Role.DESTINATION))
                elif step == "complete":
                    assert isinstance(what, Completion)
                    if what is Completion.SUCCESS:
                        # The decode owns the request from a success on: no
                        # notice frees it (only a CancelDestination would).
                        activated.add((h, Role.DESTINATION))
                    transport.deliver(act(h, action_id, ActionKind.COMPLETE, completion=what))
                elif step == "lease":
                    await _settle(car, transport)
                    await silence(car, transport)
                    await _settle(car, transport)
                else:
                    assert role is not None
                    await _settle(car, transport)
                    transport.releases = {(h, role)}
                    await resubscribe(car, transport)
                    await _settle(car, transport)
                await asyncio.sleep(0)
            await _settle(car, transport)
            # The end of every handoff: whatever is still held is freed by its notice.
            for n, h in enumerate(HANDOFFS):
                transport.deliver(
                    act(h, 1000 + n, ActionKind.COMPLETE, completion=Completion.CANCELED)
                )
            await _settle(car, transport)
    finally:
        beats.cancel()
    return engine, car, activated


async def silence(car: EngineSidecar, transport: LeasedScriptedTransport) -> None:
    """Silent until the lease expires; then heard from again (a new sign of life)."""
    expired = car.stats.lease_expiries + 1
    transport.beating = False
    await until(lambda: car.stats.lease_expiries >= expired, poll_s=0.001)
    last = transport.liveness.last_heard
    transport.beating = True
    await until(lambda: transport.liveness.last_heard != last, poll_s=0.001)


async def resubscribe(car: EngineSidecar, transport: LeasedScriptedTransport) -> None:
    reconciled = car.stats.reconciles + 1
    transport.drop()  # resubscribe: a reconcile follows
    await until(lambda: car.stats.reconciles >= reconciled, poll_s=0.001)


async def _settle(car: EngineSidecar, transport: ScriptedTransport) -> None:
    while transport.actions.qsize() or car._tasks:
        await asyncio.sleep(0)
        await idle(car)


@settings(max_examples=60, deadline=None)
@given(programs())
def test_every_held_side_is_freed_exactly_once_whatever_frees_it_first(
    program: list[Step],
) -> None:
    engine, car, activated = asyncio.run(play(program))
    assert engine.refreed == 0
    assert engine.double_frees == 0
    assert engine.acquired_after_free == 0
    # The sidecar's own frees (attempt 0) never touched a decode that was
    # activated before them.
    seen_active: set[Side] = set()
    for action in engine.calls:
        side = (action.handoff_id, action.target)
        if action.kind is ActionKind.ACTIVATE_DESTINATION:
            seen_active.add(side)
        elif action.attempt == 0:
            assert side not in seen_active, (action, program)
    # Nothing leaks but decodes that own their requests (activated, or succeeded).
    left = {side for side, blocks in engine.held.items() if blocks}
    assert left <= activated, (left, program)
    assert car.stats.freed_unreported >= 0
