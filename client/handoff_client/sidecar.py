"""EngineSidecar: runs an engine's handlers for the actions the coordinator sends it.

The engine implements :class:`Engine` (or only its side: :class:`SourceEngine`,
:class:`DestinationEngine`): one async method per action kind, each returning
the action's :class:`~handoff_client.model.Outcome`. docs/engine-contract.md
says what each handler must do. The sidecar

- subscribes to the engine's actions (on one Connect stream that also carries
  its reports, unless told to use the unary RPCs), naming the engine's
  incarnation and its own session, and resubscribes, with jittered backoff,
  whenever the stream drops (:mod:`handoff_client.link`);
- always reads its stream: acquiring handlers (SubmitPrefill,
  ReserveDestination, StartTransfer, ActivateDestination) run up to
  ``max_concurrency`` at once, and cleanups (ReleaseSource, CancelSource,
  CancelDestination, and the COMPLETE notice) have their own
  ``cleanup_concurrency``, so handlers that hang never hold up a cleanup;
- runs each handler in its own task, bounded by ``handler_timeout_s``
  (:mod:`handoff_client.runner`);
- keeps a tombstone per handoff side (:mod:`handoff_client.ledger`): once a
  cancel or release was taken for it, a late or redelivered acquiring action
  is answered FAILED without running its handler; a free of the side cancels
  the acquiring handlers still running for it, waits at most
  ``interrupt_grace_s`` for them, then runs; and once one free ran, any later
  cleanup of the side is answered NOOP without calling the engine
  (:mod:`handoff_client.frees`);
- on COMPLETE, frees through the engine's own cancel handler what the
  engine may still hold and no cleanup action will free (an engine the
  server declared lost while it was alive): the source after any
  completion, the destination after CANCELED unless it was activated;
- reports each outcome, retrying until it lands;
- answers a redelivered action from its outcome cache instead of running the
  handler again, and ignores a redelivery whose handler is still running;
- logs, counts and skips an action of a kind it does not know (a newer server);
- runs a lease on the coordinator's signs of life and reconciles what the
  engine holds after every subscription: a side the coordinator no longer
  expects it to hold, or that it would free before hearing from it again,
  is freed through the engine's cancel handler;
- given a routing client of a sharded coordinator, holds one link per shard
  (:mod:`handoff_client.parts`), follows the shard map as it changes, and
  keeps each handoff's state under the shard whose stream its actions came
  on, where its outcomes and facts are reported;
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
from collections.abc import Awaitable, Callable
from types import TracebackType
from typing import Self

from handoff_client import tracing
from handoff_client.client import HandoffClient, SideId
from handoff_client.engine import DestinationEngine as DestinationEngine
from handoff_client.engine import Engine as Engine
from handoff_client.engine import SourceEngine as SourceEngine
from handoff_client.errors import HandoffRpcError, NotFoundError, OlderIncarnationError
from handoff_client.facts import Facts as Facts  # re-exported: engines import it from here
from handoff_client.frees import CANCEL_OF, Freer
from handoff_client.ledger import SideRecord
from handoff_client.model import (
    ACQUIRING_KINDS,
    APPLIED,
    Action,
    ActionKind,
    Completion,
    Fact,
    Origin,
    Outcome,
    Role,
)
from handoff_client.parts import ShardPart, Unattributed
from handoff_client.placement import ShardMap
from handoff_client.retry import Backoff
from handoff_client.runner import HANDLER_NAMES, Handler, HandlerRunner, describe, log_extra
from handoff_client.stats import Counters
from handoff_client.stats import SidecarStats as SidecarStats  # re-exported
from handoff_client.transport import SidecarTransport, TransportKind, make_transport

log = logging.getLogger("handoff.sidecar")

# The answer to an acquiring action for a side already canceled or released:
# the server accepts FAILED for any acquiring action (in cleanup it changes
# nothing), and the engine takes nothing.
CLOSED_REASON = "{engine}: {kind} for a handoff this engine already canceled or released"
# How often the sidecar looks at its client's shard map. Looking is free: the
# client fetches the map only when its refresh is due, or soon after a shard
# did not answer.
FOLLOW_S = 1.0
HANDLER_TIMEOUT_S = 30.0
INTERRUPT_GRACE_S = 1.0


def new_incarnation() -> str:
    """A fresh incarnation: start time in unix ms (13 digits), then random hex.

    Sortable by start time, so the server can tell a newer one from an older one.
    """
    return f"{time.time_ns() // 1_000_000:013d}-{secrets.token_hex(8)}"


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

    ``handler_timeout_s`` bounds every handler call: past it the handler is
    cancelled (an acquiring action is answered FAILED, a cleanup is tried
    again). ``interrupt_grace_s`` is how long a cancelled handler gets to
    unwind before the sidecar goes on without it (and frees its side anyway).

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
        handler_timeout_s: float = HANDLER_TIMEOUT_S,
        interrupt_grace_s: float = INTERRUPT_GRACE_S,
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
        self._shards: dict[str, ShardPart] = {}  # by shard name ("" for a given transport)
        self._opened = asyncio.Event()  # the first links exist
        self._retired: list[ShardPart] = []  # links closed with their shard: their counts
        self._unattributed = Unattributed((), lambda: self._shards)
        self.facts = Facts(self._send_fact)
        self._stop_grace_s = stop_grace_s
        handlers: dict[ActionKind, Handler] = {}
        for kind, name in HANDLER_NAMES.items():
            handler = getattr(engine, name, None)
            if handler is not None:
                handlers[kind] = handler
        self._counters = Counters()
        self._runner = HandlerRunner(
            engine_id,
            handlers,
            self.facts,
            self._counters,
            timeout_s=handler_timeout_s,
            grace_s=interrupt_grace_s,
            on_late=self._free_late,
        )
        self._freer = Freer(
            engine_id,
            self._runner,
            self._counters,
            concurrency=cleanup_concurrency,
            backoff=self._backoff,
            rng=self.rng,
        )
        self._tasks: set[asyncio.Task[None]] = set()
        self._reader: asyncio.Task[None] | None = None
        self._stopping = False
        self._ended = asyncio.Event()  # stopped on its own (fenced)
        self._fenced_by: OlderIncarnationError | None = None

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
        parts = [*self._shards.values(), *self._retired]
        return self._counters.snapshot(
            (part.link for part in parts), (part.outbox for part in parts)
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

    async def stop(self, grace_s: float | None = None, *, free_held: bool = False) -> None:
        """Take no new actions, give running handlers and queued reports ``grace_s``,
        cancel the rest, unsubscribe.

        ``grace_s=0`` stops at once, as a crashed engine would. By default the
        engine keeps what it holds, for a sidecar restarted beside it under
        the same incarnation to resume. ``free_held=True`` stops for good:
        first every side the engine holds (no activated decode) is freed
        through its cancel handler (``action.origin`` STOP).
        """
        if free_held:
            await self._free_everything(Origin.STOP, keep_activated=True)
        grace = self._stop_grace_s if grace_s is None else grace_s
        loop = asyncio.get_running_loop()
        deadline = loop.time() + grace
        # Actions delivered from now on are left alone: they stay outstanding
        # and the server sends them again to the engine's next subscription.
        self._stopping = self._freer.stopping = True
        tasks = set(self._tasks)
        if tasks and grace > 0:
            await asyncio.wait(tasks, timeout=grace)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        handlers = set(self._runner.tasks)  # unresponsive ones the sidecar went on without
        for handler in handlers:
            handler.cancel()
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
            self._unattributed = Unattributed(await self._engine_holds(), lambda: self._shards)
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
            self._counters.unreached += 1
            await asyncio.sleep(self._backoff.delay_s(failures, self.rng))
        return shard_map

    async def _engine_holds(self) -> list[SideId]:
        held_handoffs = getattr(self._engine, "held_handoffs", None)
        if held_handoffs is None:
            return []
        # Restarted beside an engine that survived: what it holds is
        # reconciled (and leased) like what this sidecar acquired itself.
        return [(handoff_id, role) for handoff_id, role in await held_handoffs()]

    def _open(self, name: str, transport: SidecarTransport) -> None:
        part = ShardPart(
            name,
            transport,
            engine_id=self.engine_id,
            incarnation=self.incarnation,
            session_id=self.session_id,
            cache_size=self.cache_size,
            backoff=self._backoff,
            rng=self.rng,
            freer=self._freer,
            unattributed=self._unattributed,
            on_fenced=self._fenced,
        )
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
            if name in shard_map.names or part.busy:
                continue
            log.info("shard %s left the map: closing its link", name, extra=self._extra)
            del self._shards[name]
            self._retired.append(part)
            if part.task is not None:
                part.task.cancel()

    async def _fenced(self, error: OlderIncarnationError) -> None:
        await self._free_everything(Origin.FENCED, keep_activated=False)
        self._fenced_by = error
        self._ended.set()

    # --- dispatch -------------------------------------------------------------------

    def _dispatch(self, part: ShardPart, action: Action) -> None:
        """Take one delivered action. Never waits: the streams are always read."""
        self._counters.received += 1
        if self._stopping:
            return
        kind = action.kind
        if kind is ActionKind.UNKNOWN:
            self._counters.unknown += 1
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
            self._counters.cache_hits += 1
            self._spawn(self._await_report(part, action, self._send_outcome(part, action, cached)))
            return
        key = (action.handoff_id, action.id)
        if key in part.running:
            self._counters.ignored += 1  # the running handler reports when it is done
            return
        side = part.ledger.side(action.handoff_id, action.target)
        if kind in ACQUIRING_KINDS:
            if side.closed:
                self._answer_closed(part, action)
                return
            part.running.add(key)
            self._spawn(self._acquire(part, action, side))
        else:
            side.close()  # from now on, nothing is acquired for this side
            part.running.add(key)
            self._spawn(self._clean(part, action, side))

    def _spawn(self, work: Awaitable[None]) -> None:
        task = asyncio.ensure_future(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _acquire(self, part: ShardPart, action: Action, side: SideRecord) -> None:
        key = (action.handoff_id, action.id)
        reports: list[asyncio.Future[None]] = []

        def settle(outcome: Outcome) -> None:
            if action.kind is ActionKind.ACTIVATE_DESTINATION and outcome == APPLIED:
                side.activate()
            part.cache.put(action.handoff_id, action.id, outcome)
            # Queued before the handler's task yields, so the facts its own
            # background work reports for this handoff line up behind it.
            reports.append(self._send_outcome(part, action, outcome))

        try:
            async with self._slots:
                if self._stopping:
                    return  # left outstanding for the next subscription
                if side.closed:
                    # Canceled while it waited for a slot: it never starts.
                    part.running.discard(key)
                    self._answer_closed(part, action)
                    return
                # An engine without the handler takes nothing: nothing to free later.
                if self._runner.has(action.kind):
                    side.take()
                await self._runner.run(action, side, settle)
        finally:
            part.running.discard(key)
        for report in reports:
            await self._await_report(part, action, report)

    async def _clean(self, part: ShardPart, action: Action, side: SideRecord) -> None:
        key = (action.handoff_id, action.id)
        report = None
        try:
            outcome = await self._freer.clean(action, side)
            if outcome is None:
                return  # unacknowledged: the server redelivers it
            part.cache.put(action.handoff_id, action.id, outcome)
            report = self._send_outcome(part, action, outcome)
        finally:
            part.running.discard(key)
        await self._await_report(part, action, report)

    def _answer_closed(self, part: ShardPart, action: Action) -> None:
        self._counters.closed_hits += 1
        log.info(
            "%s answered FAILED without running: this side was already canceled or released",
            action.kind.name,
            extra=self._log_extra(action),
        )
        outcome = Outcome.failed(CLOSED_REASON.format(engine=self.engine_id, kind=action.kind.name))
        part.cache.put(action.handoff_id, action.id, outcome)
        self._spawn(self._await_report(part, action, self._send_outcome(part, action, outcome)))

    def _free_late(self, action: Action, side: SideRecord) -> None:
        """A handler that ignored its cancellation returned after its side was freed,
        having taken something: free that too."""
        self._counters.freed_late += 1
        log.error(
            "%s handler returned after its side was freed (%s): freeing what it took",
            action.kind.name,
            describe(action),
            extra=self._log_extra(action),
        )
        self._spawn(self._free_on_own(action.handoff_id, action.target, side, Origin.LATE))

    async def _free_on_own(
        self, handoff_id: str, role: Role, side: SideRecord, origin: Origin
    ) -> None:
        await self._freer.free(handoff_id, role, side, origin)

    # --- completion -------------------------------------------------------------

    def _take_complete(self, part: ShardPart, action: Action) -> None:
        """Close both sides now; free what is still held (interrupting its handlers)."""
        part.cache.forget(action.handoff_id)
        owed: list[tuple[Role, SideRecord]] = []
        for role in CANCEL_OF:
            side = part.ledger.side(action.handoff_id, role)
            side.close()
            if not side.taken or side.freed:
                continue
            # The decode owns an activated request (or one that a success says
            # was activated); only a reopened handoff's CancelDestination
            # stops it, never a notice.
            if role is Role.DESTINATION and action.completion is not Completion.CANCELED:
                side.activate()
            elif not side.activated:
                owed.append((role, side))
        self._spawn(self._complete(action, owed))

    async def _complete(self, action: Action, sides: list[tuple[Role, SideRecord]]) -> None:
        for role, side in sides:
            if side.activating:
                # Whether the decode comes to own its request is for the
                # activation to say (bounded by handler_timeout_s).
                await asyncio.wait(side.activating)
            if side.activated:
                continue
            if await self._freer.free(action.handoff_id, role, side, Origin.COMPLETE):
                self._counters.freed_on_complete += 1
        async with self._freer.slots:
            try:
                with tracing.handler_span(action):
                    await asyncio.wait_for(self._engine.complete(action), self._runner.timeout_s)
            except TimeoutError:
                self._counters.handler_timeouts += 1
                log.error(
                    "COMPLETE handler timed out after %s s",
                    self._runner.timeout_s,
                    extra=self._log_extra(action),
                )
            except Exception:
                self._counters.handler_errors += 1
                log.exception("COMPLETE handler raised", extra=self._log_extra(action))

    async def _free_everything(self, origin: Origin, *, keep_activated: bool) -> None:
        """Fenced, or stopping for good: free, through the engine's cancel handlers,
        every side it may hold."""
        self._stopping = True
        holding = [
            (h, role, side)
            for part in self._shards.values()
            for h, role, side in part.ledger.holding()
            if not (keep_activated and side.activated)
        ]
        holding += [(h, role, SideRecord()) for h, role in self._unattributed.take_all()]
        frees = []
        for handoff_id, role, side in holding:
            side.take()
            side.close()
            frees.append(self._freer.free(handoff_id, role, side, origin))
        await asyncio.gather(*frees)

    # --- reports ------------------------------------------------------------------

    @staticmethod
    def _send_outcome(part: ShardPart, action: Action, outcome: Outcome) -> asyncio.Future[None]:
        return part.outbox.send(
            action.handoff_id, part.reports.outcome(action.handoff_id, action.id, outcome)
        )

    def _send_fact(self, handoff_id: str, fact: Fact) -> asyncio.Future[None]:
        part = self._owner(handoff_id)
        return part.outbox.send(handoff_id, part.reports.fact(handoff_id, fact))

    def _owner(self, handoff_id: str) -> ShardPart:
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
        self, part: ShardPart, action: Action, report: asyncio.Future[None] | None
    ) -> None:
        if report is None:
            return
        try:
            await report
        except NotFoundError:
            # Abandoned, past retention, or a coordinator that lost its state:
            # nobody is waiting for this answer, nor will free what it holds.
            self._counters.rejected += 1
            log.info("outcome for an unknown handoff dropped", extra=self._log_extra(action))
            side = (action.handoff_id, action.target)
            await part.link.reclaim(side, "a report for it was answered NOT_FOUND")
        except HandoffRpcError as error:
            self._counters.rejected += 1
            log.error("outcome refused: %s", error, extra=self._log_extra(action))

    @property
    def _extra(self) -> dict[str, object]:
        return {"engine_id": self.engine_id}

    def _log_extra(self, action: Action) -> dict[str, object]:
        return log_extra(self.engine_id, action)
