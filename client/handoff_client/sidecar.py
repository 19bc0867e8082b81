"""EngineSidecar: runs an engine's handlers for the actions the coordinator sends it.

The engine implements :class:`Engine`: one async method per action kind, each
returning the action's :class:`~handoff_client.model.Outcome`. The sidecar

- subscribes to the engine's actions (on one Connect stream that also carries
  its reports, unless told to use the unary RPCs) and resubscribes, with
  jittered backoff, whenever the stream drops;
- runs handlers concurrently, up to ``max_concurrency`` at once;
- reports each outcome, retrying until it lands;
- answers a redelivered action from its outcome cache instead of running the
  handler again, and ignores a redelivery whose handler is still running;
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
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from types import TracebackType
from typing import Protocol, Self

from handoff_client import tracing
from handoff_client.cache import OutcomeCache
from handoff_client.client import HandoffClient
from handoff_client.errors import HandoffRpcError, NotFoundError
from handoff_client.model import (
    CLEANUP_KINDS,
    Action,
    ActionKind,
    Canceled,
    DestinationReserved,
    Fact,
    Failed,
    Outcome,
    SourceHeld,
    TransferCompleted,
    TransferTiming,
    outcome_allowed,
)
from handoff_client.outbox import Outbox
from handoff_client.retry import Backoff
from handoff_client.transport import SidecarTransport, TransportKind, make_transport

log = logging.getLogger("handoff.sidecar")

MAX_REASON = 1024  # bytes: the server takes at most 1 KiB of reason


class Facts:
    """What an engine reports on its own initiative.

    Each call returns once the server has the fact, after every outcome and
    fact the engine produced earlier for the same handoff. Report the fact
    that follows an action (SourceHeld after SubmitPrefill, ...) after that
    action's handler has returned, e.g. from a task the handler started.
    A final rejection raises a :class:`~handoff_client.errors.HandoffRpcError`.
    """

    def __init__(self, outbox: Outbox, transport: SidecarTransport) -> None:
        self._outbox = outbox
        self._transport = transport

    async def source_held(self, handoff_id: str, timing: TransferTiming) -> None:
        await self._report(handoff_id, SourceHeld(timing))

    async def destination_reserved(self, handoff_id: str, transferable_prompt_tokens: int) -> None:
        await self._report(handoff_id, DestinationReserved(transferable_prompt_tokens))

    async def transfer_completed(self, handoff_id: str) -> None:
        await self._report(handoff_id, TransferCompleted())

    async def failed(self, handoff_id: str, reason: str) -> None:
        await self._report(handoff_id, Failed(reason))

    async def canceled(self, handoff_id: str, reason: str) -> None:
        await self._report(handoff_id, Canceled(reason))

    async def _report(self, handoff_id: str, fact: Fact) -> None:
        await self._outbox.send(handoff_id, lambda: self._transport.report_fact(handoff_id, fact))


class Engine(Protocol):
    """One handler per action kind. Handlers may run concurrently, also for one handoff."""

    async def submit_prefill(self, action: Action, facts: Facts) -> Outcome:
        """Run the prefill; answer SUBMITTED, then report SourceHeld when it holds its KV."""
        ...

    async def reserve_destination(self, action: Action, facts: Facts) -> Outcome:
        """Reserve decode memory; answer ACCEPTED, then report DestinationReserved."""
        ...

    async def start_transfer(self, action: Action, facts: Facts) -> Outcome:
        """Start moving the KV (``action.delay_ms`` long); SCHEDULED, then TransferCompleted."""
        ...

    async def activate_destination(self, action: Action, facts: Facts) -> Outcome:
        """Start decoding; answer APPLIED."""
        ...

    async def release_source(self, action: Action, facts: Facts) -> Outcome:
        """Free the prefill's blocks; APPLIED, or NOOP if nothing was held. Never FAILED."""
        ...

    async def cancel_source(self, action: Action, facts: Facts) -> Outcome:
        """Abort the prefill and free its blocks; APPLIED or NOOP. Never FAILED."""
        ...

    async def cancel_destination(self, action: Action, facts: Facts) -> Outcome:
        """Abort the decode and free its reservation; APPLIED or NOOP. Never FAILED."""
        ...

    async def complete(self, action: Action) -> None:
        """A notice that the handoff is over; no outcome. It may be lost with a stream."""
        ...


Handler = Callable[[Action, Facts], Awaitable[Outcome]]


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


