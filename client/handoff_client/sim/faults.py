"""Faults injected from outside the engines: connection faults, and coordinator crashes.

:class:`FlakyTransport` wraps a real transport. Now and then (exponentially
distributed, ``mean_interval_s`` apart on average) it cuts the connection:
the action stream fails, and for ``blackout_s`` every report and every new
subscription fails with UNAVAILABLE, as if the network were down. The
sidecar must reconnect, retry its reports in order, and answer the actions
the server redelivers from its outcome cache.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass
from typing import Protocol

from handoff_client.client import SideId
from handoff_client.errors import UnavailableError
from handoff_client.model import Action, Fact, Outcome, Reconciled
from handoff_client.transport import LeasedTransport


class FlakyTransport:
    def __init__(
        self,
        inner: LeasedTransport,
        *,
        mean_interval_s: float,
        blackout_s: float,
        rng: random.Random,
    ) -> None:
        if mean_interval_s <= 0 or blackout_s < 0:
            raise ValueError("mean_interval_s must be > 0 and blackout_s >= 0")
        self._inner = inner
        self.liveness = inner.liveness
        self._mean_interval_s = mean_interval_s
        self._blackout_s = blackout_s
        self._rng = rng
        self._down_until = 0.0
        self.drops = 0

    def subscribe(
        self,
        engine_id: str,
        on_subscribed: Callable[[], None],
        *,
        incarnation: str,
        session_id: str,
    ) -> AsyncGenerator[Action, None]:
        self._check_up()
        inner = self._inner.subscribe(
            engine_id, on_subscribed, incarnation=incarnation, session_id=session_id
        )
        return self._subscribe(inner)

    async def report_fact(self, handoff_id: str, fact: Fact) -> None:
        self._check_up()
        await self._inner.report_fact(handoff_id, fact)

    async def report_outcome(self, handoff_id: str, action_id: int, outcome: Outcome) -> None:
        self._check_up()
        await self._inner.report_outcome(handoff_id, action_id, outcome)

    async def reconcile(
        self,
        engine_id: str,
        *,
        incarnation: str,
        session_id: str,
        held: list[SideId],
        freed: list[SideId],
    ) -> Reconciled:
        self._check_up()
        return await self._inner.reconcile(
            engine_id, incarnation=incarnation, session_id=session_id, held=held, freed=freed
        )

    def _check_up(self) -> None:
        if asyncio.get_running_loop().time() < self._down_until:
            raise UnavailableError("injected fault: connection down")

    async def _subscribe(
        self, actions: AsyncGenerator[Action, None]
    ) -> AsyncGenerator[Action, None]:
        loop = asyncio.get_running_loop()
        drop_at = loop.time() + self._rng.expovariate(1.0 / self._mean_interval_s)
        try:
            while True:
                try:
                    # Only the wait for the next action is under the timeout,
                    # never the yield: the consumer's work must not be cut.
                    async with asyncio.timeout_at(drop_at):
                        action = await anext(actions)
                except StopAsyncIteration:
                    return
                except TimeoutError:
                    self.drops += 1
                    self._down_until = loop.time() + self._blackout_s
                    raise UnavailableError("injected fault: connection dropped") from None
                yield action
        finally:
            await actions.aclose()


@dataclass(frozen=True, slots=True)
class CoordinatorCrash:
    """One coordinator crash, as the process that caused it saw it."""

    killed_pid: int
    # From the start of the last scrape of the killed process to its SIGKILL:
    # what it counted meanwhile is in no scrape.
    scraped_before_s: float
    pid: int  # of the process restarted in its place
    restarted_in_s: float  # from SIGKILL until the new process served
    recovered: int  # handoffs it recovered from the journal (handoff_recovered_handoffs)
    recovery_s: float  # how long its replay took (handoff_recovery_seconds)
    in_flight: int = 0  # handoffs the frontend had in flight when it asked (the simulator's count)
    shard: str = ""  # the shard killed, when the coordinator is sharded


class CoordinatorCrasher(Protocol):
    async def crash(self) -> CoordinatorCrash:
        """Kill the coordinator with SIGKILL, restart it on its state dir; when it serves again."""
        ...
