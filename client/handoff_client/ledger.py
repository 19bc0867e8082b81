"""What an engine did for each side of each handoff: the sidecar's tombstones.

Delivery is at least once and, across a reconnect, not always in issue
order: a redelivered SubmitPrefill can arrive after the CancelSource that was
issued for it. So the sidecar remembers, per (handoff, side), whether an
acquiring handler ever started (the engine may hold something), whether one
is running now, whether a cancel or release was taken (a tombstone: nothing
may be acquired for that side again), and whether the decode was activated
(it then owns the request, and a CANCELED notice must not stop it).
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass

from handoff_client.model import Role


@dataclass(slots=True)
class Side:
    """One engine's part in one handoff: the source's, or the destination's."""

    acquired: bool = False  # an acquiring handler started: the engine may hold something
    closed: bool = False  # a cancel or release was taken, or the handoff completed
    activated: bool = False  # ActivateDestination was APPLIED: the decode owns the request
    freed_here: bool = False  # the sidecar freed it on its own: a later cleanup has nothing to do
    running: int = 0  # acquiring handlers running now
    # Made only when someone waits: most sides are never waited for, and a
    # ledger keeps tens of thousands of them.
    _idle: asyncio.Event | None = None
    _freeing: asyncio.Lock | None = None

    def freeing(self) -> asyncio.Lock:
        """Held while a cleanup of this side runs: two never overlap (a cancel
        the server sent and one the sidecar runs on a COMPLETE notice)."""
        if self._freeing is None:
            self._freeing = asyncio.Lock()
        return self._freeing

    @property
    def holds(self) -> bool:
        """The engine may still hold something here that no cleanup will free."""
        return self.acquired and not self.closed

    def enter(self) -> None:
        self.acquired = True
        self.running += 1

    def leave(self) -> None:
        self.running -= 1
        if not self.running and self._idle is not None:
            self._idle.set()
            self._idle = None

    async def wait_idle(self) -> None:
        """Until no acquiring handler of this side runs."""
        if self.running:
            if self._idle is None:
                self._idle = asyncio.Event()
            await self._idle.wait()


class Ledger:
    """Sides by handoff, least recently used first out past ``max_handoffs``.

    The bound is for handoffs whose COMPLETE notice was lost with a stream;
    it is far above what one engine has in flight, so an evicted side is
    long finished.
    """

    def __init__(self, max_handoffs: int) -> None:
        if max_handoffs < 1:
            raise ValueError("max_handoffs must be >= 1")
        self._max_handoffs = max_handoffs
        self._by_handoff: OrderedDict[str, dict[Role, Side]] = OrderedDict()

    def side(self, handoff_id: str, role: Role) -> Side:
        sides = self._by_handoff.get(handoff_id)
        if sides is None:
            sides = self._by_handoff[handoff_id] = {}
            while len(self._by_handoff) > self._max_handoffs:
                self._by_handoff.popitem(last=False)
        else:
            self._by_handoff.move_to_end(handoff_id)
        side = sides.get(role)
        if side is None:
            side = sides[role] = Side()
        return side

    def find(self, handoff_id: str, role: Role) -> Side | None:
        """The side if an action for it came here; unlike :meth:`side`, makes none."""
        sides = self._by_handoff.get(handoff_id)
        return None if sides is None else sides.get(role)

    def knows(self, handoff_id: str) -> bool:
        """An action for ``handoff_id`` came here (and was not evicted since)."""
        return handoff_id in self._by_handoff

    def holding(self) -> Iterator[tuple[str, Role, Side]]:
        """Every side the engine may still hold something for."""
        for handoff_id, sides in list(self._by_handoff.items()):
            for role, side in sides.items():
                if side.holds:
                    yield handoff_id, role, side
