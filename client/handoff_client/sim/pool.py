"""A finite pool of KV-cache blocks, the memory a handoff must never leak."""

from __future__ import annotations

import math


class KvBlockPool:
    """``capacity`` blocks of ``block_size`` tokens; each request holds at most one allocation."""

    def __init__(self, capacity: int, block_size: int) -> None:
        if capacity < 1 or block_size < 1:
            raise ValueError("capacity and block_size must be >= 1")
        self.capacity = capacity
        self.block_size = block_size
        self._held: dict[str, int] = {}  # request (handoff id) -> blocks
        self._used = 0

    @property
    def free(self) -> int:
        return self.capacity - self._used

    @property
    def used(self) -> int:
        return self._used

    def holders(self) -> dict[str, int]:
        return dict(self._held)

    def _blocks_for(self, tokens: int) -> int:
        return max(1, math.ceil(tokens / self.block_size))

    def allocate(self, owner: str, tokens: int) -> bool:
        """Take the blocks for ``tokens``; False (and nothing taken) if they do not fit.

        Allocating again for an owner that already holds blocks is a no-op
        that succeeds: a handler run twice must not hold twice.
        """
        if owner in self._held:
            return True
        blocks = self._blocks_for(tokens)
        if blocks > self.free:
            return False
        self._held[owner] = blocks
        self._used += blocks
        return True

    def release(self, owner: str) -> bool:
        """Give back what ``owner`` holds; False if it held nothing."""
        blocks = self._held.pop(owner, None)
        if blocks is None:
            return False
        self._used -= blocks
        return True
