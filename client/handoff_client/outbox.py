"""Reports of one handoff, sent one at a time in the order the engine made them.

Order matters: the server rejects SourceHeld until SubmitPrefill's outcome
is in, DestinationReserved until ReserveDestination's, TransferCompleted until
StartTransfer's. An engine that returns SUBMITTED and then finishes its
prefill quickly would otherwise race its own fact past its outcome. So each
handoff has a FIFO, and a report waits for the one before it to be
acknowledged.

A report that fails transiently (UNAVAILABLE, DEADLINE_EXCEEDED) is retried
with backoff until it lands: every report is idempotent on the server, and
the reports behind it must not overtake it. Any other error is final and goes
to whoever awaits that report.
"""

from __future__ import annotations

import asyncio
import random
from collections import deque
from collections.abc import Awaitable, Callable

from handoff_client.errors import DeadlineExceededError, UnavailableError
from handoff_client.retry import Backoff

Report = Callable[[], Awaitable[None]]
TRANSIENT = (UnavailableError, DeadlineExceededError)


class Outbox:
    def __init__(self, backoff: Backoff, rng: random.Random) -> None:
        self._backoff = backoff
        self._rng = rng
        self._queues: dict[str, deque[tuple[Report, asyncio.Future[None]]]] = {}
        self._drains: set[asyncio.Task[None]] = set()
        self._closed = False
        self.retries = 0  # transient failures retried, for stats

    @property
    def pending(self) -> int:
        """Handoffs with reports not landed yet."""
        return len(self._queues)

    def send(self, handoff_id: str, report: Report) -> asyncio.Future[None]:
        """Queue ``report`` behind the handoff's earlier ones; the future ends when it lands.

        Synchronous on purpose: the position in the queue is taken at the
        call, not at some later point of an await.
        """
        if self._closed:
            raise RuntimeError("the sidecar is stopped; nothing can be reported")
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        queue = self._queues.get(handoff_id)
        if queue is None:
            queue = self._queues[handoff_id] = deque()
            drain = asyncio.create_task(self._drain(handoff_id, queue))
            self._drains.add(drain)
            drain.add_done_callback(self._drains.discard)
        queue.append((report, future))
        return future

    async def close(self, grace_s: float) -> None:
        """Refuse new reports, give queued ones ``grace_s`` to land, cancel the rest."""
        self._closed = True
        drains = set(self._drains)
        if drains and grace_s > 0:
            await asyncio.wait(drains, timeout=grace_s)
        for drain in drains:
            drain.cancel()
        await asyncio.gather(*drains, return_exceptions=True)

    async def _drain(
        self, handoff_id: str, queue: deque[tuple[Report, asyncio.Future[None]]]
    ) -> None:
        try:
            while queue:
                report, future = queue[0]
                try:
                    await self._deliver(report)
                except Exception as error:  # handed to the awaiting caller, who decides
                    if not future.done():
                        future.set_exception(error)
                else:
                    if not future.done():
                        future.set_result(None)
                queue.popleft()
        finally:
            del self._queues[handoff_id]
            for _, future in queue:
                future.cancel()

    async def _deliver(self, report: Report) -> None:
        failures = 0
        while True:
            try:
                await report()
                return
            except TRANSIENT:
                failures += 1
                self.retries += 1
            await asyncio.sleep(self._backoff.delay_s(failures, self._rng))
