"""EngineSidecar: runs an engine's handlers for the actions the coordinator sends it.

The engine implements :class:`Engine` (or only its side: :class:`SourceEngine`,
:class:`DestinationEngine`): one async method per action kind, each returning
the action's :class:`~handoff_client.model.Outcome`. docs/engine-contract.md
says what each handler must do. The sidecar

- subscribes to the engine's actions (on one Connect stream that also carries
  its reports, unless told to use the unary RPCs), naming the engine's
  incarnation and its own session, and resubscribes, with jittered backoff,
  whenever the stream drops;
- always reads its stream: acquiring handlers (SubmitPrefill,
  ReserveDestination, StartTransfer, ActivateDestination) run up to
  ``max_concurrency`` at once, and cleanups (ReleaseSource, CancelSource,
  CancelDestination, and the COMPLETE notice) have their own
  ``cleanup_concurrency``, so handlers that hang never hold up a cleanup;
- keeps a tombstone per handoff side: once a cancel or release was taken
  for it, a late or redelivered acquiring action is answered FAILED without
  running its handler, and a cancel that arrives while an acquiring handler
  of that side runs waits for it, then runs;
- on COMPLETE, frees through the engine's own cancel handler what the
  engine may still hold and no cleanup action will free (an engine the
  server declared lost while it was alive): the source after any
  completion, the destination after CANCELED unless it was activated;
- reports each outcome, retrying until it lands;
- answers a redelivered action from its outcome cache instead of running the
  handler again, and ignores a redelivery whose handler is still running;
- logs, counts and skips an action of a kind it does not know (a newer server);
- runs a lease on the coordinator's signs of life and reconciles what the
  engine holds after every subscription (:mod:`handoff_client.link`): a side
  the coordinator no longer expects it to hold, or that it would free before
  hearing from it again, is freed through the engine's cancel handler;
- given a routing client of a sharded coordinator, holds one link per shard
  (stream, reconcile, lease), follows the shard map as it changes, and keeps
  each handoff's state under the shard whose stream its actions came on,
  where its outcomes and facts are reported (see :class:`EngineSidecar`);
- stops for good, after freeing everything the engine holds, when the server
  says a newer incarnation of the engine has subscribed
  (:class:`~handoff_client.errors.OlderIncarnationError`, raised by
  :meth:`EngineSidecar.wait` and :meth:`EngineSidecar.run`);
- gives the engine :class:`Facts` to report what it observes, ordered after
  the outcomes it already returned for the same handoff.

A handler that raises (or returns an outcome its action does not allow) is
answered FAILED, which starts cleanup; for a cleanup action, which may not
fail, the action is left unacknowledged and the server redelivers it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import secrets
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from types import TracebackType
from typing import Protocol, Self

from handoff_client import tracing
from handoff_client.cache import OutcomeCache
from handoff_client.client import HandoffClient
from handoff_client.client import Side as HeldSide
from handoff_client.errors import (
    HandoffRpcError,
    NotFoundError,
    OlderIncarnationError,
)
from handoff_client.facts import Facts as Facts  # re-exported: engines import it from here
from handoff_client.ledger import Ledger, Side
from handoff_client.link import CoordinatorLink
from handoff_client.model import (
    ACQUIRING_KINDS,
    CLEANUP_KINDS,
    NOOP,
    Action,
    ActionKind,
    Completion,
    Fact,
    Outcome,
    OutcomeKind,
    Role,
    outcome_allowed,
)
from handoff_client.outbox import Outbox
from handoff_client.placement import ShardMap
from handoff_client.retry import Backoff
from handoff_client.transport import SidecarTransport, TransportKind, make_transport

log = logging.getLogger("handoff.sidecar")

MAX_REASON = 1024  # bytes: the server takes at most 1 KiB of reason
# The answer to an acquiring action for a side already canceled or released:
# the server accepts FAILED for any acquiring action (in cleanup it changes
# nothing), and the engine takes nothing.
CLOSED_REASON = "{engine}: {kind} for a handoff this engine already canceled or released"
# How often the sidecar looks at its client's shard map. Looking is free: the
# client fetches the map only when its refresh is due, or soon after a shard
# did not answer.
FOLLOW_S = 1.0


def new_incarnation() -> str:
    """A fresh incarnation: start time in unix ms (13 digits), then random hex.

    Sortable by start time, so the server can tell a newer one from an older one.
    """
    return f"{time.time_ns() // 1_000_000:013d}-{secrets.token_hex(8)}"


class SourceEngine(Protocol):
    """A prefill engine's handlers. See docs/engine-contract.md.

    Every handler is idempotent per (handoff id, action id): after a sidecar
    restart under the same incarnation, the server redelivers what was
    outstanding and the handler runs again. Handlers may run concurrently,
    also for one handoff, except that the sidecar never runs a cancel or
    release while an acquiring handler of the same handoff and side runs.
    """

    async def submit_prefill(self, action: Action, facts: Facts) -> Outcome:
        """Run the prefill; answer SUBMITTED, then report SourceHeld when it holds its KV.

        FAILED (``failed(reason)``) if it cannot; that starts cleanup.
        """
        ...

    async def release_source(self, action: Action, facts: Facts) -> Outcome:
        """The destination has the KV: free the prefill's blocks; APPLIED, or NOOP if
        nothing was held. Never FAILED: raise to have it redelivered later."""
        ...

    async def cancel_source(self, action: Action, facts: Facts) -> Outcome:
        """Abort the prefill and free its blocks; APPLIED or NOOP. Never FAILED.

        It may arrive before the SubmitPrefill it cancels (which then never
        runs) or after it. A transfer this engine is pushing for the handoff
        is stopped (or waited for) before the blocks are freed: the
        destination is canceled at the same moment. ``action.attempt == 0``
        marks a cancel the sidecar runs on its own (on a COMPLETE notice, or
        when a newer incarnation replaced this one): its outcome is not reported.
        """
        ...

    async def complete(self, action: Action) -> None:
        """A notice that the handoff is over (``action.completion`` says how); no outcome.

        Anything the engine still held was freed through its cancel handler
        before this runs. It may be lost with a stream.
        """
        ...


class DestinationEngine(Protocol):
    """A decode engine's handlers. See :class:`SourceEngine` and docs/engine-contract.md."""

    async def reserve_destination(self, action: Action, facts: Facts) -> Outcome:
        """Reserve decode memory; answer ACCEPTED, then report DestinationReserved."""
        ...

    async def activate_destination(self, action: Action, facts: Facts) -> Outcome:
        """Start decoding; answer APPLIED. From then on the decode owns the request."""
        ...

    async def cancel_destination(self, action: Action, facts: Facts) -> Outcome:
        """Abort the decode (or the reservation) and free it; APPLIED or NOOP. Never FAILED.

        It may arrive before the action it cancels, or after it, also after
        a successful activation (the frontend canceled during decode). A
        transfer this engine is pulling for the handoff is stopped (or waited
        for) before the memory is freed. ``action.attempt == 0`` marks a
        cancel the sidecar runs on its own; its outcome is not reported.
        """
        ...

    async def complete(self, action: Action) -> None:
        """A notice that the handoff is over (``action.completion`` says how); no outcome."""
        ...


