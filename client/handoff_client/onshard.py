"""OnShard: one shard of a routing HandoffClient, at wherever the shard map puts it now.

A sidecar keeps one link per coordinator shard, and each link talks to its
own shard only: its stream, its reconcile, the reports about the handoffs
that shard owns. Shard names are stable, addresses are not (a pod that
moves comes back elsewhere), so a link must not keep a client bound to the
address it first saw: :meth:`OnShard.client` answers a client bound to the
shard's address as the map has it now, and :meth:`OnShard.unreachable` asks
the routing client to learn the map again soon.
"""

from __future__ import annotations

from handoff_client.client import HandoffClient, SideId
from handoff_client.model import Reconciled


class OnShard:
    """``client``'s shard ``shard``; None: the client itself, unrouted (one coordinator)."""

    def __init__(self, client: HandoffClient, shard: str | None = None) -> None:
        self.routing = client
        self.shard = shard
        self._bound: HandoffClient | None = None
        self._address = ""

    @property
    def timeout_s(self) -> float:
        return self.routing.timeout_s

    async def client(self) -> HandoffClient:
        """A client for the shard alone, at its current address (the map refreshed when due)."""
        if self.shard is None:
            return self.routing
        shard_map = await self.routing.shard_map()
        if self.shard not in shard_map.names:
            # Gone from the map: where it last was is still the best place to try.
            return self._bound or self.routing
        address = shard_map.address(self.shard)
        if self._bound is None or address != self._address:
            self._bound, self._address = self.routing.for_shard(self.shard), address
        return self._bound

    def unreachable(self) -> None:
        """The shard did not answer: it may be back on another address."""
        if self.shard is not None:
            self.routing.shard_map_stale()


class ReconcilesOnShard:
    """Reconcile for a transport that talks to one shard (``_shard``): both
    built-in transports send it on the same unary call, to that shard alone."""

    _shard: OnShard

    async def reconcile(
        self,
        engine_id: str,
        *,
        incarnation: str,
        session_id: str,
        held: list[SideId],
        freed: list[SideId],
    ) -> Reconciled:
        client = await self._shard.client()
        return await client.reconcile(
            engine_id, incarnation=incarnation, session_id=session_id, held=held, freed=freed
        )
