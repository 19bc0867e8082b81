"""A heap of timers with lazy cancellation.

A handoff's deadline moves (the transfer extends it) and most timers never
fire because their handoff finished first. Instead of removing entries, the
owner checks on expiry whether a timer still matters; the heap is compacted
when stale entries outnumber live ones, so memory stays proportional to what
is alive.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field


@dataclass(order=True, slots=True)
class Timer:
    when: float
    sequence: int
    key: tuple[str, str] = field(compare=False)  # (what, whose)
    token: object = field(compare=False)


class TimerHeap:
    def __init__(self, is_live: Callable[[Timer], bool]) -> None:
        self._heap: list[Timer] = []
        self._sequence = 0
        self._is_live = is_live

    def __len__(self) -> int:
        return len(self._heap)

    def schedule(self, when: float, key: tuple[str, str], token: object = None) -> None:
        self._sequence += 1
        heapq.heappush(self._heap, Timer(when, self._sequence, key, token))

    def next_at(self) -> float | None:
        return self._heap[0].when if self._heap else None

    def pop_due(self, now: float) -> Iterator[Timer]:
        """Timers due at ``now`` that still matter, earliest first."""
        heap = self._heap
        while heap and heap[0].when <= now:
            timer = heapq.heappop(heap)
            if self._is_live(timer):
                yield timer

    def compact(self, live_hint: int) -> None:
        """Drop stale timers once they dominate the heap."""
        if len(self._heap) > 2 * live_hint + 1024:
            self._heap = [t for t in self._heap if self._is_live(t)]
            heapq.heapify(self._heap)