class Engine(SourceEngine, DestinationEngine, Protocol):
    """Both sides, plus the transfer (run by the handoff's ``transfer_executor``).

    The sidecar names the engine's memory with an incarnation: let it make
    one when it lives and dies with the engine; pass the engine's own
    (``EngineSidecar(..., incarnation=...)``, made once at the engine's start)
    when it runs beside an engine that outlives it. A new incarnation tells
    the server that everything the old one held is gone.

    Optional: ``async def held_handoffs(self) -> Iterable[tuple[str, Role]]``,
    the handoff sides the engine holds now. The sidecar calls it once, at its
    start, so that a sidecar restarted beside an engine that survived it (same
    incarnation) reconciles and leases those sides too. Against a sharded
    coordinator each side is reconciled with every shard, and freed only
    once none of them expects it held.
    """

    async def start_transfer(self, action: Action, facts: Facts) -> Outcome:
        """Start moving the KV (``action.delay_ms`` long); SCHEDULED, then TransferCompleted.

        A cancel of either side stops this transfer (or waits for it) before
        freeing: both sides are canceled at once.
        """
        ...


Handler = Callable[[Action, Facts], Awaitable[Outcome]]

HANDLER_NAMES: dict[ActionKind, str] = {
    ActionKind.SUBMIT_PREFILL: "submit_prefill",
    ActionKind.RESERVE_DESTINATION: "reserve_destination",
    ActionKind.START_TRANSFER: "start_transfer",
    ActionKind.ACTIVATE_DESTINATION: "activate_destination",
    ActionKind.RELEASE_SOURCE: "release_source",
    ActionKind.CANCEL_SOURCE: "cancel_source",
    ActionKind.CANCEL_DESTINATION: "cancel_destination",
}
# The cancel that frees each side when the sidecar frees on its own.
CANCEL_OF: dict[Role, ActionKind] = {
    Role.SOURCE: ActionKind.CANCEL_SOURCE,
    Role.DESTINATION: ActionKind.CANCEL_DESTINATION,
}


