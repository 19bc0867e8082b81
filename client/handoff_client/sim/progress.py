"""A live progress line: redrawn in place on a terminal, a line every few seconds otherwise."""

from __future__ import annotations

import asyncio
import shutil
from typing import TextIO

from handoff_client.sim.frontend import Counters

BAR_WIDTH = 20
TTY_INTERVAL_S = 0.2
LOG_INTERVAL_S = 5.0  # not a terminal (CI, a pipe): no \r, fewer lines


class Progress:
    def __init__(
        self,
        stream: TextIO,
        counters: Counters,
        *,
        duration_s: float,
        max_handoffs: int,
        interactive: bool | None = None,
    ) -> None:
        self._stream = stream
        self._counters = counters
        self._duration_s = duration_s
        self._max_handoffs = max_handoffs
        self._interactive = stream.isatty() if interactive is None else interactive
        self._width = 0
        self.stage = "load"  # then "settle"

    async def run(self) -> None:
        """Redraw until cancelled; the caller calls :meth:`finish` afterwards."""
        loop = asyncio.get_running_loop()
        began = loop.time()
        interval = TTY_INTERVAL_S if self._interactive else LOG_INTERVAL_S
        while True:
            self.draw(loop.time() - began)
            await asyncio.sleep(interval)

    def draw(self, elapsed_s: float) -> None:
        line = self.line(elapsed_s)
        if self._interactive:
            # A line that wraps can no longer be redrawn with \r: cut it to fit.
            line = line[: shutil.get_terminal_size().columns - 1]
            # Pad over the previous line's tail: the line can get shorter.
            self._stream.write("\r" + line.ljust(self._width))
            self._width = len(line)
        else:
            self._stream.write(line + "\n")
        self._stream.flush()

    def finish(self, elapsed_s: float) -> None:
        self.draw(elapsed_s)
        if self._interactive:
            self._stream.write("\n")
            self._stream.flush()

    def line(self, elapsed_s: float) -> str:
        c = self._counters
        if self._duration_s > 0:
            done = elapsed_s / self._duration_s
        else:
            done = c.started / self._max_handoffs
        done = 1.0 if self.stage != "load" else min(max(done, 0.0), 1.0)
        filled = round(done * BAR_WIDTH)
        bar = "#" * filled + "-" * (BAR_WIDTH - filled)
        return (
            f"[{bar}] {done:4.0%} {elapsed_s:5.1f}s {self.stage:<6} {c.started} started, "
            f"{c.in_flight} in flight, {c.success} success, {c.canceled} canceled, "
            f"{c.abandoned} abandoned"
        )
