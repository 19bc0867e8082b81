"""The local channel between vLLM's engine core and the engine's sidecar process.

One socketpair, made by the engine core and inherited by the sidecar
process: frames of a 4-byte length and a pickled tuple ``(kind, *args)``.
Pickle, because both ends are this package in one environment (the sidecar
is started with the engine core's own interpreter) and the socket is
reachable by these two processes only.

The sidecar process sends the coordinator's actions in (CALL, CANCEL) and
answers lookups; the engine core sends outcomes (RESULT), facts and lookups
out. Everything on it is ordered: a fact a handler queued follows that
handler's RESULT.
"""

from __future__ import annotations

import asyncio
import contextlib
import pickle
import socket
import struct
from typing import Any

from handoff_client.runner import HANDLER_NAMES

# engine core -> sidecar process
SETTINGS = "settings"  # (Settings,): the first frame
RESULT = "result"  # (call id, status, value)
FACT = "fact"  # (handoff id, Fact)
LOOKUP = "lookup"  # (lookup id, handoff id): is this handoff gone?
STOP = "stop"  # (): leave the coordinator, then exit
# sidecar process -> engine core
CALL = "call"  # (call id, handler name, Action)
CANCEL = "cancel"  # (call id,): the sidecar cancelled that handler
ANSWER = "answer"  # (lookup id, why it is gone, or None)
STARTED = "started"  # (incarnation,)
SUBSCRIBED = "subscribed"  # (): the coordinator confirmed the first subscription

# RESULT statuses
OK, RAISED, CANCELLED = "ok", "raised", "cancelled"
# What a CALL may name: the handlers, the COMPLETE notice and the reconcile's list.
CALLABLE = frozenset({*HANDLER_NAMES.values(), "complete", "held_handoffs"})

HEADER = struct.Struct("!I")
MAX_FRAME = 16 * 1024 * 1024


class Channel:
    """One end of the socketpair, on the running loop."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._reader, self._writer = reader, writer

    @classmethod
    async def open(cls, sock: socket.socket) -> Channel:
        reader, writer = await asyncio.open_unix_connection(sock=sock)
        return cls(reader, writer)

    def send(self, kind: str, *args: object) -> None:
        """Queued in order; dropped once the other end is gone (it reads nothing more)."""
        if self._writer.is_closing():
            return
        data = pickle.dumps((kind, *args))
        self._writer.write(HEADER.pack(len(data)) + data)

    async def receive(self) -> tuple[Any, ...] | None:
        """The next frame; None once the other end closed it (or died)."""
        try:
            (size,) = HEADER.unpack(await self._reader.readexactly(HEADER.size))
            if size > MAX_FRAME:
                raise ValueError(f"a frame of {size} bytes on the sidecar channel")
            message = pickle.loads(await self._reader.readexactly(size))
        except (asyncio.IncompleteReadError, ConnectionError):
            return None
        assert isinstance(message, tuple), message
        return message

    async def drain(self) -> None:
        with contextlib.suppress(ConnectionError):
            await self._writer.drain()

    def close(self) -> None:
        self._writer.close()