@dataclass(frozen=True, slots=True)
class SidecarStats:
    actions_received: int  # every delivery, redeliveries included
    handlers_run: int
    answered_from_cache: int  # redeliveries of an action whose outcome was known
    ignored_while_running: int  # redeliveries of an action whose handler was still running
    handler_errors: int  # handlers that raised or returned a disallowed outcome
    reconnects: int
    report_retries: int  # transient report failures, retried
    reports_rejected: int  # reports the server refused for good
    answered_closed: int = 0  # acquiring actions for a canceled or released side, not run
    freed_on_complete: int = 0  # cancels run on a COMPLETE notice for what was still held
    unknown_actions: int = 0  # actions of a kind this SDK does not know, skipped
    unimplemented: int = 0  # actions for a handler the engine does not have
    session_conflicts: int = 0  # subscriptions refused: a twin holds the stream
    reconciles: int = 0  # reconciles answered (one per confirmed subscription)
    orphans_reclaimed: int = 0  # sides freed because the coordinator no longer knew them
    lease_expiries: int = 0  # times the lease expired with the coordinator silent
    freed_on_lease: int = 0  # sides freed when the lease expired
    freed_unreported: int = 0  # sides freed on its own that no reconcile has told a coordinator


class _Shard:
    """One coordinator shard as the sidecar sees it: its link, and the state of the
    handoffs it owns (tombstones, outcomes, the order of their reports).

    It is the link's :class:`~handoff_client.link.Holder`: what the link
    reconciles, leases and reclaims is this shard's part of the engine.
    """

    def __init__(
        self, sidecar: EngineSidecar, name: str, transport: SidecarTransport, backoff: Backoff
    ) -> None:
        self.name = name
        self.transport = transport
        self.ledger = Ledger(sidecar.cache_size)
        self.cache = OutcomeCache(sidecar.cache_size)
        self.outbox = Outbox(backoff, sidecar.rng)
        self.link = CoordinatorLink(
            transport,
            self,
            engine_id=sidecar.engine_id,
            incarnation=sidecar.incarnation,
            session_id=sidecar.session_id,
            backoff=backoff,
            rng=sidecar.rng,
        )
        self.task: asyncio.Task[None] | None = None
        self._sidecar = sidecar

    def held(self) -> list[HeldSide]:
        return self._sidecar._held(self)

    async def reclaim(self, sides: Iterable[HeldSide], why: str) -> list[HeldSide]:
        return await self._sidecar._reclaim(self, sides, why)

    def kept(self, sides: Iterable[HeldSide]) -> None:
        self._sidecar._kept(self, sides)

    async def fenced(self, error: OlderIncarnationError) -> None:
        await self._sidecar._fenced(error)


