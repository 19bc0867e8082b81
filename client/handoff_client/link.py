"""CoordinatorLink: one sidecar's connection to one coordinator, and its lease.

The link owns what is per coordinator: the subscription loop (resubscribe
with jittered backoff whenever the stream drops), the last sign of life, the
lease, the reconcile after every confirmed subscription, and the sides the
sidecar freed on its own since. What the engine holds is the sidecar's (its
ledger); the link reaches it through :class:`Holder`. A sidecar owns one
link per coordinator shard (one, for a coordinator that is not sharded),
each with its own transport, lease and reconcile: a shard that is down
expires only its own link's lease.

**Lease.** The coordinator declares an engine lost once it has had no live
stream for its delivery timeout, and then frees the other side of each of
its handoffs, which may still be reading or writing this engine's KV. So the
sidecar frees first: when nothing has arrived from the coordinator (action,
acknowledgement, heartbeat) for the lease, it stops and frees, through the
engine's own cancel handlers, every side it holds. The lease is the advertised
delivery timeout minus a margin of 20 %, at least 1 s (at most half the
timeout): the margin covers the network's latency (the server counts from
when it lost the stream, which is never earlier than the last message this
link read) and the time the engine's cancel handlers take to abort transfers.
It counts from the last sign of life, not from when the stream was noticed
gone: a black-holed connection can look open for minutes. It runs only
against a server that sends heartbeats (``handoff-heartbeat-ms``), else an
idle stream would look dead; and only over a :class:`LeasedTransport`.

**Reconcile.** After every confirmed subscription the link sends what the
engine holds and what it freed on its own; the coordinator answers which
held sides should end (freed here as orphans) and reports EngineLost for the
freed ones, so a coordinator that recovered after the lease fired does not
wait out deadlines for facts nobody will send.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections.abc import Callable, Iterable
from typing import Protocol

from handoff_client.client import SideId
from handoff_client.errors import HandoffRpcError, OlderIncarnationError, SessionConflictError
from handoff_client.model import Action, Origin, Release
from handoff_client.retry import Backoff
from handoff_client.transport import LeasedTransport, SidecarTransport

log = logging.getLogger("handoff.sidecar")

LEASE_MARGIN = 0.2  # of the delivery timeout
MIN_LEASE_MARGIN_S = 1.0


def lease_s(delivery_timeout_s: float) -> float:
    """The lease for an advertised delivery timeout: 20 % less, and at least 1 s
    less (but never less than half of it, for a server with a very short one)."""
    margin = max(delivery_timeout_s * LEASE_MARGIN, MIN_LEASE_MARGIN_S)
    return max(delivery_timeout_s - margin, delivery_timeout_s / 2)


class Holder(Protocol):
    """What a link needs from the sidecar that owns it."""

    def held(self) -> list[SideId]:
        """The sides the engine holds: acquired, not closed, not an activated decode."""
        ...

    async def reclaim(self, sides: Iterable[SideId], why: str, origin: Origin) -> list[SideId]:
        """Close these sides (tombstones) and free each one still held through the
        engine's cancel handler (made up by ``origin``, not reported); the ones it freed."""
        ...

    def kept(self, sides: Iterable[SideId]) -> None:
        """The coordinator expects the engine to go on holding these sides."""
        ...

    async def fenced(self, error: OlderIncarnationError) -> None:
        """A newer incarnation subscribed: free everything, for good."""
        ...


