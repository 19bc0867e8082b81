"""What an engine did for each side of each handoff: the sidecar's tombstones.

Delivery is at least once and, across a reconnect, not always in issue
order: a redelivered SubmitPrefill can arrive after the CancelSource that was
issued for it. So the sidecar remembers, per (handoff, side), two things that
move one way only: what the engine may hold (:class:`Holding`: nothing,
something an acquiring handler took, or an activated decode that owns its
request) and where the side's end stands (:class:`Stage`: open, closed by a
cancel, release or COMPLETE so nothing may be acquired again, or freed by one
engine call so any later cleanup is answered NOOP without calling the engine).
It also tracks the acquiring handlers running for the side, which a free
interrupts before it runs.
"""

from __future__ import annotations

import asyncio
import enum
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from handoff_client.model import ActionKind, Role


class Holding(enum.IntEnum):
    """What the engine may hold for a side; only ever moves up."""

    NOTHING = 0  # no acquiring handler ever started
    TAKEN = 1  # an acquiring handler started: the engine may hold something
    ACTIVATED = 2  # ActivateDestination was APPLIED: the decode owns the request


class Stage(enum.IntEnum):
    """Where a side's end stands; only ever moves up (but for a free that failed)."""

    OPEN = 0  # acquiring actions run
    CLOSED = 1  # a cancel, release or COMPLETE was taken: nothing is acquired again
    FREEING = 2  # an engine call is freeing it now (back to CLOSED if that call fails)
    FREED = 3  # one engine call freed it: later cleanups are NOOP


@dataclass(slots=True, eq=False)
class SideRecord:
    """One engine's part in one handoff: the source's, or the destination's."""

    holding: Holding = Holding.NOTHING
    stage: Stage = Stage.OPEN
    # The acquiring handlers running now (their asyncio tasks), by kind: a free cancels them.
    running: dict[asyncio.Task[Any], ActionKind] = field(default_factory=dict)
    timeouts: int = 0  # cleanup handlers of this side that timed out
    # Made only when someone frees: most sides are freed by one cleanup, and a
    # ledger keeps tens of thousands of them.
    _freeing: asyncio.Lock | None = None

    def freeing(self) -> asyncio.Lock:
        """Held while a free of this side runs: two never overlap (a cancel the
        server sent and one the sidecar runs on a COMPLETE notice, say)."""
        if self._freeing is None:
            self._freeing = asyncio.Lock()
        return self._freeing

    @property
    def taken(self) -> bool:
        """An acquiring handler ever ran: the engine may hold something."""
        return self.holding is not Holding.NOTHING

    @property
    def activated(self) -> bool:
        return self.holding is Holding.ACTIVATED

    @property
    def activating(self) -> list[asyncio.Task[Any]]:
        """The ActivateDestination handlers running now."""
        return [t for t, kind in self.running.items() if kind is ActionKind.ACTIVATE_DESTINATION]

    @property
    def closed(self) -> bool:
        return self.stage is not Stage.OPEN

    @property
    def freed(self) -> bool:
        return self.stage is Stage.FREED

    @property
    def freeing_started(self) -> bool:
        """A free reached the engine: what a handler takes from now on, it may miss."""
        return self.stage >= Stage.FREEING

    @property
    def holds(self) -> bool:
        """The engine may still hold something here: taken, and no free has run.

        Closed is not enough, nor is a free under way: a cleanup that was
        taken may fail or time out, and be owed by a coordinator that will
        never send it again (it declared the engine lost, or went away).
        An activated decode whose handoff ended (closed) is the engine's own.
        """
        return self.taken and not self.freed and not (self.closed and self.activated)

    def take(self) -> None:
        self.holding = max(self.holding, Holding.TAKEN)

    def activate(self) -> None:
        self.holding = Holding.ACTIVATED

    def close(self) -> None:
        self.stage = max(self.stage, Stage.CLOSED)


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
        self._by_handoff: OrderedDict[str, dict[Role, SideRecord]] = OrderedDict()

    def side(self, handoff_id: str, role: Role) -> SideRecord:
        sides = self._by_handoff.get(handoff_id)
        if sides is None:
            sides = self._by_handoff[handoff_id] = {}
            while len(self._by_handoff) > self._max_handoffs:
                self._by_handoff.popitem(last=False)
        else:
            self._by_handoff.move_to_end(handoff_id)
        side = sides.get(role)
        if side is None:
            side = sides[role] = SideRecord()
        return side

    def find(self, handoff_id: str, role: Role) -> SideRecord | None:
        """The side if an action for it came here; unlike :meth:`side`, makes none."""
        sides = self._by_handoff.get(handoff_id)
        return None if sides is None else sides.get(role)

    def knows(self, handoff_id: str) -> bool:
        """An action for ``handoff_id`` came here (and was not evicted since)."""
        return handoff_id in self._by_handoff

    def holding(self) -> Iterator[tuple[str, Role, SideRecord]]:
        """Every side the engine may still hold something for."""
        for handoff_id, sides in list(self._by_handoff.items()):
            for role, side in sides.items():
                if side.holds:
                    yield handoff_id, role, side