class EngineSidecar:
    """Connects one engine to the coordinator; use it with ``async with``, or :meth:`run`.

    ``connection`` is a :class:`~handoff_client.client.HandoffClient` or any
    :class:`~handoff_client.transport.SidecarTransport`. Given a client, the
    sidecar talks over one Connect stream (``transport="connect"``, the
    default) or over StreamActions plus unary reports (``transport="unary"``)
    to each shard in the client's shard map: one link per shard (a single
    coordinator, or one from before shards, is one link on the client's own
    channel, as before shards). It follows the map: a new shard gets a link,
    a shard back on a new address is reconnected there, a shard gone from the
    map has its link closed once the engine holds nothing it owns. A shard
    that is down stops only the handoffs it owns; its lease frees only them.
    Given a transport, the sidecar has that one link.

    Handlers get :attr:`facts`; the engine can also use it outside any
    handler, e.g. to report a decode that crashed. A fact goes to the shard
    whose stream brought the handoff's actions, else to the client's
    ``owner_of`` the handoff.

    ``incarnation`` names the engine's memory: leave it None when the sidecar
    lives and dies with its engine (one is made per sidecar, see
    :func:`new_incarnation`); pass the engine's own, made once at the
    engine's start, when the sidecar runs beside an engine that outlives it,
    so a restarted sidecar resumes instead of having the engine declared lost.
    :attr:`session_id` is random per sidecar object.

    ``wrap_transport``, for fault injection and instrumentation: given a
    client, the sidecar calls it with each shard's name and the transport it
    made for that shard's link, and the link uses what it returns (given a
    transport, wrap that yourself). Return a
    :class:`~handoff_client.transport.LeasedTransport`, or the link runs no
    lease and no reconcile.
    """

    def __init__(
        self,
        connection: HandoffClient | SidecarTransport,
        engine_id: str,
        engine: SourceEngine | DestinationEngine,
        *,
        max_concurrency: int = 64,
        cleanup_concurrency: int = 64,
        reconnect_backoff: Backoff | None = None,
        cache_size: int = 65_536,
        stop_grace_s: float = 5.0,
        rng: random.Random | None = None,
        transport: TransportKind | None = None,
        incarnation: str | None = None,
        wrap_transport: Callable[[str, SidecarTransport], SidecarTransport] | None = None,
    ) -> None:
        if max_concurrency < 1 or cleanup_concurrency < 1:
            raise ValueError("max_concurrency and cleanup_concurrency must be >= 1")
        if cache_size < 1:
            raise ValueError("cache_size must be >= 1")
        self.engine_id = engine_id
        self.incarnation = incarnation or new_incarnation()
        self.session_id = secrets.token_hex(16)
        self.cache_size = cache_size
        self.rng = rng or random.Random()
        self._engine = engine
        self._client: HandoffClient | None = None
        self._given: SidecarTransport | None = None
        if isinstance(connection, HandoffClient):
            self._client = connection
            self._kind: TransportKind = transport or "connect"
        elif transport is not None:
            raise ValueError("transport= chooses how to use a HandoffClient; a transport was given")
        else:
            self._given = connection
        self._backoff = reconnect_backoff or Backoff()
        self._wrap_transport = wrap_transport
        self._slots = asyncio.Semaphore(max_concurrency)
        self._cleanup_slots = asyncio.Semaphore(cleanup_concurrency)
        self._shards: dict[str, _Shard] = {}  # by shard name ("" for a given transport)
        self._opened = asyncio.Event()  # the first links exist
        self._retired: list[_Shard] = []  # links closed with their shard: their counts
        # Held sides from the engine's held_handoffs() that no shard has claimed
        # yet, each with the shards that said they need not be held.
        self._unattributed: dict[HeldSide, set[str]] = {}
        self.facts = Facts(self._send_fact)
        self._stop_grace_s = stop_grace_s
        self._handlers: dict[ActionKind, Handler] = {}
        for kind, name in HANDLER_NAMES.items():
            handler = getattr(engine, name, None)
            if handler is not None:
                self._handlers[kind] = handler
        self._running: set[tuple[str, str, int]] = set()  # (shard, handoff id, action id)
        self._tasks: set[asyncio.Task[None]] = set()
        self._reader: asyncio.Task[None] | None = None
        self._stopping = False
        self._ended = asyncio.Event()  # stopped on its own (fenced)
        self._fenced_by: OlderIncarnationError | None = None
        self._received = self._handled = self._cache_hits = self._ignored = 0
        self._handler_errors = self._rejected = self._unreached = 0
        self._closed_hits = self._freed = self._unknown = self._unimplemented = 0

    @property
    def transport(self) -> SidecarTransport:
        """How this sidecar talks to the coordinator (to its first shard, when sharded)."""
        if self._given is not None:
            return self._given
        if not self._shards:
            raise RuntimeError("the sidecar has not learned its shards yet")
        return next(iter(self._shards.values())).transport

    @property
    def shards(self) -> tuple[str, ...]:
        """The shards this sidecar has a link to now (empty before it learned them)."""
        return tuple(self._shards)

    @property
    def stats(self) -> SidecarStats:
        links = [part.link for part in [*self._shards.values(), *self._retired]]
        outboxes = [part.outbox for part in [*self._shards.values(), *self._retired]]
        return SidecarStats(
            actions_received=self._received,
            handlers_run=self._handled,
            answered_from_cache=self._cache_hits,
            ignored_while_running=self._ignored,
            handler_errors=self._handler_errors,
            reconnects=self._unreached + sum(link.reconnects for link in links),
            report_retries=sum(outbox.retries for outbox in outboxes),
            reports_rejected=self._rejected,
            answered_closed=self._closed_hits,
            freed_on_complete=self._freed,
            unknown_actions=self._unknown,
            unimplemented=self._unimplemented,
            session_conflicts=sum(link.conflicts for link in links),
            reconciles=sum(link.reconciles for link in links),
            orphans_reclaimed=sum(link.orphans_reclaimed for link in links),
            lease_expiries=sum(link.lease_expiries for link in links),
            freed_on_lease=sum(link.freed_on_lease for link in links),
            freed_unreported=sum(link.freed_unreported for link in links),
        )

    async def wait_subscribed(self) -> None:
        """Until the server confirms a subscription on every shard's link (at start,
        or after a reconnect).

        Raises :class:`~handoff_client.errors.OlderIncarnationError` if the
        sidecar was fenced instead.
        """
        subscribed = asyncio.ensure_future(self._all_subscribed())
        ended = asyncio.ensure_future(self._ended.wait())
        try:
            await asyncio.wait((subscribed, ended), return_when=asyncio.FIRST_COMPLETED)
        finally:
            subscribed.cancel()
            ended.cancel()
        if not subscribed.done() or subscribed.cancelled():
            self._raise_if_fenced()

    async def _all_subscribed(self) -> None:
        await self._opened.wait()
        while pending := [p for p in self._shards.values() if not p.link.subscribed.is_set()]:
            await pending[0].link.subscribed.wait()

    async def wait(self) -> None:
        """Until the sidecar stops on its own, which it only does when fenced.

        Raises :class:`~handoff_client.errors.OlderIncarnationError` once a
        newer incarnation of the engine has subscribed and everything this
        sidecar's engine held was freed through its cancel handlers.
        """
        await self._ended.wait()
        self._raise_if_fenced()

    async def run(self) -> None:
        """Start, serve until fenced (raising as :meth:`wait` does) or cancelled, stop."""
        async with self:
            await self.wait()

    def _raise_if_fenced(self) -> None:
        if self._fenced_by is not None:
            raise self._fenced_by

    async def __aenter__(self) -> Self:
        self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        await self.stop()

    def start(self) -> None:
        if self._reader is not None:
            raise RuntimeError("the sidecar was already started")
        self._reader = asyncio.create_task(self._run(), name=f"sidecar-{self.engine_id}")

    async def stop(self, grace_s: float | None = None) -> None:
        """Take no new actions, give running handlers and queued reports ``grace_s``,
        cancel the rest, unsubscribe.

        ``grace_s=0`` stops at once, as a crashed engine would.
        """
        grace = self._stop_grace_s if grace_s is None else grace_s
        loop = asyncio.get_running_loop()
        deadline = loop.time() + grace
        # Actions delivered from now on are left alone: they stay outstanding
        # and the server sends them again to the engine's next subscription.
        self._stopping = True
        tasks = set(self._tasks)
        if tasks and grace > 0:
            await asyncio.wait(tasks, timeout=grace)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        outboxes = [part.outbox for part in self._shards.values()]
        await asyncio.gather(*(o.close(max(deadline - loop.time(), 0.0)) for o in outboxes))
        # Unsubscribe last: on Connect the stream also carries the reports
        # the grace lets land.
        if self._reader is not None:
            self._reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reader

    # --- the streams: one link per shard -------------------------------------------

    async def _run(self) -> None:
        try:
            # Which shard each held side belongs to is unknown: every shard is
            # asked, and a side is freed only once none of them expects it held.
            self._unattributed = {side: set() for side in await self._engine_holds()}
            if self._given is not None:
                self._open("", self._given)
                await self._ended.wait()
                return
            client = self._client
            assert client is not None
            # No link before a coordinator has answered: a link to the client's
            # own address, standing in for an unknown map, would duplicate the
            # link to whichever shard that address reaches.
            shard_map = await self._learn(client)
            while True:
                self._follow(client, shard_map)
                await asyncio.sleep(FOLLOW_S)
                shard_map = await client.shard_map()
        finally:
            parts = [*self._shards.values(), *self._retired]
            links = [part.task for part in parts if part.task is not None]
            for task in links:
                task.cancel()
            await asyncio.gather(*links, return_exceptions=True)

    async def _learn(self, client: HandoffClient) -> ShardMap:
        """The shard map, asked for with the reconnect backoff until a coordinator answers."""
        failures = 0
        while (shard_map := await client.learn_shard_map()) is None:
            failures += 1
            self._unreached += 1
            await asyncio.sleep(self._backoff.delay_s(failures, self.rng))
        return shard_map

    async def _engine_holds(self) -> list[HeldSide]:
        held_handoffs = getattr(self._engine, "held_handoffs", None)
        if held_handoffs is None:
            return []
        # Restarted beside an engine that survived: what it holds is
        # reconciled (and leased) like what this sidecar acquired itself.
        return [(handoff_id, role) for handoff_id, role in await held_handoffs()]

    def _open(self, name: str, transport: SidecarTransport) -> None:
        part = _Shard(self, name, transport, self._backoff)
        self._shards[name] = part
        part.task = asyncio.create_task(
            part.link.run(lambda action: self._dispatch(part, action)),
            name=f"sidecar-{self.engine_id}-{name or 'coordinator'}",
        )
        self._opened.set()

    def _follow(self, client: HandoffClient, shard_map: ShardMap) -> None:
        """Open a link to each new shard; close the link of a shard gone from the
        map once the engine holds nothing that shard owns. A shard's new address
        needs nothing here: its link dials the map's address at each subscription."""
        for name in shard_map.names:
            if name not in self._shards:
                if self._shards:
                    log.info("shard %s joined: opening a link to it", name, extra=self._extra)
                transport = make_transport(client, self._kind, name)
                if self._wrap_transport is not None:
                    transport = self._wrap_transport(name, transport)
                self._open(name, transport)
        for name, part in list(self._shards.items()):
            if name in shard_map.names or self._busy(part):
                continue
            log.info("shard %s left the map: closing its link", name, extra=self._extra)
            del self._shards[name]
            self._retired.append(part)
            if part.task is not None:
                part.task.cancel()

    def _busy(self, part: _Shard) -> bool:
        """Whether the engine may hold anything, or owes any report, for ``part``'s handoffs."""
        return (
            any(True for _ in part.ledger.holding())
            or any(key[0] == part.name for key in self._running)
            or part.outbox.pending > 0
            or any(part.name not in said for said in self._unattributed.values())
        )

    # --- what each link reconciles, leases and reclaims ----------------------------

    def _held(self, part: _Shard) -> list[HeldSide]:
        """What ``part``'s lease and reconcile cover: its held sides, but no activated
        decode, and every side no shard has claimed that it has not disowned."""
        held = [(h, role) for h, role, side in part.ledger.holding() if not side.activated]
        return held + [side for side, said in self._unattributed.items() if part.name not in said]

    async def _reclaim(self, part: _Shard, sides: Iterable[HeldSide], why: str) -> list[HeldSide]:
        """Close ``sides`` and free those still held (not an activated decode) on its own."""
        owed = []
        for handoff_id, role in sides:
            if (handoff_id, role) in self._unattributed:
                side = self._disowned(part, (handoff_id, role))
                if side is None:
                    continue  # another shard may still expect it held
            else:
                # Found, never made: a side another shard claimed meanwhile is not this one's.
                side = part.ledger.find(handoff_id, role)
                if side is None or not side.holds or side.activated:
                    continue
            side.closed = True  # a later acquiring action is answered from the tombstone
            cause = Action(handoff_id, 0, CANCEL_OF[role], role, self.engine_id, 0)
            owed.append((handoff_id, role, self._free_when_idle(cause, role, side, why)))
        await asyncio.gather(*(free for _, _, free in owed))
        return [(handoff_id, role) for handoff_id, role, _ in owed]

    def _disowned(self, part: _Shard, held: HeldSide) -> Side | None:
        """``part`` does not expect the unattributed side held: its tombstone, to free,
        once no shard does; else None."""
        said = self._unattributed[held]
        said.add(part.name)
        if not said.issuperset(self._shards):
            return None
        del self._unattributed[held]
        side = part.ledger.side(*held)
        side.acquired = True
        return side

    def _kept(self, part: _Shard, sides: Iterable[HeldSide]) -> None:
        """``part`` expects these held: an unattributed one is its own from now on."""
        for held in sides:
            if self._unattributed.pop(held, None) is not None:
                part.ledger.side(*held).acquired = True
                log.info(
                    "held %s side belongs to shard %s",
                    held[1].name.lower(),
                    part.name,
                    extra=self._extra | {"handoff_id": held[0]},
                )

    async def _fenced(self, error: OlderIncarnationError) -> None:
        await self._free_everything()
        self._fenced_by = error
        self._ended.set()

    def _dispatch(self, part: _Shard, action: Action) -> None:
        """Take one delivered action. Never waits: the streams are always read."""
        self._received += 1
        if self._stopping:
            return
        kind = action.kind
        if kind is ActionKind.UNKNOWN:
            self._unknown += 1
            log.warning(
                "skipped an action of a kind this SDK does not know (a newer server?)",
                extra=self._log_extra(action),
            )
            return
        if kind is ActionKind.COMPLETE:
            self._take_complete(part, action)
            return
        cached = part.cache.get(action.handoff_id, action.id)
        if cached is not None:
            self._cache_hits += 1
            self._spawn(self._await_report(part, action, self._send_outcome(part, action, cached)))
            return
        key = (part.name, action.handoff_id, action.id)
        if key in self._running:
            self._ignored += 1  # the running handler reports when it is done
            return
        side = part.ledger.side(action.handoff_id, action.target)
        if kind in ACQUIRING_KINDS:
            if side.closed:
                self._answer_closed(part, action)
                return
            self._running.add(key)
            self._spawn(self._acquire(part, action, side))
        else:
            side.closed = True  # from now on, nothing is acquired for this side
            self._running.add(key)
            self._spawn(self._clean(part, action, side))

    def _spawn(self, work: Awaitable[None]) -> None:
        task = asyncio.ensure_future(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # --- handlers ---------------------------------------------------------------

    async def _acquire(self, part: _Shard, action: Action, side: Side) -> None:
        key = (part.name, action.handoff_id, action.id)
        report = None
        try:
            async with self._slots:
                if self._stopping:
                    return  # left outstanding for the next subscription
                if side.closed:
                    # Canceled while it waited for a slot: it never starts.
                    self._running.discard(key)
                    self._answer_closed(part, action)
                    return
                # An engine without the handler takes nothing: nothing to free later.
                implemented = action.kind in self._handlers
                if implemented:
                    side.enter()
                try:
                    outcome = await self._run_handler(action)
                finally:
                    if implemented:
                        side.leave()
            assert outcome is not None  # only a cleanup's failure has no outcome
            if (
                action.kind is ActionKind.ACTIVATE_DESTINATION
                and outcome.kind is OutcomeKind.APPLIED
            ):
                side.activated = True
            part.cache.put(action.handoff_id, action.id, outcome)
            # Queued before this task yields, so the facts the handler's own
            # background work reports for this handoff line up behind it.
            report = self._send_outcome(part, action, outcome)
        finally:
            self._running.discard(key)
        await self._await_report(part, action, report)

    async def _clean(self, part: _Shard, action: Action, side: Side) -> None:
        key = (part.name, action.handoff_id, action.id)
        report = None
        try:
            # Outside any slot: waiting for a stuck handler must not hold
            # capacity that other handoffs' cleanups need.
            await side.wait_idle()
            async with side.freeing(), self._cleanup_slots:
                if self._stopping:
                    return
                # Freed on its own (lease, orphan, notice): the engine's cancel
                # ran once already, and the side was closed since.
                outcome = NOOP if side.freed_here else await self._run_handler(action)
            if outcome is None:
                return  # unacknowledged: the server redelivers it
            part.cache.put(action.handoff_id, action.id, outcome)
            report = self._send_outcome(part, action, outcome)
        finally:
            self._running.discard(key)
        await self._await_report(part, action, report)

    def _answer_closed(self, part: _Shard, action: Action) -> None:
        self._closed_hits += 1
        log.info(
            "%s answered FAILED without running: this side was already canceled or released",
            action.kind.name,
            extra=self._log_extra(action),
        )
        outcome = Outcome.failed(CLOSED_REASON.format(engine=self.engine_id, kind=action.kind.name))
        part.cache.put(action.handoff_id, action.id, outcome)
        self._spawn(self._await_report(part, action, self._send_outcome(part, action, outcome)))

    async def _run_handler(self, action: Action) -> Outcome | None:
        """The handler's outcome, or None to leave a cleanup action for redelivery."""
        handler = self._handlers.get(action.kind)
        if handler is None:
            return self._unimplemented_outcome(action)
        self._handled += 1
        try:
            with tracing.handler_span(action):
                outcome = await handler(action, self.facts)
        except Exception as error:  # an engine bug must not wedge the handoff
            self._handler_errors += 1
            log.exception("%s handler raised", action.kind.name, extra=self._log_extra(action))
            problem = f"{action.kind.name} handler raised {type(error).__name__}: {error}"
        else:
            if outcome_allowed(action.kind, outcome):
                return outcome
            self._handler_errors += 1
            problem = f"{action.kind.name} handler returned {outcome.kind.name}"
            log.error(problem, extra=self._log_extra(action))
        if action.kind in CLEANUP_KINDS:
            return None
        # Cut by bytes: the server's limit is on the encoded reason.
        return Outcome.failed(problem.encode()[:MAX_REASON].decode(errors="ignore"))

    def _unimplemented_outcome(self, action: Action) -> Outcome:
        self._unimplemented += 1
        name = HANDLER_NAMES[action.kind]
        log.error(
            "engine %s has no %s handler (a %s-only engine given the other side's work?)",
            self.engine_id,
            name,
            "decode" if action.target is Role.SOURCE else "prefill",
            extra=self._log_extra(action),
        )
        if action.kind in CLEANUP_KINDS:
            # An engine without this side's handlers never took anything for it.
            return NOOP
        return Outcome.failed(f"engine {self.engine_id} does not implement {name}")

    # --- completion -------------------------------------------------------------

    def _take_complete(self, part: _Shard, action: Action) -> None:
        """Close both sides now; free what is still held once their handlers are done."""
        part.cache.forget(action.handoff_id)
        owed: list[tuple[Role, Side]] = []
        for role in CANCEL_OF:
            side = part.ledger.side(action.handoff_id, role)
            if not side.closed:
                side.closed = True
                owed.append((role, side))
        self._spawn(self._complete(action, owed))

    async def _complete(self, action: Action, sides: list[tuple[Role, Side]]) -> None:
        for role, side in sides:
            await side.wait_idle()
            # The decode owns an activated request; only a reopened handoff's
            # CancelDestination stops it, never a notice.
            keep = role is Role.DESTINATION and (
                side.activated or action.completion is not Completion.CANCELED
            )
            if side.acquired and not keep:
                self._freed += 1
                await self._free(action, role, side, "the handoff completed while it still held")
        async with self._cleanup_slots:
            try:
                with tracing.handler_span(action):
                    await self._engine.complete(action)
            except Exception:
                self._handler_errors += 1
                log.exception("COMPLETE handler raised", extra=self._log_extra(action))

    async def _free(self, cause: Action, role: Role, side: Side, why: str) -> None:
        """Run the engine's cancel for ``role`` on its own; nothing is reported."""
        kind = CANCEL_OF[role]
        cancel = Action(
            handoff_id=cause.handoff_id,
            id=cause.id,
            kind=kind,
            target=role,
            engine_id=self.engine_id,
            attempt=0,
        )
        log.info("%s: running %s", why, kind.name, extra=self._log_extra(cancel))
        async with side.freeing(), self._cleanup_slots:
            side.freed_here = await self._run_handler(cancel) is not None

    async def _free_everything(self) -> None:
        """Fenced: free, through the engine's cancel handlers, every side it may hold."""
        self._stopping = True
        frees = []
        holding = [held for part in self._shards.values() for held in part.ledger.holding()]
        unattributed, self._unattributed = self._unattributed, {}
        holding += [(h, role, Side(acquired=True)) for h, role in unattributed]
        for handoff_id, role, side in holding:
            side.closed = True
            cause = Action(handoff_id, 0, CANCEL_OF[role], role, self.engine_id, 0)
            frees.append(self._free_when_idle(cause, role, side, "replaced by a newer incarnation"))
        await asyncio.gather(*frees)

    async def _free_when_idle(self, cause: Action, role: Role, side: Side, why: str) -> None:
        await side.wait_idle()
        await self._free(cause, role, side, why)

    # --- reports ------------------------------------------------------------------

    @staticmethod
    def _send_outcome(part: _Shard, action: Action, outcome: Outcome) -> asyncio.Future[None]:
        return part.outbox.send(
            action.handoff_id,
            lambda: part.transport.report_outcome(action.handoff_id, action.id, outcome),
        )

    def _send_fact(self, handoff_id: str, fact: Fact) -> asyncio.Future[None]:
        part = self._owner(handoff_id)
        return part.outbox.send(handoff_id, lambda: part.transport.report_fact(handoff_id, fact))

    def _owner(self, handoff_id: str) -> _Shard:
        """The shard a fact about ``handoff_id`` goes to: the one whose stream brought
        its actions; for a handoff no action has come for yet, the client's owner."""
        for part in self._shards.values():
            if part.ledger.knows(handoff_id):
                return part
        if not self._shards:
            raise RuntimeError("the sidecar has not learned its shards yet: nothing to report to")
        if self._client is not None and len(self._shards) > 1:
            owner = self._shards.get(self._client.owner_of(handoff_id))
            if owner is not None:
                return owner
        return next(iter(self._shards.values()))

    async def _await_report(
        self, part: _Shard, action: Action, report: asyncio.Future[None] | None
    ) -> None:
        if report is None:
            return
        try:
            await report
        except NotFoundError:
            # Abandoned, past retention, or a coordinator that lost its state:
            # nobody is waiting for this answer, nor will free what it holds.
            self._rejected += 1
            log.info("outcome for an unknown handoff dropped", extra=self._log_extra(action))
            side = (action.handoff_id, action.target)
            await part.link.reclaim(side, "a report for it was answered NOT_FOUND")
        except HandoffRpcError as error:
            self._rejected += 1
            log.error("outcome refused: %s", error, extra=self._log_extra(action))

    @property
    def _extra(self) -> dict[str, object]:
        return {"engine_id": self.engine_id}

    def _log_extra(self, action: Action) -> dict[str, object]:
        return {
            "engine_id": self.engine_id,
            "handoff_id": action.handoff_id,
            "action_id": action.id,
        }
