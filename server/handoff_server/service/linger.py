"""A stream writer's linger: under load, fewer and fuller messages.

gRPC costs about the same per message whatever it carries (bench/RESULTS.md),
so a busy stream that has just written waits until ``interval_s`` after that
write before packing its next message: the acks and actions that arrive
meanwhile share it, and the engine answers a fuller message with a fuller
one. Busy means the event loop is behind: the stream's last wake-up came
later than ``interval_s / 2`` after the work that set it. On a loop that keeps
up (an idle server, or one well below its capacity) a stream never lingers,
so the linger costs latency only where the loop's own queue costs more.
"""

from __future__ import annotations

import asyncio
import math
import time


class Wake(asyncio.Event):
    """A stream's wake-up that remembers when it was first set since cleared."""

    since = 0.0

    def set(self) -> None:
        if not self.is_set():
            self.since = time.monotonic()
        super().set()


class Linger:
    __slots__ = ("_interval_s", "_last_write", "_behind")

    def __init__(self, interval_s: float) -> None:
        self._interval_s = interval_s
        self._last_write = -math.inf
        self._behind = False

    async def wait(self) -> None:
        """Until ``interval_s`` after the last write, if the loop is behind; else at once."""
        if self._behind:
            left = self._last_write + self._interval_s - time.monotonic()
            if left > 0:
                await asyncio.sleep(left)

    def wrote(self) -> None:
        self._last_write = time.monotonic()

    def woke(self, wake: Wake) -> None:
        """The writer woke on ``wake``: how long after it was set tells the loop's lag."""
        self._behind = time.monotonic() - wake.since > self._interval_s / 2