class EngineSidecar:
    """Connects one engine to the coordinator; use it with ``async with``.

    ``connection`` is a :class:`~handoff_client.client.HandoffClient` or any
    :class:`~handoff_client.transport.SidecarTransport`. Given a client, the
    sidecar talks over one Connect stream (``transport="connect"``, the
    default) or over StreamActions plus unary reports (``transport="unary"``).
    Handlers get :attr:`facts`; the engine can also use it outside any
    handler, e.g. to report a decode that crashed.
    """

    def __init__(
        self,
        connection: HandoffClient | SidecarTransport,
        engine_id: str,
        engine: Engine,
        *,
        max_concurrency: int = 64,
        reconnect_backoff: Backoff | None = None,
        cache_size: int = 65_536,
        stop_grace_s: float = 5.0,
        rng: random.Random | None = None,
        transport: TransportKind | None = None,
    ) -> None:
        if max_concurrency < 1:
            raise ValueError("max_concurrency must be >= 1")
        self.engine_id = engine_id
        self._engine = engine
        if isinstance(connection, HandoffClient):
            self._transport = make_transport(connection, transport or "connect")
        elif transport is not None:
            raise ValueError("transport= chooses how to use a HandoffClient; a transport was given")
        else:
            self._transport = connection
        self._rng = rng or random.Random()
        self._backoff = reconnect_backoff or Backoff()
        self._slots = asyncio.Semaphore(max_concurrency)
        self._cache = OutcomeCache(cache_size)
        self._outbox = Outbox(self._backoff, self._rng)
        self.facts = Facts(self._outbox, self._transport)
        self._stop_grace_s = stop_grace_s
        self._handlers: dict[ActionKind, Handler] = {
            ActionKind.SUBMIT_PREFILL: engine.submit_prefill,
            ActionKind.RESERVE_DESTINATION: engine.reserve_destination,
            ActionKind.START_TRANSFER: engine.start_transfer,
            ActionKind.ACTIVATE_DESTINATION: engine.activate_destination,
            ActionKind.RELEASE_SOURCE: engine.release_source,
            ActionKind.CANCEL_SOURCE: engine.cancel_source,
            ActionKind.CANCEL_DESTINATION: engine.cancel_destination,
        }
        self._running: set[tuple[str, int]] = set()
        self._tasks: set[asyncio.Task[None]] = set()
        self._reader: asyncio.Task[None] | None = None
        self._stopping = False
        self._subscribed = asyncio.Event()
        self._received = self._handled = self._cache_hits = self._ignored = 0
        self._handler_errors = self._reconnects = self._rejected = 0

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
            reconnects=self._reconnects,
            report_retries=self._outbox.retries,
            reports_rejected=self._rejected,
        )

    async def wait_subscribed(self) -> None:
        """Until the server confirms a subscription (at start, or after a reconnect)."""
        await self._subscribed.wait()

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
        self._reader = asyncio.create_task(self._read(), name=f"sidecar-{self.engine_id}")

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
        self._subscribed.clear()

    # --- the stream ------------------------------------------------------------

    async def _read(self) -> None:
        failures = 0

        def on_subscribed() -> None:
            nonlocal failures
            failures = 0
            self._subscribed.set()

        while True:
            try:
                subscription = self._transport.subscribe(self.engine_id, on_subscribed)
                async with contextlib.aclosing(subscription) as actions:
                    async for action in actions:
                        await self._dispatch(action)
                log.warning(
                    "action stream ended by the server (replaced, or shutting down)",
                    extra={"engine_id": self.engine_id},
                )
            except HandoffRpcError as error:
                log.warning("action stream failed: %s", error, extra={"engine_id": self.engine_id})
            except Exception:  # a transport bug must not end the sidecar for good
                log.exception("action stream broke", extra={"engine_id": self.engine_id})
            self._subscribed.clear()
            failures += 1
            self._reconnects += 1
            await asyncio.sleep(self._backoff.delay_s(failures, self._rng))

    async def _dispatch(self, action: Action) -> None:
        self._received += 1
        if self._stopping:
            return
        key = (action.handoff_id, action.id)
        if action.kind is ActionKind.COMPLETE:
            self._cache.forget(action.handoff_id)
            if await self._take_slot():
                self._spawn(self._notify_complete(action))
            return
        cached = self._cache.get(*key)
        if cached is not None:
            self._cache_hits += 1
            self._spawn(self._await_report(action, self._send_outcome(action, cached)))
            return
        if key in self._running:
            self._ignored += 1  # the running handler reports when it is done
            return
        # Waiting for a slot here stops reading the stream: backpressure.
        if await self._take_slot():
            self._running.add(key)
            self._spawn(self._execute(action))

    async def _take_slot(self) -> bool:
        """A handler slot; False (and no slot) if the sidecar began stopping meanwhile."""
        await self._slots.acquire()
        if self._stopping:
            self._slots.release()
            return False
        return True

    def _spawn(self, work: Awaitable[None]) -> None:
        task = asyncio.ensure_future(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # --- handlers ---------------------------------------------------------------

    async def _execute(self, action: Action) -> None:
        key = (action.handoff_id, action.id)
        try:
            outcome = await self._run_handler(action)
            if outcome is None:
                return
            self._cache.put(action.handoff_id, action.id, outcome)
            # Queued before this task yields, so the facts the handler's own
            # background work reports for this handoff line up behind it.
            report = self._send_outcome(action, outcome)
        finally:
            self._running.discard(key)
            self._slots.release()
        await self._await_report(action, report)

    async def _run_handler(self, action: Action) -> Outcome | None:
        """The handler's outcome, or None to leave a cleanup action for redelivery."""
        self._handled += 1
        try:
            with tracing.handler_span(action):
                outcome = await self._handlers[action.kind](action, self.facts)
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

    async def _notify_complete(self, action: Action) -> None:
        try:
            with tracing.handler_span(action):
                await self._engine.complete(action)
        except Exception:
            self._handler_errors += 1
            log.exception("COMPLETE handler raised", extra=self._log_extra(action))
        finally:
            self._slots.release()

    # --- reports ------------------------------------------------------------------

    def _send_outcome(self, action: Action, outcome: Outcome) -> asyncio.Future[None]:
        return self._outbox.send(
            action.handoff_id,
            lambda: self._transport.report_outcome(action.handoff_id, action.id, outcome),
        )

    async def _await_report(self, action: Action, report: asyncio.Future[None]) -> None:
        try:
            await report
        except NotFoundError:
            # Abandoned or past retention: nobody is waiting for this answer.
            self._rejected += 1
            log.info("outcome for an unknown handoff dropped", extra=self._log_extra(action))
        except HandoffRpcError as error:
            self._rejected += 1
            log.error("outcome refused: %s", error, extra=self._log_extra(action))

    def _log_extra(self, action: Action) -> dict[str, object]:
        return {
            "engine_id": self.engine_id,
            "handoff_id": action.handoff_id,
            "action_id": action.id,
        }
