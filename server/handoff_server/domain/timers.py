"""A heap of timers with lazy cancellation, and the kinds of timer the server sets.

A handoff's deadline moves (the transfer extends it) and most timers never
fire because their handoff finished first. Instead of removing entries, the
owner checks on expiry whether a timer still matters; the heap is compacted
when stale entries outnumber live ones, so memory stays proportional to what
is alive.

Compaction works in place and due timers are popped one at a time from the
heap as it is now: a timer that schedules (and so compacts) while another
fires can neither resurrect a popped timer nor hide a new one.
"""

from __future__ import annotations

import enum
import heapq
from collections.abc import Callable
from dataclasses import dataclass, field


class TimerKind(enum.Enum):
    """What a timer does when it fires; the registry dispatches on it in one place."""

    DEADLINE = "deadline"  # a handoff still active at its deadline times out
    REDELIVER = "redeliver"  # unacknowledged cleanup actions are sent again
    ABANDON = "abandon"  # a handoff still cleaning up after cleanup_timeout is abandoned
    UNREACHABLE = "unreachable"  # an engine without a stream for delivery_timeout is lost
    FORGET = "forget"  # an engine long gone, with nothing hanging on it, is forgotten


@dataclass(order=True, slots=True)
class Timer:
    when: float
    sequence: int
    kind: TimerKind = field(compare=False)
    key: str = field(compare=False)  # whose: a handoff id or an engine id
    token: object = field(compare=False)  # what the owner compares to see it still matters


class TimerHeap:
    def __init__(self, is_live: Callable[[Timer], bool]) -> None:
        self._heap: list[Timer] = []
        self._sequence = 0
        self._is_live = is_live

    def __len__(self) -> int:
        return len(self._heap)

    def schedule(self, when: float, kind: TimerKind, key: str, token: object) -> None:
        self._sequence += 1
        heapq.heappush(self._heap, Timer(when, self._sequence, kind, key, token))

    def next_at(self) -> float | None:
        return self._heap[0].when if self._heap else None

    def pop_due(self, now: float) -> Timer | None:
        """The earliest timer due at ``now`` that still matters, removed; None if none is."""
        heap = self._heap
        while heap and heap[0].when <= now:
            timer = heapq.heappop(heap)
            if self._is_live(timer):
                return timer
        return None

    def defer(self, kind: TimerKind, not_before: float) -> None:
        """Move each timer of ``kind`` due before ``not_before`` to it; later ones stay."""
        for timer in self._heap:
            if timer.kind is kind and timer.when < not_before:
                timer.when = not_before
        heapq.heapify(self._heap)

    def compact(self, live_hint: int) -> None:
        """Drop stale timers once they dominate the heap (in place: see the module doc)."""
        if len(self._heap) > 2 * live_hint + 1024:
            self._heap[:] = [t for t in self._heap if self._is_live(t)]
            heapq.heapify(self._heap)
