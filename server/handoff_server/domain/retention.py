"""Retention: finished handoffs kept for retention_s, oldest first, at most max_retained.

A completed handoff is kept as its record (retained.RetainedRecord), an
abandoned one as its Entry (rare, and shown with what it left outstanding),
so that late reports are answered, a decode-phase cancel can still reopen
it, its id cannot be reused with other parameters, and GetHandoff says what
happened.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

from handoff_server.domain.entries import Entry
from handoff_server.domain.model import Phase
from handoff_server.domain.retained import Retained, RetainedRecord
from handoff_server.ops.config import Settings
from handoff_server.ops.metrics import Metrics


class Retention:
    """The retained part of the registry's handoff table, in the order they ended."""

    def __init__(
        self,
        settings: Settings,
        metrics: Metrics,
        handoffs: dict[str, Entry | RetainedRecord],
        on_first: Callable[[], None],
    ) -> None:
        self.settings = settings
        self.metrics = metrics
        self._handoffs = handoffs  # the registry's table; retained records live in it too
        self._on_first = on_first
        # Oldest first. A record stays here when its handoff is reopened (it is
        # skipped once it reaches the front), so leaving costs nothing.
        self._records: deque[Entry | RetainedRecord] = deque()
        self.count = 0
        self.on_forget: Callable[[str], None] = lambda handoff_id: None  # the journal's drop

    def keep(self, finished: Entry | Retained) -> None:
        record = finished if isinstance(finished, Entry) else finished.record()
        self._handoffs[finished.handoff_id] = record
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
        if oldest is None:
            return None
        ended = oldest.ended_at if isinstance(oldest, Entry) else oldest[1]  # completed at
        return None if ended is None else ended + self.settings.retention_s

    def expire(self, now: float) -> None:
        while (expiry := self.next_expiry()) is not None and expiry <= now:
            self._forget_oldest()

    def ids(self) -> list[str]:
        """The retained handoffs' ids, oldest first."""
        kept = self._handoffs
        return [i for record in self._records if kept.get(i := _id_of(record)) is record]

    def _oldest(self) -> Entry | RetainedRecord | None:
        """The oldest retained handoff, dropping records of reopened ones on the way."""
        records = self._records
        while records:
            record = records[0]
            if self._handoffs.get(_id_of(record)) is record:
                return record
            records.popleft()
        return None

    def _forget_oldest(self) -> None:
        oldest = self._oldest()
        assert oldest is not None
        self._records.popleft()
        handoff_id = _id_of(oldest)
        del self._handoffs[handoff_id]
        self.count -= 1
        if not isinstance(oldest, Entry):
            self.metrics.handoffs_by[Phase.COMPLETE].dec()
        self.on_forget(handoff_id)


def _id_of(record: Entry | RetainedRecord) -> str:
    return record.handoff_id if isinstance(record, Entry) else record[0]
