"""Room left for the journal: new handoffs are refused before the volume fills.

A journal that cannot commit stops the server (nothing more may be
answered), and a server restarted on a full volume cannot even open it. So
new starts are refused while the state dir's volume has less than
``journal_reserve_mib`` free: the handoffs in flight still have room for
the rest of their records (a few hundred bytes a call) and the write-ahead
log (about 16 MiB between checkpoints), and end; their rows are replaced by one,
and deleted when they leave retention. SQLite keeps those freed pages for
its next writes without returning them to the volume, so they count as
room too (measured by the journal after its commits while room is short).

One ``statvfs`` per new start (about a microsecond); calls about handoffs
already started are never refused here.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from pathlib import Path

from handoff_server.domain.model import ResourceExhausted

log = logging.getLogger("handoff.journal")

MIB = 2**20


class VolumeLow(ResourceExhausted):
    """A new handoff refused: the journal's volume is below its reserve."""


def volume_free_bytes(path: Path) -> int:
    """Bytes an unprivileged writer may still use on ``path``'s file system."""
    usage = os.statvfs(path)
    return usage.f_bavail * usage.f_frsize


class Headroom:
    """Whether the journal at ``state_dir`` has room for a new handoff.

    ``reusable`` is the space SQLite freed inside the journal, as last
    measured; ``short`` is told whether room is short, so the journal
    measures that only then (it costs a query per commit)."""

    def __init__(
        self,
        state_dir: Path,
        reserve_mib: int,
        reusable: Callable[[], int],
        short: Callable[[bool], None],
        free: Callable[[Path], int] = volume_free_bytes,
    ) -> None:
        self.state_dir = state_dir
        self.reserve_bytes = reserve_mib * MIB
        self._reusable = reusable
        self._short = short
        self._free = free

    def room_bytes(self) -> int:
        """Free bytes on the volume, and (once those run short) inside the journal."""
        free = self._free(self.state_dir)
        if free >= self.reserve_bytes:
            self._short(False)
            return free
        self._short(True)
        return free + self._reusable()

    def check_start(self) -> None:
        """Refuse a new handoff (RESOURCE_EXHAUSTED) while room is below the reserve."""
        if not self.reserve_bytes:
            return
        room = self.room_bytes()
        if room < self.reserve_bytes:
            raise VolumeLow(
                f"{self._shortage(room)}: new handoffs are refused so the ones in flight can "
                "still be journaled to their end; free space on that volume or grow it "
                "(handoffs that end and leave retention free room in the journal too)"
            )

    def report_at_start(self) -> None:
        """Say so at start if the server starts with room below the reserve."""
        if self.reserve_bytes and (room := self.room_bytes()) < self.reserve_bytes:
            log.warning(
                "%s: new handoffs are refused until there is room; the handoffs recovered "
                "go on; free space on that volume or grow it",
                self._shortage(room),
            )

    def _shortage(self, room: int) -> str:
        return (
            f"the journal's volume (--state-dir {self.state_dir}) has {room / MIB:.1f} MiB "
            f"left for the journal, less than the {self.reserve_bytes // MIB} MiB reserve "
            "(journal_reserve_mib)"
        )
