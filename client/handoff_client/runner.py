"""HandlerRunner: runs one engine handler, bounded by a timeout and interruptible by a free.

Each handler runs in its own asyncio task, so that the sidecar can stop
waiting for it: past ``handler_timeout_s``, or when a free of its side must
run (an acquiring handler only), the task is cancelled (the handler sees
``CancelledError`` at its next await) and given ``interrupt_grace_s`` to
unwind. A handler that ignores its cancellation past the grace is logged and
counted, and the sidecar goes on without it: an acquiring action is answered
FAILED and the free runs anyway. If such a handler later returns, having
taken something, after a free of its side started, ``on_late`` is told, and
the sidecar frees once more what it took.

A cleanup handler is never abandoned: two frees of one side must not
overlap, so one that ignores its cancellation is waited for (and logged).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from handoff_client import tracing
from handoff_client.facts import Facts
from handoff_client.ledger import SideRecord
from handoff_client.model import (
    ACQUIRING_KINDS,
    CLEANUP_KINDS,
    NOOP,
    Action,
    ActionKind,
    Outcome,
    OutcomeKind,
    Role,
    outcome_allowed,
)
from handoff_client.stats import Counters

log = logging.getLogger("handoff.sidecar")

Handler = Callable[[Action, Facts], Awaitable[Outcome]]
MAX_REASON = 1024  # bytes: the server takes at most 1 KiB of reason

HANDLER_NAMES: dict[ActionKind, str] = {
    ActionKind.SUBMIT_PREFILL: "submit_prefill",
    ActionKind.RESERVE_DESTINATION: "reserve_destination",
    ActionKind.START_TRANSFER: "start_transfer",
    ActionKind.ACTIVATE_DESTINATION: "activate_destination",
    ActionKind.RELEASE_SOURCE: "release_source",
    ActionKind.CANCEL_SOURCE: "cancel_source",
    ActionKind.CANCEL_DESTINATION: "cancel_destination",
}


def describe(action: Action) -> str:
    """``handoff h, source side, CANCEL_SOURCE (action 3)``: what a log line names."""
    side = action.target.name.lower()
    made = f"action {action.id}" if action.id >= 0 else f"made up: {action.origin.name}"
    return f"handoff {action.handoff_id}, {side} side, {action.kind.name} ({made})"


def log_extra(engine_id: str, action: Action) -> dict[str, object]:
    return {
        "engine_id": engine_id,
        "handoff_id": action.handoff_id,
        "action_id": action.id,
        "side": action.target.name.lower(),
        "action": action.kind.name,
    }


class HandlerRunner:
    def __init__(
        self,
        engine_id: str,
        handlers: dict[ActionKind, Handler],
        facts: Facts,
        counters: Counters,
        *,
        timeout_s: float,
        grace_s: float,
        on_late: Callable[[Action, SideRecord], None],
    ) -> None:
        if not timeout_s > 0 or not grace_s >= 0:
            raise ValueError("handler_timeout_s must be > 0 and interrupt_grace_s >= 0")
        self.engine_id = engine_id
        self.timeout_s = timeout_s
        self.grace_s = grace_s
        self._handlers = handlers
        self._facts = facts
        self._counters = counters
        self._on_late = on_late
        self.tasks: set[asyncio.Task[Outcome]] = set()  # every handler running now

    def has(self, kind: ActionKind) -> bool:
        return kind in self._handlers

    async def run(
        self,
        action: Action,
        side: SideRecord,
        on_outcome: Callable[[Outcome], None] | None = None,
    ) -> Outcome | None:
        """The handler's outcome, or None to leave a cleanup for another try.

        ``on_outcome`` is called once with the outcome (not with None), in the
        handler's own task when it returns: before any task the handler
        started runs, so the facts its work reports line up behind it.
        An acquiring handler is registered on ``side`` while it runs, so a
        free of the side can :meth:`interrupt` it.
        """
        settle = _Once(on_outcome)
        handler = self._handlers.get(action.kind)
        if handler is None:
            return settle(self._unimplemented(action))
        self._counters.handled += 1
        task = asyncio.ensure_future(self._call(handler, action, settle))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        acquiring = action.kind in ACQUIRING_KINDS
        if acquiring:
            side.running[task] = action.kind
            task.add_done_callback(lambda done: side.running.pop(done, None))
            task.add_done_callback(lambda done: self._check_late(done, action, side))
        try:
            done, _ = await asyncio.wait([task], timeout=self.timeout_s)
            if not done:
                self._counters.handler_timeouts += 1
                log.error(
                    "%s handler timed out after %s s (%s); cancelling it "
                    "(raise handler_timeout_s if the engine needs longer)",
                    action.kind.name,
                    self.timeout_s,
                    describe(action),
                    extra=log_extra(self.engine_id, action),
                )
                if action.kind in CLEANUP_KINDS:
                    side.timeouts += 1
                if not await self.cancel({task}, action) and not acquiring:
                    await asyncio.wait([task])  # a free is never overlapped: wait it out
                if not task.done() or task.cancelled():
                    problem = f"{action.kind.name} handler timed out after {self.timeout_s} s"
                    return settle(self._failed(action, problem))
        except asyncio.CancelledError:
            settle.done = True  # the sidecar is stopping: nothing is reported
            task.cancel()  # and the handler goes with it
            raise
        return settle(self._result(task, action))

    async def interrupt(self, side: SideRecord, cause: Action) -> None:
        """Cancel the acquiring handlers running for ``side``; wait at most the grace."""
        running = set(side.running)
        if running:
            await self.cancel(running, cause)

    async def cancel(self, tasks: set[asyncio.Task[Any]], cause: Action) -> bool:
        """Cancel ``tasks``; whether they all unwound within the grace."""
        for task in tasks:
            task.cancel()
        self._counters.handlers_interrupted += len(tasks)
        _, pending = await asyncio.wait(tasks, timeout=self.grace_s)
        if pending:
            self._counters.handlers_unresponsive += len(pending)
            log.error(
                "%d handler(s) of engine %s ignored their cancellation for %s s; going on "
                "without them (%s): make acquiring handlers cancellation-safe "
                "(docs/engine-contract.md), or raise interrupt_grace_s",
                len(pending),
                self.engine_id,
                self.grace_s,
                describe(cause),
                extra=log_extra(self.engine_id, cause),
            )
        return not pending

    async def _call(self, handler: Handler, action: Action, settle: _Once) -> Outcome:
        with tracing.handler_span(action):
            outcome = await handler(action, self._facts)
        if outcome_allowed(action.kind, outcome):
            settle(outcome)
        return outcome

    def _result(self, task: asyncio.Task[Outcome], action: Action) -> Outcome | None:
        if task.cancelled():
            return self._failed(action, "handler was cancelled: its side is being freed")
        error = task.exception()
        if error is not None:  # an engine bug must not wedge the handoff
            self._counters.handler_errors += 1
            log.error(
                "%s handler raised (%s)",
                action.kind.name,
                describe(action),
                exc_info=error,
                extra=log_extra(self.engine_id, action),
            )
            return self._failed(
                action, f"{action.kind.name} handler raised {type(error).__name__}: {error}"
            )
        outcome = task.result()
        if outcome_allowed(action.kind, outcome):
            return outcome
        self._counters.handler_errors += 1
        problem = f"{action.kind.name} handler returned {outcome.kind.name}"
        log.error(problem, extra=log_extra(self.engine_id, action))
        return self._failed(action, problem)

    @staticmethod
    def _failed(action: Action, problem: str) -> Outcome | None:
        if action.kind in CLEANUP_KINDS:
            return None  # unacknowledged: tried again
        # Cut by bytes: the server's limit is on the encoded reason.
        return Outcome.failed(problem.encode()[:MAX_REASON].decode(errors="ignore"))

    def _check_late(self, task: asyncio.Task[Outcome], action: Action, side: SideRecord) -> None:
        """An acquiring handler that returned after a free of its side had started:
        what it took is freed once more."""
        if task.cancelled() or task.exception() is not None or not side.freeing_started:
            return
        if task.result().kind is OutcomeKind.FAILED:
            return  # it took nothing
        self._on_late(action, side)

    def _unimplemented(self, action: Action) -> Outcome:
        self._counters.unimplemented += 1
        name = HANDLER_NAMES[action.kind]
        log.error(
            "engine %s has no %s handler (a %s-only engine given the other side's work?)",
            self.engine_id,
            name,
            "decode" if action.target is Role.SOURCE else "prefill",
            extra=log_extra(self.engine_id, action),
        )
        if action.kind in CLEANUP_KINDS:
            # An engine without this side's handlers never took anything for it.
            return NOOP
        return Outcome.failed(f"engine {self.engine_id} does not implement {name}")


class _Once:
    """Calls ``on_outcome`` with the first outcome it is given; passes outcomes through."""

    def __init__(self, on_outcome: Callable[[Outcome], None] | None) -> None:
        self._on_outcome = on_outcome
        self.done = False

    def __call__(self, outcome: Outcome | None) -> Outcome | None:
        if outcome is not None and not self.done:
            self.done = True
            if self._on_outcome is not None:
                self._on_outcome(outcome)
        return outcome
