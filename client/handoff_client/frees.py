"""Freer: every free of a side, the coordinator's and the sidecar's own, reaches the engine once.

A side is freed by whichever comes first: a cleanup the coordinator sent
(ReleaseSource, CancelSource, CancelDestination), or a free the sidecar makes
up (a COMPLETE notice, the lease, a reconcile, fencing, a stop for good).
Each first interrupts the acquiring handlers still running for the side
(:meth:`HandlerRunner.interrupt`), then runs the engine's handler under the
side's lock, so two frees of one side never overlap; once one has run, any
later cleanup is answered NOOP from the tombstone without calling the engine.
The only second call is the LATE free, for what a handler that ignored its
cancellation took after the first free had started.

A made-up free that fails (the handler raised, or timed out) is tried again
with backoff, ``FREE_ATTEMPTS`` times in all, then given up loudly; a cleanup
the coordinator sent is left unacknowledged and tried at its redelivery,
with a loud line once it has timed out ``FREE_ATTEMPTS`` times.
"""

from __future__ import annotations

import asyncio
import logging
import random

from handoff_client.ledger import SideRecord, Stage
from handoff_client.model import (
    MADE_UP_ACTION_ID,
    NOOP,
    Action,
    ActionKind,
    Origin,
    Outcome,
    Role,
)
from handoff_client.retry import Backoff
from handoff_client.runner import HandlerRunner, describe, log_extra
from handoff_client.stats import Counters

log = logging.getLogger("handoff.sidecar")

FREE_ATTEMPTS = 5
# The cancel that frees each side when the sidecar frees on its own.
CANCEL_OF: dict[Role, ActionKind] = {
    Role.SOURCE: ActionKind.CANCEL_SOURCE,
    Role.DESTINATION: ActionKind.CANCEL_DESTINATION,
}


def made_up(handoff_id: str, role: Role, engine_id: str, origin: Origin) -> Action:
    """The cancel the sidecar runs on its own: no action id of the handoff's, attempt 0."""
    return Action(handoff_id, MADE_UP_ACTION_ID, CANCEL_OF[role], role, engine_id, 0, origin=origin)


class Freer:
    def __init__(
        self,
        engine_id: str,
        runner: HandlerRunner,
        counters: Counters,
        *,
        concurrency: int,
        backoff: Backoff,
        rng: random.Random,
    ) -> None:
        self.engine_id = engine_id
        self.stopping = False  # set by the sidecar: cleanups left for the next subscription
        self._runner = runner
        self._counters = counters
        self._slots = asyncio.Semaphore(concurrency)
        self._backoff = backoff
        self._rng = rng

    @property
    def slots(self) -> asyncio.Semaphore:
        """Cleanup capacity, shared with COMPLETE notices."""
        return self._slots

    async def clean(self, action: Action, side: SideRecord) -> Outcome | None:
        """A cleanup the coordinator sent: its outcome, NOOP if the side was freed
        already, None to leave it unacknowledged (or when stopping)."""
        # Outside any slot: waiting for a stuck handler must not hold capacity
        # that other handoffs' cleanups need.
        await self._runner.interrupt(side, action)
        async with side.freeing(), self._slots:
            if self.stopping:
                return None
            if side.freed:
                self._counters.answered_freed += 1
                log.info(
                    "answered NOOP without calling the engine: this side was already freed (%s)",
                    describe(action),
                    extra=log_extra(self.engine_id, action),
                )
                return NOOP
            return await self._free_now(action, side)

    async def free(self, handoff_id: str, role: Role, side: SideRecord, origin: Origin) -> bool:
        """Free ``side`` on the sidecar's own (nothing is reported); whether this call freed it.

        Skipped when another free did it first, but for a LATE free, which is
        for what a handler took after that one.
        """
        cancel = made_up(handoff_id, role, self.engine_id, origin)
        side.close()
        await self._runner.interrupt(side, cancel)
        failures = 0
        while True:
            async with side.freeing(), self._slots:
                if side.freed and origin is not Origin.LATE:
                    return False
                log.info("running %s", describe(cancel), extra=log_extra(self.engine_id, cancel))
                if await self._free_now(cancel, side) is not None:
                    return True
            failures += 1
            if failures >= FREE_ATTEMPTS:
                self._give_up(cancel, f"{failures} attempts failed")
                return False
            self._counters.frees_retried += 1
            await asyncio.sleep(self._backoff.delay_s(failures, self._rng))

    async def _free_now(self, action: Action, side: SideRecord) -> Outcome | None:
        # A handler that returns from now on took something this call may not
        # have seen (a LATE free follows).
        side.stage = Stage.FREEING
        outcome = await self._runner.run(action, side)
        side.stage = Stage.CLOSED if outcome is None else Stage.FREED
        # A made-up free gives up in free(); the coordinator's, after as many timeouts.
        timed_out = outcome is None and side.timeouts == FREE_ATTEMPTS
        if timed_out and action.origin is Origin.COORDINATOR:
            self._give_up(action, f"its handler timed out {side.timeouts} times")
        return outcome

    def _give_up(self, action: Action, why: str) -> None:
        self._counters.frees_given_up += 1
        log.error(
            "engine %s cannot free this side (%s): %s; its KV stays held until the engine "
            "frees it itself (the coordinator abandons the handoff past its cleanup timeout)",
            self.engine_id,
            describe(action),
            why,
            extra=log_extra(self.engine_id, action),
        )
