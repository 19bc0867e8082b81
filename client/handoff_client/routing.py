"""Where a HandoffClient sends each call: the shard map, one channel per shard, known owners.

The map is learned from the coordinator (GetShardMap on the address the
client was given) or given explicitly, and refreshed every ``refresh_s``,
and sooner (at most once a second) after a shard was unreachable or refused
a start as not its own. A coordinator that answers UNIMPLEMENTED predates
shards: it is one shard. With one shard every call takes the client's own
channel, exactly as before shards existed.

The owner of each handoff this client started (the shard that answered) is
remembered in a bounded LRU, so its later calls go straight there even after
the map changed; ownership is for life (docs/sharding.md).
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from collections.abc import Awaitable, Callable

import grpc

from handoff_client.errors import HandoffRpcError, UnimplementedError
from handoff_client.placement import ShardMap
from handoff_proto.v1 import coordinator_pb2_grpc as pb_grpc

OWNERS_REMEMBERED = 100_000
REFRESH_S = 10.0
# A refresh asked for by a failure waits at least this long after the last one.
MIN_REFRESH_S = 1.0
# Calls still running on a channel whose address left the map get this long.
CLOSE_GRACE_S = 30.0


class Router:
    """The shard map of one client, the channel to each shard, and the owners it knows."""

    def __init__(
        self,
        seed: grpc.aio.Channel,
        target: str,
        *,
        dial: Callable[[str], grpc.aio.Channel],
        fetch: Callable[[], Awaitable[ShardMap]],
        explicit: ShardMap | None,
        refresh_s: float = REFRESH_S,
    ) -> None:
        self._seed = pb_grpc.HandoffCoordinatorStub(seed)
        self._target = target
        self._dial = dial
        self._fetch = fetch
        self._explicit = explicit is not None
        self._map = explicit
        # A coordinator answered (or the map was given): not the stand-in of
        # one shard at the client's own address while none could be reached.
        self.learned = explicit is not None
        self._refresh_s = refresh_s
        self._due = 0.0  # loop time of the next refresh
        self._last = -MIN_REFRESH_S
        self._fetching: asyncio.Future[None] | None = None
        self._channels: dict[str, tuple[grpc.aio.Channel, pb_grpc.HandoffCoordinatorStub]] = {}
        # Channels closing with grace after their address left the map.
        self._retired: dict[asyncio.Task[None], grpc.aio.Channel] = {}
        self._owners: OrderedDict[str, str] = OrderedDict()

    @property
    def known(self) -> ShardMap:
        """The map as last learned; raises if none was learned yet."""
        if self._map is None:
            raise RuntimeError("the shard map is not known yet: await client.shard_map() first")
        return self._map

    def sharded(self) -> bool:
        return self._map is not None and len(self._map.shards) > 1

    async def shard_map(self) -> ShardMap:
        """The current map: learned on first use, refreshed when due."""
        if not self._explicit and (
            self._map is None or asyncio.get_running_loop().time() >= self._due
        ):
            if self._fetching is None:
                self._fetching = asyncio.ensure_future(self._refresh())
            # Shielded: one caller's cancellation must not cancel everyone's refresh.
            await asyncio.shield(self._fetching)
        return self.known

    async def learn(self) -> ShardMap | None:
        """Ask for the map now unless a coordinator answered it already (or it was
        given): the map then, None while none answers."""
        if not self.learned:
            if self._fetching is None:
                self._fetching = asyncio.ensure_future(self._refresh())
            await asyncio.shield(self._fetching)
        return self._map if self.learned else None

    async def refetch(self) -> ShardMap:
        """Ask for the map now, rate limit or not (joining a fetch under way): a
        shard named an owner this client's map does not know."""
        if not self._explicit:
            if self._fetching is None:
                self._fetching = asyncio.ensure_future(self._refresh())
            await asyncio.shield(self._fetching)
        return self.known

    def stale(self) -> None:
        """Refresh before the next routed call (rate-limited): a shard may have moved."""
        self._due = min(self._due, self._last + MIN_REFRESH_S)

    async def _refresh(self) -> None:
        now = asyncio.get_running_loop().time()
        try:
            learned = await self._fetch()
            self._due = now + self._refresh_s
            self.learned = True
        except UnimplementedError:
            learned = ShardMap.of([(self._target, self._target)])  # an older, unsharded server
            self._due = now + self._refresh_s
            self.learned = True
        except HandoffRpcError:
            # Unreachable (or refused) for now: keep what we knew; with nothing
            # known, this client's own address is the one place to try.
            learned = self._map or ShardMap.of([(self._target, self._target)])
            self._due = now + MIN_REFRESH_S
        finally:
            self._last = now
            self._fetching = None
        self._adopt(learned)

    def _adopt(self, learned: ShardMap) -> None:
        self._map = learned
        addresses = {shard.address for shard in learned.shards} if len(learned.shards) > 1 else ()
        for address in [a for a in self._channels if a not in addresses]:
            channel, _ = self._channels.pop(address)
            task = asyncio.create_task(channel.close(CLOSE_GRACE_S))
            self._retired[task] = channel
            task.add_done_callback(self._retired.pop)

    def stub(self, shard: str | None) -> pb_grpc.HandoffCoordinatorStub:
        """The stub for ``shard``'s current address; None, or a map of one: the client's own."""
        if shard is None or not self.sharded():
            return self._seed
        address = self.known.address(shard)
        known = self._channels.get(address)
        if known is None:
            channel = self._dial(address)
            known = self._channels[address] = (channel, pb_grpc.HandoffCoordinatorStub(channel))
        return known[1]

    def channel(self, shard: str) -> grpc.aio.Channel:
        self.stub(shard)
        return self._channels[self.known.address(shard)][0]

    def owner(self, handoff_id: str) -> str | None:
        """The shard remembered to own ``handoff_id``, if it is still in the map."""
        name = self._owners.get(handoff_id)
        if name is None or name not in self.known.names:
            return None
        self._owners.move_to_end(handoff_id)
        return name

    def remember(self, handoff_id: str, shard: str) -> None:
        self._owners[handoff_id] = shard
        self._owners.move_to_end(handoff_id)
        if len(self._owners) > OWNERS_REMEMBERED:
            self._owners.popitem(last=False)

    async def close(self) -> None:
        if self._fetching is not None:
            self._fetching.cancel()
        channels = [channel for channel, _ in self._channels.values()]
        self._channels.clear()
        for channel in channels:
            await channel.close(None)
        for task, channel in list(self._retired.items()):
            task.cancel()
            await channel.close(None)
