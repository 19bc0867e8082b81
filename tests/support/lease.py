"""KV-counting engines and a TCP proxy that can black-hole a connection (issue 12).

Imports only the SDK and the standard library, like tests/support/sidecar.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import Counter
from collections.abc import Callable, Iterable

from handoff_client import (
    ACCEPTED,
    APPLIED,
    NOOP,
    SUBMITTED,
    Action,
    Facts,
    Outcome,
    Role,
)
from tests.support.sidecar import ScriptedEngine

BLOCKS = 8  # KV blocks per side
Side = tuple[str, Role]


class BlockEngine(ScriptedEngine):
    """A scripted engine that holds ``BLOCKS`` KV blocks per side it acquires.

    Every free is counted: a side freed twice is a double free, a side still
    held at the end a leak. ``freed_at`` stamps each free (monotonic) so a
    test can order one engine's frees against another's. ``stall`` names
    the roles for which it never reports the fact that follows acquiring
    them (it holds and waits, as a stalled engine would).
    ``surviving`` is what ``held_handoffs`` answers.
    """

    def __init__(self, stall: Iterable[Role] = ()) -> None:
        super().__init__()
        self.blocks: Counter[Side] = Counter()
        self.freed_at: dict[Side, float] = {}
        self.double_frees = 0
        self.stall = set(stall)
        self.surviving: list[Side] = []

    @property
    def held_blocks(self) -> int:
        return sum(self.blocks.values())

    def _take(self, side: Side) -> None:
        if side not in self.blocks and side not in self.freed_at:
            self.blocks[side] = BLOCKS

    def _free(self, side: Side) -> Outcome:
        if side in self.freed_at:
            self.double_frees += 1
            return NOOP
        if side not in self.blocks:
            return NOOP  # never took anything for it
        del self.blocks[side]
        self.freed_at[side] = time.monotonic()
        return APPLIED

    async def held_handoffs(self) -> list[Side]:
        return list(self.surviving)

    async def submit_prefill(self, action: Action, facts: Facts) -> Outcome:
        self.calls.append(action)
        self._take((action.handoff_id, Role.SOURCE))
        if Role.SOURCE in self.stall:
            return SUBMITTED  # and never SourceHeld: it holds and waits
        return await self.held(action, facts)

    async def reserve_destination(self, action: Action, facts: Facts) -> Outcome:
        self.calls.append(action)
        self._take((action.handoff_id, Role.DESTINATION))
        if Role.DESTINATION in self.stall:
            return ACCEPTED  # and never DestinationReserved
        return await self.reserved(action, facts)

    async def release_source(self, action: Action, facts: Facts) -> Outcome:
        self.calls.append(action)
        return self._free((action.handoff_id, Role.SOURCE))

    async def cancel_source(self, action: Action, facts: Facts) -> Outcome:
        self.calls.append(action)
        return self._free((action.handoff_id, Role.SOURCE))

    async def cancel_destination(self, action: Action, facts: Facts) -> Outcome:
        self.calls.append(action)
        return self._free((action.handoff_id, Role.DESTINATION))

    def finish_decode(self, handoff_id: str) -> None:
        """The activated decode finished on its own and freed its memory."""
        self._free((handoff_id, Role.DESTINATION))


class BlackHoleProxy:
    """A real TCP proxy on loopback. ``cut()`` stops forwarding in both directions
    without closing anything (a black-holed network path: the peers see
    silence, not a reset); ``heal()`` forwards again, what was held included."""

    def __init__(self, target_port: int) -> None:
        self._target_port = target_port
        self._flowing = asyncio.Event()
        self._flowing.set()
        self._server: asyncio.Server | None = None
        self._pipes: set[asyncio.Task[None]] = set()
        self._writers: list[asyncio.StreamWriter] = []
        self.port = 0

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]

    def cut(self) -> None:
        self._flowing.clear()

    def heal(self) -> None:
        self._flowing.set()

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for task in self._pipes:
            task.cancel()
        await asyncio.gather(*self._pipes, return_exceptions=True)
        for writer in self._writers:
            writer.close()

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            upstream_reader, upstream_writer = await asyncio.open_connection(
                "127.0.0.1", self._target_port
            )
        except OSError:
            writer.close()
            return
        self._writers += [writer, upstream_writer]
        for source, sink in ((reader, upstream_writer), (upstream_reader, writer)):
            task = asyncio.create_task(self._pipe(source, sink))
            self._pipes.add(task)
            task.add_done_callback(self._pipes.discard)

    async def _pipe(self, source: asyncio.StreamReader, sink: asyncio.StreamWriter) -> None:
        with contextlib.suppress(OSError, asyncio.IncompleteReadError):
            while True:
                await self._flowing.wait()
                data = await source.read(65536)
                # Read while flowing, held while cut: nothing crosses a cut.
                await self._flowing.wait()
                if not data:
                    break
                sink.write(data)
                await sink.drain()
        sink.close()


async def until(predicate: Callable[[], bool], poll_s: float = 0.02) -> None:
    """Until ``predicate()`` holds; bound it with asyncio.timeout. For state that
    lives in an engine or a sidecar's stats and has no event of its own."""
    while not predicate():  # noqa: ASYNC110 - no event to await: polled state
        await asyncio.sleep(poll_s)
