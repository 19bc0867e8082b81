"""Reports of one handoff, landing in the order the engine made them.

Order matters: the server rejects SourceHeld until SubmitPrefill's outcome
is in, DestinationReserved until ReserveDestination's, TransferCompleted until
StartTransfer's. An engine that returns SUBMITTED and then finishes its
prefill quickly would otherwise race its own fact past its outcome. So each
handoff has a FIFO, and a report goes on the wire only behind the one before
it: once that one has landed, or, where the wire itself keeps order (the
same Connect stream, whose reports the server handles in order), as soon as
that one is on it. There an outcome and the fact that follows it share a
message instead of waiting a round trip apart.

A report that fails transiently (UNAVAILABLE, DEADLINE_EXCEEDED) is retried
with backoff until it lands, and every report sent behind it goes again
after it: every report is idempotent on the server, and the reports behind it
must not overtake it. Any other error is final and goes to whoever awaits
that report.
"""

from __future__ import annotations

import asyncio
import random
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from handoff_client.errors import DeadlineExceededError, UnavailableError
from handoff_client.retry import Backoff

TRANSIENT = (UnavailableError, DeadlineExceededError)


@dataclass(frozen=True, slots=True)
class Sent:
    """A report on the wire: ``landed`` ends when the server has answered it.

    ``on`` is what keeps order (a stream): the server handles a report sent
    later on the same ``on`` after this one. None: nothing does, so the next
    report waits for this one to land.
    """

    landed: asyncio.Future[None]
    on: object | None = None


# Puts one report on the wire behind ``after``, the handoff's report sent just
# before it, while that one has not landed (None otherwise). A transport that
# cannot keep the order behind ``after`` raises UnavailableError.
Report = Callable[["Sent | None"], Awaitable[Sent]]


def landing(report: Callable[[], Awaitable[None]]) -> Report:
    """``report``, awaited whole: for a transport that keeps no order on the wire."""

    async def send(after: Sent | None) -> Sent:
        await report()
        landed: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        landed.set_result(None)
        return Sent(landed)

    return send


class _Line:
    """One handoff's reports not landed yet, and how its drain is woken for a new one."""

    __slots__ = ("reports", "wake")

    def __init__(self) -> None:
        self.reports: deque[tuple[Report, asyncio.Future[None]]] = deque()
        self.wake: asyncio.Future[None] | None = None


class Outbox:
    def __init__(self, backoff: Backoff, rng: random.Random) -> None:
        self._backoff = backoff
        self._rng = rng
        self._lines: dict[str, _Line] = {}
        self._drains: set[asyncio.Task[None]] = set()
        self._closed = False
        self.retries = 0  # transient failures retried, for stats

    @property
    def pending(self) -> int:
        """Handoffs with reports not landed yet."""
        return len(self._lines)

    def send(self, handoff_id: str, report: Report) -> asyncio.Future[None]:
        """Queue ``report`` behind the handoff's earlier ones; the future ends when it lands.

        Synchronous on purpose: the position in the queue is taken at the
        call, not at some later point of an await.
        """
        if self._closed:
            raise RuntimeError("the sidecar is stopped; nothing can be reported")
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        line = self._lines.get(handoff_id)
        if line is None:
            line = self._lines[handoff_id] = _Line()
            drain = asyncio.create_task(self._drain(handoff_id, line))
            self._drains.add(drain)
            drain.add_done_callback(self._drains.discard)
        line.reports.append((report, future))
        if line.wake is not None and not line.wake.done():
            line.wake.set_result(None)
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

    async def _drain(self, handoff_id: str, line: _Line) -> None:
        reports = line.reports
        sent: deque[Sent] = deque()  # of reports[0], reports[1], ... in order
        failures = 0  # of the first report, in a row
        try:
            while reports:
                await _put(reports, sent)
                head = sent[0].landed
                if not head.done():
                    # Until it lands, or a report behind it may go on the wire.
                    line.wake = asyncio.get_running_loop().create_future()
                    await asyncio.wait((head, line.wake), return_when=asyncio.FIRST_COMPLETED)
                    continue
                error = (
                    UnavailableError("the report was withdrawn before its answer")
                    if head.cancelled()
                    else head.exception()
                )
                if isinstance(error, TRANSIENT):
                    failures += 1
                    self.retries += 1
                    for later in sent:  # sent again after it; their answers no longer count
                        later.landed.add_done_callback(_forget)
                    sent.clear()
                    await asyncio.sleep(self._backoff.delay_s(failures, self._rng))
                    continue
                failures = 0
                _, future = reports.popleft()
                sent.popleft()
                if not future.done():  # handed to the awaiting caller, who decides
                    if error is None:
                        future.set_result(None)
                    else:
                        future.set_exception(error)
        finally:
            del self._lines[handoff_id]
            for later in sent:
                later.landed.cancel()
            for _, future in reports:
                future.cancel()


async def _put(reports: deque[tuple[Report, asyncio.Future[None]]], sent: deque[Sent]) -> None:
    """Put on the wire every report that may go now: each behind the last one
    sent, while that one is on an ordered wire and has not failed (or has
    landed)."""
    while len(sent) < len(reports):
        after = sent[-1] if sent else None
        if after is not None:
            if after.landed.done():
                if after.landed.cancelled() or after.landed.exception() is not None:
                    return  # it goes again first, or its error is handed over first
                after = None
            elif after.on is None:
                return  # nothing keeps the order but its landing
        report, _ = reports[len(sent)]
        try:
            sent.append(await report(after))
        except Exception as error:  # its failure, handled when its turn comes
            failed: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            failed.set_exception(error)
            sent.append(Sent(failed))


def _forget(landed: asyncio.Future[None]) -> None:
    """An answer no one waits for any more: retrieved, so asyncio does not warn of it."""
    if not landed.cancelled():
        landed.exception()
