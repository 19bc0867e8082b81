"""Each side is freed by exactly one engine call, for any order and overlap (Hypothesis).

The ledger of tests/test_sidecar_lease_properties.py, with what that test
leaves out: a source may get both ReleaseSource and CancelSource (the core
sends CancelSource when a cancel comes while ReleaseSource is unacknowledged),
any action may be redelivered (the same id again, attempt 2), and an
acquiring handler may still be running (gated) when a free of its side
comes, which then interrupts it. Mixed with COMPLETE notices, lease expiries
and reconciles, in any drawn order. Whatever the order: no two frees of a
side overlap, none runs twice, nothing is acquired after a free, every
engine cleanup call for a side is its only one, and every held side is
freed but the decodes that own their requests.
"""

from __future__ import annotations

import asyncio
from collections import Counter

from hypothesis import given, settings
from hypothesis import strategies as st

from handoff_client import Action, ActionKind, Completion, Origin, Outcome, Role
from tests.client.test_sidecar_lease_properties import (
    HANDOFFS,
    LeasedScriptedTransport,
    StrictCountingEngine,
    _settle,
    resubscribe,
    silence,
)
from tests.client.test_sidecar_ordering import act, sidecar

TIMEOUT_S = 10.0
Side = tuple[str, Role]
CLEANUPS = {ActionKind.RELEASE_SOURCE, ActionKind.CANCEL_SOURCE, ActionKind.CANCEL_DESTINATION}
# (step, handoff, role, what, action id, attempt)
Step = tuple[str, str, Role | None, ActionKind | Completion | None, int, int]


class CallCountingEngine(StrictCountingEngine):
    """Also counts every engine cleanup call per side."""

    def __init__(self) -> None:
        super().__init__()
        self.cleanup_calls: Counter[Side] = Counter()

    async def _free(self, action: Action, role: Role) -> Outcome:
        self.cleanup_calls[(action.handoff_id, role)] += 1
        return await super()._free(action, role)


@st.composite
def programs(draw: st.DrawFn) -> list[Step]:
    steps: list[Step] = []
    next_id = 0

    def deliver(h: str, role: Role, kind: ActionKind) -> None:
        nonlocal next_id
        action_id, next_id = next_id, next_id + 1
        steps.append(("deliver", h, role, kind, action_id, 1))
        if draw(st.booleans()):
            steps.append(("deliver", h, role, kind, action_id, 2))  # redelivered

    for h in HANDOFFS:
        deliver(h, Role.SOURCE, ActionKind.SUBMIT_PREFILL)
        deliver(h, Role.DESTINATION, ActionKind.RESERVE_DESTINATION)
        if draw(st.booleans()):
            deliver(h, Role.DESTINATION, ActionKind.ACTIVATE_DESTINATION)
        if draw(st.booleans()):
            steps.append(("gate", h, None, None, -1, 0))  # its acquisitions hang
        for kind in draw(
            st.sets(st.sampled_from([ActionKind.RELEASE_SOURCE, ActionKind.CANCEL_SOURCE]))
        ):
            deliver(h, Role.SOURCE, kind)
        if draw(st.booleans()):
            deliver(h, Role.DESTINATION, ActionKind.CANCEL_DESTINATION)
        completion = draw(st.sampled_from([None, Completion.SUCCESS, Completion.CANCELED]))
        if completion is not None:
            steps.append(("complete", h, None, completion, next_id, 1))
            next_id += 1
    steps += [("lease", "", None, None, -1, 0)] * draw(st.integers(0, 2))
    for _ in range(draw(st.integers(0, 2))):
        role = draw(st.sampled_from([Role.SOURCE, Role.DESTINATION]))
        steps.append(("reconcile", draw(st.sampled_from(HANDOFFS)), role, None, -1, 0))
    return list(draw(st.permutations(steps)))


async def play(program: list[Step]) -> tuple[CallCountingEngine, set[Side]]:
    transport, engine = LeasedScriptedTransport(), CallCountingEngine()
    # A short grace: a gated handler is cancellation-safe, it unwinds at once.
    car = sidecar(transport, engine, interrupt_grace_s=0.5, handler_timeout_s=0.3)
    beats = asyncio.create_task(transport.heartbeats())
    owned: set[Side] = set()  # decodes that own their request (activated, or succeeded)
    try:
        async with car, asyncio.timeout(TIMEOUT_S):
            await car.wait_subscribed()
            for step, h, role, what, action_id, attempt in program:
                if step == "deliver":
                    assert isinstance(what, ActionKind)
                    transport.deliver(act(h, action_id, what, attempt=attempt))
                elif step == "gate":
                    engine.gate(h)
                elif step == "complete":
                    assert isinstance(what, Completion)
                    if what is Completion.SUCCESS:
                        owned.add((h, Role.DESTINATION))
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
            for n, h in enumerate(HANDOFFS):
                transport.deliver(
                    act(h, 1000 + n, ActionKind.COMPLETE, completion=Completion.CANCELED)
                )
            await _settle(car, transport)
    finally:
        beats.cancel()
    owned |= {
        (a.handoff_id, Role.DESTINATION)
        for a in engine.calls
        if a.kind is ActionKind.ACTIVATE_DESTINATION
    }
    return engine, owned


@settings(max_examples=60, deadline=None)
@given(programs())
def test_each_side_is_freed_by_exactly_one_engine_call_in_any_order_and_overlap(
    program: list[Step],
) -> None:
    engine, owned = asyncio.run(play(program))
    assert engine.refreed == engine.double_frees == engine.acquired_after_free == 0
    assert all(n == 1 for n in engine.cleanup_calls.values()), (engine.cleanup_calls, program)
    for action in engine.calls:
        if action.origin is not Origin.COORDINATOR:
            assert action.id < 0
            assert action.attempt == 0
    left = {side for side, blocks in engine.held.items() if blocks}
    assert left <= owned, (left, program)
