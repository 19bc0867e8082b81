"""The coordinator's actions against one vLLM engine's requests.

Two threads meet here. vLLM's scheduler thread calls the ``on_*`` hooks (from
the connector's scheduler-side methods) and takes the worker's orders once
per step; the sidecar's thread runs an asyncio loop with the handlers, which
the ``EngineSidecar`` in the sidecar process calls over a local channel
(runner.py). Every piece of state is guarded by one
lock, held only for a few dictionary operations, so the scheduler never waits
on the network. Handlers that must see vLLM act (a free, an activation) wait
on a change notice the scheduler thread posts to the loop.

Handoffs are found by ``kv_transfer_params["handoff_id"]``: vLLM rewrites the
request id per instance, so it cannot name a handoff on both engines.
Requests without a handoff id are left to NIXL as they are.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Awaitable, Callable, Coroutine, Iterable
from dataclasses import dataclass, field
from typing import Any

from handoff_client import (
    ACCEPTED,
    APPLIED,
    NOOP,
    SCHEDULED,
    SUBMITTED,
    Action,
    Facts,
    Outcome,
    Role,
    TimingMode,
    TransferTiming,
    failed,
)
from handoff_vllm.orders import WorkerOrders

log = logging.getLogger("handoff.vllm")

# How long a cleanup handler waits for vLLM to free before it raises (the
# coordinator redelivers it), and how often a decode whose ReserveDestination
# has not come asks the coordinator whether its handoff still exists.
FREE_WAIT_S = 10.0
WATCH_S = 1.0


@dataclass
class Entry:
    """One handoff as this engine sees it: the source side, the destination side, or both."""

    handoff_id: str
    # source
    prefill_request: str | None = None
    submitted: bool = False
    held: bool = False  # request_finished deferred the free
    timing: TransferTiming | None = None
    held_reported: bool = False
    prefill_ended: str | None = None  # why it finished without holding
    source_canceled: bool = False
    source_freed: bool = False
    handed_back: bool = False
    # destination
    decode_request: str | None = None
    request: Any = None  # vLLM's Request and KVCacheBlocks, for the deferred read
    blocks: Any = None
    external_tokens: int | None = None  # set once the blocks are allocated
    accepted: bool = False
    reserved_reported: bool = False
    transfer_started: bool = False
    read_issued: bool = False
    recv_done: bool = False
    completed_reported: bool = False
    activate: bool = False
    released: bool = False  # handed to the scheduler: loaded, or failed
    doomed: str | None = None  # the load must fail: why
    decode_finished: bool = False
    watching: bool = False
    waiters: list[asyncio.Future[None]] = field(default_factory=list)

    @property
    def full_hit(self) -> bool:
        return self.external_tokens == 0


class HandoffEngine:
    """The sidecar's ``Engine`` for one vLLM instance, plus the scheduler's hooks."""

    def __init__(self, engine_id: str, kv_bytes_per_token: int | None, bandwidth: float | None):
        self.engine_id = engine_id
        self._kv_bytes_per_token = kv_bytes_per_token
        self._bandwidth = bandwidth
        self._lock = threading.Lock()
        self._entries: dict[str, Entry] = {}
        self._by_request: dict[str, str] = {}
        self._orders = WorkerOrders()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._facts: Facts | None = None
        self._lookup: Callable[[str], Awaitable[str | None]] | None = None
        self._tasks: set[asyncio.Future[Any]] = set()

    def attach(
        self,
        loop: asyncio.AbstractEventLoop,
        lookup: Callable[[str], Awaitable[str | None]],
        facts: Facts,
    ) -> None:
        """Called on the handlers' loop before any handler runs. ``lookup(handoff_id)``
        says why a handoff is gone on the coordinator (None: it lives, or no answer)."""
        self._loop, self._lookup, self._facts = loop, lookup, facts

    @property
    def facts(self) -> Facts:
        assert self._facts is not None, "attach() first"
        return self._facts

    # --- helpers --------------------------------------------------------------

    def _entry(self, handoff_id: str) -> Entry:
        entry = self._entries.get(handoff_id)
        if entry is None:
            entry = self._entries[handoff_id] = Entry(handoff_id)
        return entry

    def _changed(self, entry: Entry) -> None:
        """Wake the handlers waiting on ``entry`` (any thread; lock held)."""
        waiters, entry.waiters = entry.waiters, []
        if waiters and self._loop is not None:
            self._loop.call_soon_threadsafe(_wake, waiters)

    def _spawn(self, make: Callable[[Facts], Coroutine[Any, Any, None]], what: str) -> None:
        """Report a fact from the scheduler thread or a handler, on the loop; errors logged."""
        loop, facts = self._loop, self._facts
        if loop is None or facts is None:
            log.error("%s: the sidecar is not running; not reported", what)
            return

        async def report() -> None:
            try:
                await make(facts)
            except Exception as error:
                log.error("%s: report failed: %s", what, error)

        def start() -> None:
            task = asyncio.ensure_future(report())
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

        loop.call_soon_threadsafe(start)

    async def _until(
        self, handoff_id: str, done: Callable[[Entry], bool], timeout_s: float
    ) -> bool:
        """Wait until ``done(entry)`` holds; False after ``timeout_s``."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while True:
            with self._lock:
                entry = self._entry(handoff_id)
                if done(entry):
                    return True
                waiter: asyncio.Future[None] = loop.create_future()
                entry.waiters.append(waiter)
            left = deadline - loop.time()
            if left <= 0:
                return False
            try:
                await asyncio.wait_for(waiter, left)
            except TimeoutError:
                return False

    # --- the scheduler's hooks (vLLM's scheduler thread) -----------------------

    def take_orders(self) -> WorkerOrders:
        """This step's orders for the worker; called from build_connector_meta."""
        with self._lock:
            for entry in self._entries.values():
                if entry.activate and entry.recv_done and not entry.released:
                    entry.released = True
                    assert entry.decode_request is not None
                    self._orders.release_recv.add(entry.decode_request)
                    self._changed(entry)
            orders, self._orders = self._orders, WorkerOrders()
            return orders

    def reads_to_issue(self) -> list[tuple[Any, Any, int]]:
        """Decode reads whose StartTransfer has come: (request, blocks, external tokens)."""
        with self._lock:
            reads = []
            for entry in self._entries.values():
                if (
                    entry.transfer_started
                    and not entry.read_issued
                    and not entry.full_hit
                    and entry.external_tokens is not None
                    and entry.doomed is None
                ):
                    entry.read_issued = True
                    reads.append((entry.request, entry.blocks, entry.external_tokens))
                    entry.request = entry.blocks = None
            return reads

    def on_prefill_seen(self, handoff_id: str, request_id: str) -> None:
        with self._lock:
            entry = self._entry(handoff_id)
            entry.prefill_request = request_id
            self._by_request[request_id] = handoff_id

    def on_prefill_finished(
        self, handoff_id: str, request_id: str, held_tokens: int | None, status: str
    ) -> None:
        """The prefill request finished: held (``held_tokens``) or freed at once (None)."""
        with self._lock:
            entry = self._entry(handoff_id)
            entry.prefill_request = request_id
            self._by_request[request_id] = handoff_id
            if held_tokens is None:
                entry.source_freed = True
                entry.prefill_ended = f"the prefill request ended without holding its KV ({status})"
                report = entry.submitted and not entry.source_canceled
                self._changed(entry)
                if report:
                    why = f"{self.engine_id}: {entry.prefill_ended}"
                    self._spawn(lambda f: f.failed(handoff_id, why), f"Failed for {handoff_id}")
                return
            entry.held = True
            if entry.source_canceled:
                # Canceled while it ran: freed now instead of held.
                self._orders.free.add(request_id)
                return
            entry.timing = TransferTiming(
                TimingMode.FULL_PROMPT, held_tokens, self._kv_bytes_per_token, self._bandwidth
            )
            if entry.submitted:
                # The coordinator is in charge: NIXL's own expiry is suppressed.
                self._orders.hold.add(request_id)
                self._report_held(entry)
            self._changed(entry)

    def _report_held(self, entry: Entry) -> None:
        if entry.held_reported or entry.timing is None:
            return
        entry.held_reported = True
        handoff_id, timing = entry.handoff_id, entry.timing
        self._spawn(lambda f: f.source_held(handoff_id, timing), f"SourceHeld for {handoff_id}")

    def on_sent(self, request_ids: Iterable[str]) -> None:
        """The worker reports these sends finished: vLLM frees their blocks now."""
        with self._lock:
            for request_id in request_ids:
                handoff_id = self._by_request.get(request_id)
                entry = self._entries.get(handoff_id) if handoff_id else None
                if entry is not None and entry.prefill_request == request_id:
                    entry.source_freed = True
                    self._changed(entry)
                    self._forget(entry)

    def on_decode_seen(self, handoff_id: str, request_id: str) -> bool:
        """A decode request for ``handoff_id`` reached the scheduler; True the first time."""
        with self._lock:
            entry = self._entry(handoff_id)
            first = entry.decode_request != request_id
            entry.decode_request = request_id
            self._by_request[request_id] = handoff_id
            start_watch = first and not entry.accepted and not entry.watching
            if start_watch:
                entry.watching = True
        if start_watch:
            self._watch(handoff_id)
        return first

    def on_decode_allocated(
        self, handoff_id: str, request: Any, blocks: Any, external: int
    ) -> bool:
        """Blocks allocated for the remote tokens; True if NIXL may read now (a full
        local prefix hit reads nothing and runs at once)."""
        with self._lock:
            entry = self._entry(handoff_id)
            entry.external_tokens = external
            if external > 0:
                entry.request, entry.blocks = request, blocks
                if entry.doomed is not None:
                    self._orders.fail_recv.add(request.request_id)
                    entry.released = True
            if entry.accepted:
                self._report_reserved(entry)
            self._changed(entry)
            return external == 0

    def _report_reserved(self, entry: Entry) -> None:
        if entry.reserved_reported or entry.external_tokens is None:
            return
        entry.reserved_reported = True
        handoff_id, tokens = entry.handoff_id, entry.external_tokens
        self._spawn(
            lambda f: f.destination_reserved(handoff_id, tokens),
            f"DestinationReserved for {handoff_id}",
        )

    def on_recv_finished(self, request_id: str, failed_load: bool) -> bool:
        """The worker finished a receive; True to keep it from the scheduler until
        ActivateDestination (or until the load is failed)."""
        with self._lock:
            handoff_id = self._by_request.get(request_id)
            entry = self._entries.get(handoff_id) if handoff_id else None
            if entry is None or entry.decode_request != request_id:
                return False
            if entry.released or entry.decode_finished:
                return False  # our own release, or an aborted request's late receive
            entry.recv_done = True
            if failed_load:
                entry.released = True
                why = f"{self.engine_id}: the decode's NIXL read of the prefill's KV failed"
                self._spawn(lambda f: f.failed(entry.handoff_id, why), f"Failed for {handoff_id}")
                self._changed(entry)
                return False
            if entry.doomed is not None:
                entry.released = True
                self._orders.fail_recv.add(request_id)
            elif not entry.completed_reported:
                entry.completed_reported = True
                hid = entry.handoff_id
                self._spawn(lambda f: f.transfer_completed(hid), f"TransferCompleted for {hid}")
            self._changed(entry)
            return True

    def on_decode_finished(self, handoff_id: str, request_id: str) -> bool:
        """The decode request finished (any reason); True if NIXL never read for it
        (then NIXL must not notify the prefill: the coordinator frees it)."""
        with self._lock:
            entry = self._entry(handoff_id)
            entry.decode_finished = True
            entry.request = entry.blocks = None
            unread = not entry.read_issued and not entry.full_hit
            waiting = entry.external_tokens is not None and entry.external_tokens > 0
            if waiting and not entry.released and (unread or entry.recv_done):
                # vLLM keeps a request's blocks that ends (an abort) while waiting
                # for remote KV until its receive is reported finished: one we
                # held back, or never let NIXL start. The worker reports it now.
                entry.released = True
                self._orders.release_recv.add(request_id)
            self._changed(entry)
            self._forget(entry)
            return unread

    def _forget(self, entry: Entry) -> None:
        """Drop what vLLM no longer holds; the entry itself goes at COMPLETE."""
        for request_id in (entry.prefill_request, entry.decode_request):
            if request_id is not None and self._by_request.get(request_id) == entry.handoff_id:
                done = (request_id == entry.prefill_request and entry.source_freed) or (
                    request_id == entry.decode_request and entry.decode_finished
                )
                if done:
                    del self._by_request[request_id]

    def _doom(self, entry: Entry, why: str) -> None:
        """The decode's load must fail (lock held): now if it waits, else when it does."""
        if entry.doomed is None:
            entry.doomed = why
        if entry.decode_finished or entry.released or entry.full_hit:
            return
        if entry.external_tokens is None:
            return  # not allocated yet: failed at on_decode_allocated
        if entry.read_issued and not entry.recv_done:
            return  # a read in flight: failed when it finishes (on_recv_finished)
        assert entry.decode_request is not None
        entry.released = True
        self._orders.fail_recv.add(entry.decode_request)

    def _watch(self, handoff_id: str) -> None:
        """Until ReserveDestination comes, ask the coordinator whether the handoff lives:
        a decode for an unknown or ended handoff fails its load instead of waiting."""
        loop = self._loop
        if loop is None:
            return

        async def watch() -> None:
            while True:
                why = await self._handoff_gone(handoff_id)
                with self._lock:
                    entry = self._entry(handoff_id)
                    if entry.accepted or entry.decode_finished:
                        entry.watching = False
                        return
                    if why is not None:
                        log.warning("decode for handoff %s fails its load: %s", handoff_id, why)
                        entry.watching = False
                        self._doom(entry, why)
                        return
                await self._until(handoff_id, lambda e: e.accepted or e.decode_finished, WATCH_S)

        def start() -> None:
            task = asyncio.ensure_future(watch())
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

        loop.call_soon_threadsafe(start)

    async def _handoff_gone(self, handoff_id: str) -> str | None:
        return None if self._lookup is None else await self._lookup(handoff_id)

    def orphaned(self, why: str) -> None:
        """The sidecar died while vLLM runs: the coordinator takes this engine for
        lost and will not free for it. Held sources go back to NIXL's lease (a
        decode may still pull them), unactivated decodes fail their load, and a
        prefill still running is freed at its end."""
        with self._lock:
            for entry in self._entries.values():
                if entry.prefill_request is not None and not entry.source_freed:
                    entry.source_canceled = True
                    if entry.held and not entry.handed_back:
                        entry.handed_back = True
                        self._orders.hand_back.add(entry.prefill_request)
                running = (entry.activate and entry.released) or entry.full_hit
                if entry.decode_request is not None and not entry.decode_finished and not running:
                    self._doom(entry, why)
                self._changed(entry)

    # --- the sidecar's handlers (the loop's thread) ------------------------------

    async def submit_prefill(self, action: Action, facts: Facts) -> Outcome:
        with self._lock:
            entry = self._entry(action.handoff_id)
            if entry.prefill_ended is not None and not entry.held:
                return failed(f"{self.engine_id}: {entry.prefill_ended}")
            entry.submitted = True
            if entry.held and not entry.source_freed:
                assert entry.prefill_request is not None
                self._orders.hold.add(entry.prefill_request)
                # Queued on the loop: it runs after this handler's outcome is queued.
                self._report_held(entry)
        return SUBMITTED

    async def release_source(self, action: Action, facts: Facts) -> Outcome:
        return await self._free_source(action)

    async def cancel_source(self, action: Action, facts: Facts) -> Outcome:
        return await self._free_source(action)

    async def _free_source(self, action: Action) -> Outcome:
        handoff_id = action.handoff_id
        with self._lock:
            entry = self._entry(handoff_id)
            entry.source_canceled = True
            if entry.source_freed or entry.handed_back:
                return NOOP
            if entry.prefill_request is None:
                return NOOP  # never reached this engine; a late one is freed at its end
            if entry.held and action.attempt == 0:
                # The sidecar frees on its own (its lease, a reconcile, a notice): a
                # decode may still be pulling these blocks, and only NIXL's lease,
                # which the decode renews while it reads, knows. Hand them back.
                entry.handed_back = True
                self._orders.hand_back.add(entry.prefill_request)
                log.warning(
                    "handoff %s: source handed back to NIXL's lease (the sidecar's own free)",
                    handoff_id,
                )
                return APPLIED
            if entry.held:
                self._orders.free.add(entry.prefill_request)
        # A held source is freed at the worker's next step; a running prefill at its end.
        if await self._until(handoff_id, lambda e: e.source_freed, FREE_WAIT_S):
            return APPLIED
        raise RuntimeError(
            f"{self.engine_id}: the prefill of handoff {handoff_id} is not freed after "
            f"{FREE_WAIT_S:g} s; the coordinator sends {action.kind.name} again"
        )

    async def reserve_destination(self, action: Action, facts: Facts) -> Outcome:
        with self._lock:
            entry = self._entry(action.handoff_id)
            entry.accepted = True
            self._report_reserved(entry)
            self._changed(entry)
        return ACCEPTED

    async def start_transfer(self, action: Action, facts: Facts) -> Outcome:
        handoff_id = action.handoff_id
        with self._lock:
            entry = self._entry(handoff_id)
            entry.transfer_started = True  # the scheduler issues the read next step
            if entry.full_hit and not entry.completed_reported:
                # Nothing to read: the decode's own prefix cache had the prompt.
                entry.completed_reported = True
                self._spawn(
                    lambda f: f.transfer_completed(handoff_id),
                    f"TransferCompleted for {handoff_id}",
                )
        return SCHEDULED

    async def activate_destination(self, action: Action, facts: Facts) -> Outcome:
        handoff_id = action.handoff_id
        with self._lock:
            entry = self._entry(handoff_id)
            if entry.full_hit:
                return APPLIED  # it runs already: no remote KV to wait for
            entry.activate = True
        # The scheduler hands the request over at its next step.
        await self._until(handoff_id, lambda e: e.released or e.decode_finished, FREE_WAIT_S)
        with self._lock:
            entry = self._entry(handoff_id)
            if entry.released and entry.doomed is None:
                return APPLIED
        return failed(
            f"{self.engine_id}: the decode request of handoff {handoff_id} ended before activation"
        )

    async def cancel_destination(self, action: Action, facts: Facts) -> Outcome:
        handoff_id = action.handoff_id
        with self._lock:
            entry = self._entry(handoff_id)
            if entry.decode_request is None:
                entry.doomed = entry.doomed or "the handoff was canceled"
                return NOOP  # a decode leg that comes later fails its load
            if entry.decode_finished:
                return NOOP
            running = (entry.activate and entry.released) or entry.full_hit
            if not running:
                self._doom(entry, "the handoff was canceled")
        # A running decode owns its request: only the frontend can stop it (by
        # closing its leg, which vLLM turns into an abort). Wait for its end.
        if await self._until(handoff_id, lambda e: e.decode_finished, FREE_WAIT_S):
            return APPLIED
        raise RuntimeError(
            f"{self.engine_id}: the decode of handoff {handoff_id} still runs after "
            f"{FREE_WAIT_S:g} s; only the frontend can stop it (close the decode leg)"
        )

    async def complete(self, action: Action) -> None:
        with self._lock:
            entry = self._entries.get(action.handoff_id)
            if entry is None:
                return
            live = (
                entry.prefill_request is not None
                and not entry.source_freed
                and not entry.handed_back
            ) or (entry.decode_request is not None and not entry.decode_finished)
            if not live:
                del self._entries[action.handoff_id]

    async def held_handoffs(self) -> Iterable[tuple[str, Role]]:
        """From vLLM's own callbacks: held prefills, and decodes allocated, not yet running."""
        with self._lock:
            held: list[tuple[str, Role]] = []
            for entry in self._entries.values():
                if entry.held and not entry.source_freed and not entry.handed_back:
                    held.append((entry.handoff_id, Role.SOURCE))
                if (
                    entry.decode_request is not None
                    and not entry.decode_finished
                    and not entry.released
                ):
                    held.append((entry.handoff_id, Role.DESTINATION))
            return held

    def counts(self) -> dict[str, int]:
        """For logs and tests: handoffs known, sources held, decodes waiting."""
        with self._lock:
            return {
                "handoffs": len(self._entries),
                "sources_held": sum(e.held and not e.source_freed for e in self._entries.values()),
                "decodes_waiting": sum(
                    e.decode_request is not None and not e.decode_finished and not e.released
                    for e in self._entries.values()
                ),
            }


def _wake(waiters: list[asyncio.Future[None]]) -> None:
    for waiter in waiters:
        if not waiter.done():
            waiter.set_result(None)
