"""A simulated prefill or decode engine with a finite KV pool, behind an EngineSidecar.

It does what a real engine does with each action, in simulated time: prefill
takes time proportional to the prompt, a transfer takes the coordinator's
``delay_ms``, decode takes time per output token. Every block it takes is
given back by a release, a cancel, or the end of decode; the leak check at
the end of a run holds it to that.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Callable, Coroutine
from typing import Any

from handoff_client.errors import HandoffRpcError
from handoff_client.model import ACCEPTED, APPLIED, NOOP, SCHEDULED, SUBMITTED, Action, Outcome
from handoff_client.sidecar import Facts
from handoff_client.sim.config import EngineProfile
from handoff_client.sim.pool import KvBlockPool
from handoff_client.sim.workload import Request, RequestBook

log = logging.getLogger("handoff.sim.engine")


class SimEngine:
    """Implements :class:`handoff_client.Engine`. One instance per engine id."""

    def __init__(
        self,
        engine_id: str,
        pool: KvBlockPool,
        book: RequestBook,
        profile: EngineProfile,
        *,
        rng: random.Random,
        on_complete: Callable[[str], None],
        time_scale: float = 1.0,
        slowdown: float = 1.0,
        failure_rate: float = 0.0,
    ) -> None:
        self.engine_id = engine_id
        self.pool = pool
        self.slowdown = slowdown
        self._book = book
        self._profile = profile
        self._rng = rng
        self._on_complete = on_complete
        self._time_scale = time_scale
        self._failure_rate = failure_rate
        # Background work (prefill, transfer, decode) by handoff, so a cancel stops it.
        self._work: dict[str, set[asyncio.Task[None]]] = {}
        # Handoffs released or canceled here: a handler that runs late for
        # one of them (concurrent or redelivered) must not take blocks again.
        self._closed: set[str] = set()
        self._idle = asyncio.Event()
        self._idle.set()
        self.dead = False
        self.injected_failures = 0
        # Stuck handlers: how many more to hang, and the handoffs they hang in.
        self._hang_next = 0
        self._unstuck = asyncio.Event()
        self.stuck: set[str] = set()  # every handoff a handler hung in
        self._stuck_held: set[str] = set()  # ... not freed yet
        self._stuck_freed = asyncio.Event()
        self._stuck_freed.set()

    # --- source ------------------------------------------------------------------

    async def submit_prefill(self, action: Action, facts: Facts) -> Outcome:
        await self._step()
        handoff_id = action.handoff_id
        refusal = self._refusal(action)
        if refusal is not None:
            return refusal
        request = self._book.get(handoff_id)
        if not self.pool.allocate(handoff_id, request.prompt_tokens):
            return Outcome.failed(f"{self.engine_id}: out of KV blocks for the prefill")
        await self._maybe_hang(handoff_id)
        self._start(handoff_id, self._prefill(handoff_id, request, facts))
        return SUBMITTED

    async def start_transfer(self, action: Action, facts: Facts) -> Outcome:
        await self._step()
        refusal = self._refusal(action)
        if refusal is not None:
            return refusal
        self._start(action.handoff_id, self._transfer(action, facts))
        return SCHEDULED

    async def release_source(self, action: Action, facts: Facts) -> Outcome:
        await self._step()
        return self._free(action.handoff_id)

    async def cancel_source(self, action: Action, facts: Facts) -> Outcome:
        await self._step()
        return self._free(action.handoff_id)

    # --- destination ---------------------------------------------------------------

    async def reserve_destination(self, action: Action, facts: Facts) -> Outcome:
        await self._step()
        handoff_id = action.handoff_id
        refusal = self._refusal(action)
        if refusal is not None:
            return refusal
        request = self._book.get(handoff_id)
        if not self.pool.allocate(handoff_id, request.prompt_tokens + request.output_tokens):
            return Outcome.failed(f"{self.engine_id}: out of KV blocks for the decode")
        await self._maybe_hang(handoff_id)
        self._start(handoff_id, self._reserved(handoff_id, request, facts))
        return ACCEPTED

    async def activate_destination(self, action: Action, facts: Facts) -> Outcome:
        await self._step()
        refusal = self._refusal(action)
        if refusal is not None:
            return refusal
        self._start(action.handoff_id, self._decode(action.handoff_id))
        return APPLIED

    async def cancel_destination(self, action: Action, facts: Facts) -> Outcome:
        await self._step()
        return self._free(action.handoff_id)

    async def complete(self, action: Action) -> None:
        self._on_complete(action.handoff_id)

    # --- lifetime ------------------------------------------------------------------

    def kill(self) -> None:
        """Die: stop all work. The pool dies with the engine; nothing reports again."""
        self.dead = True
        for tasks in self._work.values():
            for task in tasks:
                task.cancel()

    async def wait_idle(self) -> None:
        """Until no prefill, transfer or decode is running."""
        await self._idle.wait()

    def hang(self, handlers: int) -> None:
        """Make the next ``handlers`` prefills or reservations hang, holding their
        blocks, until :meth:`unstick`."""
        self._hang_next += handlers

    def unstick(self) -> None:
        """The hung handlers return (the run is over); their cancels can run now."""
        self._unstuck.set()

    async def wait_stuck_freed(self) -> None:
        """Until every handoff a handler hung in has been freed by its cancel."""
        await self._stuck_freed.wait()

    async def _maybe_hang(self, handoff_id: str) -> None:
        if self._hang_next <= 0:
            return
        self._hang_next -= 1
        self.stuck.add(handoff_id)
        self._stuck_held.add(handoff_id)
        self._stuck_freed.clear()
        await self._unstuck.wait()

    # --- internals -----------------------------------------------------------------

    def _seconds(self, ms: float) -> float:
        return ms / 1000.0 * self._time_scale * self.slowdown

    async def _step(self) -> None:
        await asyncio.sleep(self._seconds(self._profile.step_ms))

    def _refusal(self, action: Action) -> Outcome | None:
        """FAILED for a canceled request or an injected fault; None to go ahead."""
        if action.handoff_id in self._closed:
            return Outcome.failed(f"{self.engine_id}: the request was already canceled")
        if self._rng.random() < self._failure_rate:
            self.injected_failures += 1
            return Outcome.failed(f"injected fault: {self.engine_id} failed {action.kind.name}")
        return None

    def _free(self, handoff_id: str) -> Outcome:
        self._closed.add(handoff_id)
        if handoff_id in self._stuck_held:
            self._stuck_held.discard(handoff_id)
            if not self._stuck_held:
                self._stuck_freed.set()
        for task in self._work.pop(handoff_id, set()):
            task.cancel()
        if not self._work:
            self._idle.set()
        return APPLIED if self.pool.release(handoff_id) else NOOP

    async def _prefill(self, handoff_id: str, request: Request, facts: Facts) -> None:
        ms = request.prompt_tokens / 1000.0 * self._profile.prefill_ms_per_1k_tokens
        await asyncio.sleep(self._seconds(ms))
        await self._report(facts.source_held(handoff_id, request.timing))

    async def _reserved(self, handoff_id: str, request: Request, facts: Facts) -> None:
        await self._report(facts.destination_reserved(handoff_id, request.transferable_tokens))

    async def _transfer(self, action: Action, facts: Facts) -> None:
        await asyncio.sleep(self._seconds(action.delay_ms))
        await self._report(facts.transfer_completed(action.handoff_id))

    async def _decode(self, handoff_id: str) -> None:
        request = self._book.get(handoff_id)
        await asyncio.sleep(
            self._seconds(request.output_tokens * self._profile.decode_ms_per_token)
        )
        # The request finished and left the engine; a late cancel finds nothing.
        self._closed.add(handoff_id)
        self.pool.release(handoff_id)

    async def _report(self, report: Coroutine[Any, Any, None]) -> None:
        try:
            await report
        except HandoffRpcError as error:
            # The handoff moved on without this fact (canceled, abandoned); its
            # cleanup action is what frees the blocks, not this report.
            log.debug("fact refused: %s", error, extra={"engine_id": self.engine_id})

    def _start(self, handoff_id: str, work: Coroutine[Any, Any, None]) -> None:
        task = asyncio.create_task(work)
        self._work.setdefault(handoff_id, set()).add(task)
        self._idle.clear()
        task.add_done_callback(lambda done: self._finished(handoff_id, done))

    def _finished(self, handoff_id: str, task: asyncio.Task[None]) -> None:
        tasks = self._work.get(handoff_id)
        if tasks is not None:
            tasks.discard(task)
            if not tasks:
                del self._work[handoff_id]
        if not self._work:
            self._idle.set()
        if not task.cancelled() and task.exception() is not None:
            log.error(
                "background work failed",
                exc_info=task.exception(),
                extra={"engine_id": self.engine_id, "handoff_id": handoff_id},
            )
