"""Retention: finished handoffs kept for retention_s, oldest first, at most max_retained.

A completed handoff is kept packed (entries.Retained), an abandoned one as its
Entry (rare, and shown with what it left outstanding), so that late reports
are answered, a decode-phase cancel can still reopen it, its id cannot be
reused with other parameters, and GetHandoff says what happened.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

from handoff_server.domain.entries import Entry, Retained
from handoff_server.domain.model import Phase
from handoff_server.ops.config import Settings
from handoff_server.ops.metrics import Metrics


class Retention:
    """The retained part of the registry's handoff table, in the order they ended."""

    def __init__(
        self,
        settings: Settings,
        metrics: Metrics,
        handoffs: dict[str, Entry | Retained],
        on_first: Callable[[], None],
    ) -> None:
        self.settings = settings
        self.metrics = metrics
        self._handoffs = handoffs  # the registry's table; retained records live in it too
        self._on_first = on_first
        # Oldest first. A record stays here when its handoff is reopened (it is
        # skipped once it reaches the front), so leaving costs nothing.
        self._records: deque[Entry | Retained] = deque()
        self.count = 0
        self.on_forget: Callable[[str], None] = lambda handoff_id: None  # the journal's drop

    def keep(self, record: Entry | Retained) -> None:
        self._handoffs[record.handoff_id] = record
        self._records.append(record)
        self.count += 1
        if self.count == 1:
            # The first expiry may come before the timer loop's next wake-up
            # (a deadline hours away): without this the loop slept through
            # retention, and stale timers were never compacted meanwhile.
            self._on_first()
        while self.count > self.settings.max_retained:
            self._forget_oldest()

    def release(self, entry: Entry) -> None:
        """A retained handoff was reopened: ``entry`` replaces its record in the table."""
        self._handoffs[entry.handoff_id] = entry
        self.count -= 1

    def next_expiry(self) -> float | None:
        # End times never decrease, so neither do expiries: the oldest
        # record expires first.
        oldest = self._oldest()
        ended = None if oldest is None else oldest.ended_at
        return None if ended is None else ended + self.settings.retention_s

    def expire(self, now: float) -> None:
        while (expiry := self.next_expiry()) is not None and expiry <= now:
            self._forget_oldest()

    def _oldest(self) -> Entry | Retained | None:
        """The oldest retained handoff, dropping records of reopened ones on the way."""
        records = self._records
        while records:
            record = records[0]
            if self._handoffs.get(record.handoff_id) is record:
                return record
            records.popleft()
        return None

    def _forget_oldest(self) -> None:
        oldest = self._oldest()
        assert oldest is not None
        self._records.popleft()
        del self._handoffs[oldest.handoff_id]
        self.count -= 1
        if isinstance(oldest, Retained):
            self.metrics.handoffs_by[Phase.COMPLETE].dec()
        self.on_forget(oldest.handoff_id)
