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
    Outcome,
    OutcomeKind,
    Role,
    outcome_allowed,
)
from handoff_client.outbox import Outbox
from handoff_client.retry import Backoff
from handoff_client.transport import SidecarTransport, TransportKind, make_transport

log = logging.getLogger("handoff.sidecar")

MAX_REASON = 1024  # bytes: the server takes at most 1 KiB of reason
# The answer to an acquiring action for a side already canceled or released:
# the server accepts FAILED for any acquiring action (in cleanup it changes
# nothing), and the engine takes nothing.
CLOSED_REASON = "{engine}: {kind} for a handoff this engine already canceled or released"


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
    incarnation) reconciles and leases those sides too.
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


class EngineSidecar:
    """Connects one engine to the coordinator; use it with ``async with``, or :meth:`run`.

    ``connection`` is a :class:`~handoff_client.client.HandoffClient` or any
    :class:`~handoff_client.transport.SidecarTransport`. Given a client, the
    sidecar talks over one Connect stream (``transport="connect"``, the
    default) or over StreamActions plus unary reports (``transport="unary"``).
    Handlers get :attr:`facts`; the engine can also use it outside any
    handler, e.g. to report a decode that crashed.

    ``incarnation`` names the engine's memory: leave it None when the sidecar
    lives and dies with its engine (one is made per sidecar, see
    :func:`new_incarnation`); pass the engine's own, made once at the
    engine's start, when the sidecar runs beside an engine that outlives it,
    so a restarted sidecar resumes instead of having the engine declared lost.
    :attr:`session_id` is random per sidecar object.
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
    ) -> None:
        if max_concurrency < 1 or cleanup_concurrency < 1:
            raise ValueError("max_concurrency and cleanup_concurrency must be >= 1")
        self.engine_id = engine_id
        self.incarnation = incarnation or new_incarnation()
        self.session_id = secrets.token_hex(16)
        self._engine = engine
        if isinstance(connection, HandoffClient):
            self._transport = make_transport(connection, transport or "connect")
        elif transport is not None:
            raise ValueError("transport= chooses how to use a HandoffClient; a transport was given")
        else:
            self._transport = connection
        self._rng = rng or random.Random()
        backoff = reconnect_backoff or Backoff()
        self._slots = asyncio.Semaphore(max_concurrency)
        self._cleanup_slots = asyncio.Semaphore(cleanup_concurrency)
        self._cache = OutcomeCache(cache_size)
        self._ledger = Ledger(cache_size)
        self._outbox = Outbox(backoff, self._rng)
        self.facts = Facts(self._outbox, self._transport)
        self._stop_grace_s = stop_grace_s
        self._handlers: dict[ActionKind, Handler] = {}
        for kind, name in HANDLER_NAMES.items():
            handler = getattr(engine, name, None)
            if handler is not None:
                self._handlers[kind] = handler
        self._running: set[tuple[str, int]] = set()
        self._tasks: set[asyncio.Task[None]] = set()
        self._reader: asyncio.Task[None] | None = None
        self._stopping = False
        self._link = CoordinatorLink(
            self._transport,
            self,
            engine_id=engine_id,
            incarnation=self.incarnation,
            session_id=self.session_id,
            backoff=backoff,
            rng=self._rng,
        )
        self._received = self._handled = self._cache_hits = self._ignored = 0
        self._handler_errors = self._rejected = 0
        self._closed_hits = self._freed = self._unknown = self._unimplemented = 0

    @property
    def transport(self) -> SidecarTransport:
        """How this sidecar talks to the coordinator."""
        return self._transport

    @property
    def stats(self) -> SidecarStats:
        return SidecarStats(
            actions_received=self._received,
            handlers_run=self._handled,
            answered_from_cache=self._cache_hits,
            ignored_while_running=self._ignored,
            handler_errors=self._handler_errors,
            reconnects=self._link.reconnects,
            report_retries=self._outbox.retries,
            reports_rejected=self._rejected,
            answered_closed=self._closed_hits,
            freed_on_complete=self._freed,
            unknown_actions=self._unknown,
            unimplemented=self._unimplemented,
            session_conflicts=self._link.conflicts,
            reconciles=self._link.reconciles,
            orphans_reclaimed=self._link.orphans_reclaimed,
            lease_expiries=self._link.lease_expiries,
            freed_on_lease=self._link.freed_on_lease,
            freed_unreported=self._link.freed_unreported,
        )

    async def wait_subscribed(self) -> None:
        """Until the server confirms a subscription (at start, or after a reconnect).

        Raises :class:`~handoff_client.errors.OlderIncarnationError` if the
        sidecar was fenced instead.
        """
        subscribed = asyncio.ensure_future(self._link.subscribed.wait())
        ended = asyncio.ensure_future(self._link.ended.wait())
        try:
            await asyncio.wait((subscribed, ended), return_when=asyncio.FIRST_COMPLETED)
        finally:
            subscribed.cancel()
            ended.cancel()
        if not self._link.subscribed.is_set():
            self._raise_if_fenced()

    async def wait(self) -> None:
        """Until the sidecar stops on its own, which it only does when fenced.

        Raises :class:`~handoff_client.errors.OlderIncarnationError` once a
        newer incarnation of the engine has subscribed and everything this
        sidecar's engine held was freed through its cancel handlers.
        """
        await self._link.ended.wait()
        self._raise_if_fenced()

    async def run(self) -> None:
        """Start, serve until fenced (raising as :meth:`wait` does) or cancelled, stop."""
        async with self:
            await self.wait()

    def _raise_if_fenced(self) -> None:
        if self._link.fenced is not None:
            raise self._link.fenced

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
        await self._outbox.close(max(deadline - loop.time(), 0.0))
        # Unsubscribe last: on Connect the stream also carries the reports
        # the grace lets land.
        if self._reader is not None:
            self._reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reader

    # --- the stream ------------------------------------------------------------

    async def _run(self) -> None:
        held_handoffs = getattr(self._engine, "held_handoffs", None)
        if held_handoffs is not None:
            # Restarted beside an engine that survived: what it holds is
            # reconciled (and leased) like what this sidecar acquired itself.
            for handoff_id, role in await held_handoffs():
                self._ledger.side(handoff_id, role).acquired = True
        await self._link.run(self._dispatch)

    def held(self) -> list[tuple[str, Role]]:
        """What the lease and reconcile cover: held sides, but no activated decode."""
        return [(h, role) for h, role, side in self._ledger.holding() if not side.activated]

    async def reclaim(self, sides: Iterable[tuple[str, Role]], why: str) -> list[tuple[str, Role]]:
        """Close ``sides`` and free those still held (not an activated decode) on its own."""
        owed = []
        for handoff_id, role in sides:
            side = self._ledger.side(handoff_id, role)
            if side.holds and not side.activated:
                side.closed = True  # a later acquiring action is answered from the tombstone
                cause = Action(handoff_id, 0, CANCEL_OF[role], role, self.engine_id, 0)
                owed.append((handoff_id, role, self._free_when_idle(cause, role, side, why)))
        await asyncio.gather(*(free for _, _, free in owed))
        return [(handoff_id, role) for handoff_id, role, _ in owed]

    async def fenced(self, error: OlderIncarnationError) -> None:
        await self._free_everything()

    def _dispatch(self, action: Action) -> None:
        """Take one delivered action. Never waits: the stream is always read."""
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
            self._take_complete(action)
            return
        key = (action.handoff_id, action.id)
        cached = self._cache.get(*key)
        if cached is not None:
            self._cache_hits += 1
            self._spawn(self._await_report(action, self._send_outcome(action, cached)))
            return
        if key in self._running:
            self._ignored += 1  # the running handler reports when it is done
            return
        side = self._ledger.side(action.handoff_id, action.target)
        if kind in ACQUIRING_KINDS:
            if side.closed:
                self._answer_closed(action)
                return
            self._running.add(key)
            self._spawn(self._acquire(action, side))
        else:
            side.closed = True  # from now on, nothing is acquired for this side
            self._running.add(key)
            self._spawn(self._clean(action, side))

    def _spawn(self, work: Awaitable[None]) -> None:
        task = asyncio.ensure_future(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # --- handlers ---------------------------------------------------------------

    async def _acquire(self, action: Action, side: Side) -> None:
        key = (action.handoff_id, action.id)
        report = None
        try:
            async with self._slots:
                if self._stopping:
                    return  # left outstanding for the next subscription
                if side.closed:
                    # Canceled while it waited for a slot: it never starts.
                    self._running.discard(key)
                    self._answer_closed(action)
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
            self._cache.put(action.handoff_id, action.id, outcome)
            # Queued before this task yields, so the facts the handler's own
            # background work reports for this handoff line up behind it.
            report = self._send_outcome(action, outcome)
        finally:
            self._running.discard(key)
        await self._await_report(action, report)

    async def _clean(self, action: Action, side: Side) -> None:
        key = (action.handoff_id, action.id)
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
            self._cache.put(action.handoff_id, action.id, outcome)
            report = self._send_outcome(action, outcome)
        finally:
            self._running.discard(key)
        await self._await_report(action, report)

    def _answer_closed(self, action: Action) -> None:
        self._closed_hits += 1
        log.info(
            "%s answered FAILED without running: this side was already canceled or released",
            action.kind.name,
            extra=self._log_extra(action),
        )
        outcome = Outcome.failed(CLOSED_REASON.format(engine=self.engine_id, kind=action.kind.name))
        self._cache.put(action.handoff_id, action.id, outcome)
        self._spawn(self._await_report(action, self._send_outcome(action, outcome)))

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

    def _take_complete(self, action: Action) -> None:
        """Close both sides now; free what is still held once their handlers are done."""
        self._cache.forget(action.handoff_id)
        owed: list[tuple[Role, Side]] = []
        for role in CANCEL_OF:
            side = self._ledger.side(action.handoff_id, role)
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
        for handoff_id, role, side in list(self._ledger.holding()):
            side.closed = True
            cause = Action(handoff_id, 0, CANCEL_OF[role], role, self.engine_id, 0)
            frees.append(self._free_when_idle(cause, role, side, "replaced by a newer incarnation"))
        await asyncio.gather(*frees)

    async def _free_when_idle(self, cause: Action, role: Role, side: Side, why: str) -> None:
        await side.wait_idle()
        await self._free(cause, role, side, why)

    # --- reports ------------------------------------------------------------------

    def _send_outcome(self, action: Action, outcome: Outcome) -> asyncio.Future[None]:
        return self._outbox.send(
            action.handoff_id,
            lambda: self._transport.report_outcome(action.handoff_id, action.id, outcome),
        )

    async def _await_report(self, action: Action, report: asyncio.Future[None] | None) -> None:
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
            await self._link.reclaim(side, "a report for it was answered NOT_FOUND")
        except HandoffRpcError as error:
            self._rejected += 1
            log.error("outcome refused: %s", error, extra=self._log_extra(action))

    def _log_extra(self, action: Action) -> dict[str, object]:
        return {
            "engine_id": self.engine_id,
            "handoff_id": action.handoff_id,
            "action_id": action.id,
        }
