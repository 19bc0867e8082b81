"""Which shard owns a handoff: rendezvous hashing over shard names, and the shard map.

Client and server share this one implementation, so a routing client sends
each new handoff to the shard that would accept it. Placement hashes shard
NAMES, never addresses: names are stable (a StatefulSet's ``handoff-2``),
addresses change when a pod moves, and a placement that followed addresses
would move handoffs with them.

Rendezvous (highest random weight) hashing: every placing shard scores the
id, the highest score wins, ties go to the lower ordinal. Adding or removing
a shard moves only the ids that shard wins or won; and a handoff, once
started, stays with the shard that started it whatever the map says later
(ownership is for life), so placement only ever decides where a NEW id goes.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass


def score(shard_name: str, handoff_id: str) -> int:
    """The shard's weight for the id: the first 8 bytes of blake2b(name NUL id), unsigned."""
    digest = hashlib.blake2b(
        shard_name.encode() + b"\0" + handoff_id.encode(), digest_size=8
    ).digest()
    return int.from_bytes(digest, "big")


def place(handoff_id: str, shard_names: Sequence[str]) -> str:
    """The shard, among ``shard_names`` (in ordinal order), that a new ``handoff_id`` goes to."""
    if not shard_names:
        raise ValueError("no shard takes new handoffs: the placing set is empty")
    best, best_score = shard_names[0], score(shard_names[0], handoff_id)
    for name in shard_names[1:]:
        weight = score(name, handoff_id)
        if weight > best_score:  # strictly: a tie stays with the lower ordinal
            best, best_score = name, weight
    return best


@dataclass(frozen=True, slots=True)
class ShardInfo:
    """One coordinator shard: its stable name, the address to dial, whether it places."""

    name: str
    address: str
    placing: bool = True


@dataclass(frozen=True, slots=True)
class ShardMap:
    """Every shard, placing or draining, in ordinal order."""

    shards: tuple[ShardInfo, ...]

    def __post_init__(self) -> None:
        if not self.shards:
            raise ValueError("a shard map names at least one shard")
        names = [shard.name for shard in self.shards]
        if len(set(names)) != len(names):
            raise ValueError(f"a shard map names each shard once, got {', '.join(names)}")

    @classmethod
    def of(cls, addresses: Iterable[tuple[str, str]]) -> ShardMap:
        """Every shard placing: ``(name, address)`` pairs in ordinal order."""
        return cls(tuple(ShardInfo(name, address) for name, address in addresses))

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(shard.name for shard in self.shards)

    @property
    def placing(self) -> tuple[str, ...]:
        return tuple(shard.name for shard in self.shards if shard.placing)

    def address(self, name: str) -> str:
        for shard in self.shards:
            if shard.name == name:
                return shard.address
        raise KeyError(f"no shard named {name!r} in the map ({', '.join(self.names)})")

    def owner_of(self, handoff_id: str) -> str:
        """Where a new ``handoff_id`` goes: the rendezvous winner among the placing shards."""
        return place(handoff_id, self.placing)
