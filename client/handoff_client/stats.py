"""What a sidecar counts: one mutable :class:`Counters`, read as a frozen :class:`SidecarStats`.

The links and outboxes count what is theirs (reconnects, leases, report
retries); :meth:`Counters.snapshot` adds them in, so a link closed with its
shard keeps its counts.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol


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
    answered_freed: int = 0  # cleanups of a side already freed, answered NOOP unrun
    handler_timeouts: int = 0  # handlers cancelled past handler_timeout_s
    handlers_interrupted: int = 0  # handlers cancelled: by a free of their side, or a timeout
    handlers_unresponsive: int = 0  # cancelled handlers still running past interrupt_grace_s
    freed_late: int = 0  # frees run again for what an unresponsive handler took afterwards
    frees_retried: int = 0  # frees the sidecar made up, tried again after a timeout or error
    frees_given_up: int = 0  # sides the engine could not free after repeated timeouts


class LinkCounts(Protocol):
    reconnects: int
    conflicts: int
    reconciles: int
    orphans_reclaimed: int
    lease_expiries: int
    freed_on_lease: int

    @property
    def freed_unreported(self) -> int: ...


class OutboxCounts(Protocol):
    retries: int


@dataclass(slots=True)
class Counters:
    """The sidecar's own counts; one object shared by its dispatch, runner and frees."""

    received: int = 0
    handled: int = 0
    cache_hits: int = 0
    ignored: int = 0
    handler_errors: int = 0
    rejected: int = 0
    unreached: int = 0  # shard maps asked for while no coordinator answered
    closed_hits: int = 0
    freed_on_complete: int = 0
    unknown: int = 0
    unimplemented: int = 0
    answered_freed: int = 0
    handler_timeouts: int = 0
    handlers_interrupted: int = 0
    handlers_unresponsive: int = 0
    freed_late: int = 0
    frees_retried: int = 0
    frees_given_up: int = 0

    def snapshot(
        self, links: Iterable[LinkCounts], outboxes: Iterable[OutboxCounts]
    ) -> SidecarStats:
        links, outboxes = list(links), list(outboxes)
        return SidecarStats(
            actions_received=self.received,
            handlers_run=self.handled,
            answered_from_cache=self.cache_hits,
            ignored_while_running=self.ignored,
            handler_errors=self.handler_errors,
            reconnects=self.unreached + sum(link.reconnects for link in links),
            report_retries=sum(outbox.retries for outbox in outboxes),
            reports_rejected=self.rejected,
            answered_closed=self.closed_hits,
            freed_on_complete=self.freed_on_complete,
            unknown_actions=self.unknown,
            unimplemented=self.unimplemented,
            session_conflicts=sum(link.conflicts for link in links),
            reconciles=sum(link.reconciles for link in links),
            orphans_reclaimed=sum(link.orphans_reclaimed for link in links),
            lease_expiries=sum(link.lease_expiries for link in links),
            freed_on_lease=sum(link.freed_on_lease for link in links),
            freed_unreported=sum(link.freed_unreported for link in links),
            answered_freed=self.answered_freed,
            handler_timeouts=self.handler_timeouts,
            handlers_interrupted=self.handlers_interrupted,
            handlers_unresponsive=self.handlers_unresponsive,
            freed_late=self.freed_late,
            frees_retried=self.frees_retried,
            frees_given_up=self.frees_given_up,
        )