class CoordinatorLink:
    def __init__(
        self,
        transport: SidecarTransport,
        holder: Holder,
        *,
        engine_id: str,
        incarnation: str,
        session_id: str,
        backoff: Backoff,
        rng: random.Random,
    ) -> None:
        self._transport = transport
        self._holder = holder
        self.engine_id = engine_id
        self.incarnation = incarnation
        self.session_id = session_id
        self._backoff = backoff
        self._rng = rng
        self.subscribed = asyncio.Event()
        self.ended = asyncio.Event()  # stopped on its own (fenced)
        self.fenced: OlderIncarnationError | None = None
        self._freed: set[SideId] = set()  # freed on its own since the last reconcile
        self._reconciling: asyncio.Task[None] | None = None  # the latest
        self._background: set[asyncio.Task[None]] = set()  # reconciles not done yet
        self._lease: asyncio.Task[None] | None = None
        self.reconnects = self.conflicts = 0
        self.lease_expiries = self.freed_on_lease = self.orphans_reclaimed = 0
        self.reconciles = 0

    @property
    def freed_unreported(self) -> int:
        """Sides freed on its own that the next reconcile will report."""
        return len(self._freed)

    @property
    def _extra(self) -> dict[str, object]:
        return {"engine_id": self.engine_id, "incarnation": self.incarnation}

    # --- the stream ------------------------------------------------------------

    async def run(self, on_action: Callable[[Action], None]) -> None:
        """Subscribe, and resubscribe whenever the stream drops, until fenced or cancelled."""
        try:
            await self._run(on_action)
        finally:
            tasks = [*self._background, *([self._lease] if self._lease else [])]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            self.subscribed.clear()

    async def _run(self, on_action: Callable[[Action], None]) -> None:
        failures = 0

        def on_subscribed() -> None:
            nonlocal failures
            failures = 0
            self.subscribed.set()
            self._confirmed()

        while True:
            try:
                subscription = self._transport.subscribe(
                    self.engine_id,
                    on_subscribed,
                    incarnation=self.incarnation,
                    session_id=self.session_id,
                )
                async with contextlib.aclosing(subscription) as actions:
                    async for action in actions:
                        on_action(action)
                log.warning(
                    "action stream ended by the server (replaced, or shutting down)",
                    extra=self._extra,
                )
            except OlderIncarnationError as error:
                log.error(
                    "a newer incarnation of engine %s has subscribed; freeing everything "
                    "this one holds and stopping for good: %s",
                    self.engine_id,
                    error.details,
                    extra=self._extra,
                )
                self.subscribed.clear()
                await self._holder.fenced(error)
                self.fenced = error
                self.ended.set()
                return
            except SessionConflictError as error:
                self.conflicts += 1
                log.error(
                    "another live sidecar holds engine %s's stream under the same incarnation "
                    "(two sidecars given one incarnation?); retrying until its stream is gone: %s",
                    self.engine_id,
                    error.details,
                    extra=self._extra,
                )
            except HandoffRpcError as error:
                log.warning("action stream failed: %s", error, extra=self._extra)
            except Exception:  # a transport bug must not end the sidecar for good
                log.exception("action stream broke", extra=self._extra)
            self.subscribed.clear()
            failures += 1
            self.reconnects += 1
            await asyncio.sleep(self._backoff.delay_s(failures, self._rng))

    def _confirmed(self) -> None:
        """A subscription was confirmed: reconcile, and from now on run the lease."""
        transport = self._transport
        if not isinstance(transport, LeasedTransport):
            return
        self._start_reconcile(transport)
        if self._lease is None and transport.liveness.heartbeat_s is not None:
            self._lease = asyncio.create_task(self._run_lease(transport))

    # --- reconcile ---------------------------------------------------------------

    def _start_reconcile(self, transport: LeasedTransport) -> None:
        # After the one before, never instead of it: a reconcile may be freeing
        # sides, and a cancel handler must not be cut off half-way.
        task = asyncio.create_task(self._reconcile(transport, self._reconciling))
        self._reconciling = task
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _reconcile(
        self, transport: LeasedTransport, after: asyncio.Task[None] | None
    ) -> None:
        if after is not None:
            await asyncio.wait([after])
        held, freed = self._holder.held(), sorted(self._freed, key=_order)
        try:
            answer = await transport.reconcile(
                self.engine_id,
                incarnation=self.incarnation,
                session_id=self.session_id,
                held=held,
                freed=freed,
            )
        except HandoffRpcError as error:
            # Held sides keep their lease; the next subscription tries again.
            log.warning("reconcile failed: %s", error, extra=self._extra)
            return
        self.reconciles += 1
        self._freed.difference_update(freed)
        if answer.releases or answer.lost_applied:
            log.info(
                "reconciled %d held and %d freed sides: %d to free, %d reported lost",
                len(held),
                len(freed),
                len(answer.releases),
                answer.lost_applied,
                extra=self._extra,
            )
        ending = {(release.handoff_id, release.role) for release in answer.releases}
        self._holder.kept(side for side in held if side not in ending)
        await asyncio.gather(*(self._reclaim_release(release) for release in answer.releases))

    async def _reclaim_release(self, release: Release) -> None:
        side = (release.handoff_id, release.role)
        why = f"the coordinator says it ended here ({release.reason.name.lower()})"
        await self.reclaim(side, why, report_freed=False)

    async def reclaim(self, side: SideId, why: str, *, report_freed: bool = True) -> None:
        """Free an orphan: a side the coordinator no longer expects this engine to hold.

        ``report_freed``: tell the coordinator at the next reconcile (it did not
        say so itself; e.g. a report for it was answered NOT_FOUND).
        """
        for handoff_id, role in await self._holder.reclaim([side], why, Origin.RECONCILE):
            self.orphans_reclaimed += 1
            log.warning(
                "orphan reclaimed: %s side freed, %s",
                role.name.lower(),
                why,
                extra=self._extra | {"handoff_id": handoff_id},
            )
            if report_freed:
                self._freed.add((handoff_id, role))

    # --- lease -------------------------------------------------------------------

    async def _run_lease(self, transport: LeasedTransport) -> None:
        liveness = transport.liveness
        expired_for: float | None = None  # the sign of life the lease last expired after
        while True:
            last = liveness.last_heard
            delivery_timeout_s = liveness.delivery_timeout_s
            assert last is not None  # the lease starts at a confirmed subscription
            if delivery_timeout_s is None or liveness.heartbeat_s is None:
                # The coordinator now runs without heartbeats: no lease against it.
                await asyncio.sleep(MIN_LEASE_MARGIN_S)
                continue
            lease = lease_s(delivery_timeout_s)
            silent_s = time.monotonic() - last
            if expired_for is not None and last != expired_for:
                # Heard again after the lease fired, maybe on the very stream
                # that went silent (a healed cut): tell the coordinator now
                # what was freed, rather than at the next subscription.
                expired_for = None
                self._start_reconcile(transport)
            if silent_s < lease:
                await asyncio.sleep(lease - silent_s)
            elif last != expired_for:
                expired_for = last
                await self._expire(liveness.coordinator_incarnation, silent_s, lease)
            else:
                # Expired and still silent: nothing new can be held before
                # the next sign of life, which this checks for now and then.
                await asyncio.sleep(min(lease, MIN_LEASE_MARGIN_S))

    async def _expire(self, coordinator: str, silent_s: float, lease: float) -> None:
        self.lease_expiries += 1
        held = self._holder.held()
        log.error(
            "lease expired: nothing from coordinator incarnation %s for %.1f s (lease %.1f s); "
            "freeing the %d sides this engine holds before the coordinator declares it lost",
            coordinator,
            silent_s,
            lease,
            len(held),
            extra=self._extra,
        )
        freed = await self._holder.reclaim(held, "the lease expired", Origin.LEASE)
        self.freed_on_lease += len(freed)
        self._freed.update(freed)


def _order(side: SideId) -> tuple[str, int]:
    return side[0], side[1].value
