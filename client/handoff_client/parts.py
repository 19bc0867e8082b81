"""The sidecar's per-shard state, and the held sides no shard has claimed yet.

A :class:`ShardPart` is one coordinator shard as the sidecar sees it: its
link, and the state of the handoffs it owns (tombstones, outcomes, the order
of their reports). It is the link's :class:`~handoff_client.link.Holder`:
what the link reconciles, leases and reclaims is this shard's part of the
engine, freed through the sidecar's :class:`~handoff_client.frees.Freer`.

:class:`Unattributed` holds the sides an engine said it holds at the
sidecar's start (``held_handoffs()``) that no shard has claimed: which shard
each belongs to is unknown, so every shard is asked, and a side is freed
only once none of them expects it held.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Awaitable, Callable, Iterable

from handoff_client.cache import OutcomeCache
from handoff_client.client import SideId
from handoff_client.errors import OlderIncarnationError
from handoff_client.frees import Freer
from handoff_client.ledger import Ledger, SideRecord
from handoff_client.link import CoordinatorLink
from handoff_client.model import Origin
from handoff_client.outbox import Outbox
from handoff_client.retry import Backoff
from handoff_client.transport import Reports, SidecarTransport

log = logging.getLogger("handoff.sidecar")


class Unattributed:
    """Held sides no shard has claimed yet, each with the shards that disowned it."""

    def __init__(self, sides: Iterable[SideId], shards: Callable[[], Iterable[str]]) -> None:
        self._said: dict[SideId, set[str]] = {side: set() for side in sides}
        self._shards = shards

    def __contains__(self, side: SideId) -> bool:
        return side in self._said

    def expected_by(self, shard: str) -> list[SideId]:
        """The sides ``shard`` has not disowned: its lease and reconcile cover them."""
        return [side for side, said in self._said.items() if shard not in said]

    def disown(self, shard: str, side: SideId) -> bool:
        """``shard`` does not expect ``side`` held; whether no shard does any more
        (then it is no longer unattributed: free it)."""
        said = self._said[side]
        said.add(shard)
        if not said.issuperset(self._shards()):
            return False
        del self._said[side]
        return True

    def claim(self, side: SideId) -> bool:
        """A shard expects ``side`` held: whether it was unattributed until now."""
        return self._said.pop(side, None) is not None

    def take_all(self) -> list[SideId]:
        sides, self._said = list(self._said), {}
        return sides


class ShardPart:
    def __init__(
        self,
        name: str,
        transport: SidecarTransport,
        *,
        engine_id: str,
        incarnation: str,
        session_id: str,
        cache_size: int,
        backoff: Backoff,
        rng: random.Random,
        freer: Freer,
        unattributed: Unattributed,
        on_fenced: Callable[[OlderIncarnationError], Awaitable[None]],
    ) -> None:
        self.name = name
        self.transport = transport
        self.ledger = Ledger(cache_size)
        self.cache = OutcomeCache(cache_size)
        self.outbox = Outbox(backoff, rng)
        self.reports = Reports(transport)
        self.link = CoordinatorLink(
            transport,
            self,
            engine_id=engine_id,
            incarnation=incarnation,
            session_id=session_id,
            backoff=backoff,
            rng=rng,
        )
        self.task: asyncio.Task[None] | None = None
        self.running: set[tuple[str, int]] = set()  # (handoff id, action id) of handlers
        self._freer = freer
        self._unattributed = unattributed
        self._on_fenced = on_fenced

    @property
    def busy(self) -> bool:
        """Whether the engine may hold anything, or owes any report, for this shard."""
        return (
            any(True for _ in self.ledger.holding())
            or bool(self.running)
            or self.outbox.pending > 0
            or bool(self._unattributed.expected_by(self.name))
        )

    # --- the link's Holder ---------------------------------------------------------

    def held(self) -> list[SideId]:
        """Its held sides, but no activated decode, and every unattributed side
        it has not disowned."""
        held = [(h, role) for h, role, side in self.ledger.holding() if not side.activated]
        return held + self._unattributed.expected_by(self.name)

    async def reclaim(self, sides: Iterable[SideId], why: str, origin: Origin) -> list[SideId]:
        """Close ``sides`` and free those still held (not an activated decode) on its own."""
        owed: list[tuple[SideId, Awaitable[bool]]] = []
        for held in sides:
            side: SideRecord | None
            if held in self._unattributed:
                if not self._unattributed.disown(self.name, held):
                    continue  # another shard may still expect it held
                side = self.ledger.side(*held)
                side.take()
            else:
                # Found, never made: a side another shard claimed meanwhile is not this one's.
                side = self.ledger.find(*held)
                if side is None or not side.holds or side.activated:
                    continue
            side.close()  # a later acquiring action is answered from the tombstone
            log.info("%s: freeing it", why, extra={"handoff_id": held[0]})
            owed.append((held, self._freer.free(*held, side, origin)))
        await asyncio.gather(*(free for _, free in owed))
        return [held for held, _ in owed]

    def kept(self, sides: Iterable[SideId]) -> None:
        """This shard expects these held: an unattributed one is its own from now on."""
        for held in sides:
            if self._unattributed.claim(held):
                self.ledger.side(*held).take()
                log.info(
                    "held %s side belongs to shard %s",
                    held[1].name.lower(),
                    self.name,
                    extra={"handoff_id": held[0]},
                )

    async def fenced(self, error: OlderIncarnationError) -> None:
        await self._on_fenced(error)
