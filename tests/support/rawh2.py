"""HTTP/2 frames written by hand, for attacks no well-behaved client library sends.

Just enough of RFC 9113 and RFC 7541 to open streams and abuse them: the
connection preface, SETTINGS, HEADERS and CONTINUATION with literal header
fields (no Huffman coding, no dynamic table), RST_STREAM. What the server
sends back is read and thrown away, so that its writes never block.
"""

from __future__ import annotations

import asyncio
import contextlib
import struct
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
HEADERS, RST_STREAM, SETTINGS, CONTINUATION = 0x1, 0x3, 0x4, 0x9
END_STREAM, END_HEADERS, ACK = 0x1, 0x4, 0x1
CANCEL = 0x8


def frame(kind: int, flags: int, stream_id: int, payload: bytes = b"") -> bytes:
    return (
        struct.pack(">I", len(payload))[1:] + struct.pack(">BBI", kind, flags, stream_id) + payload
    )


def _integer(value: int, prefix_bits: int, first: int = 0) -> bytes:
    """RFC 7541 5.1: ``value`` with an N-bit prefix (the rest of the first byte is ``first``)."""
    limit = (1 << prefix_bits) - 1
    if value < limit:
        return bytes([first | value])
    out = bytearray([first | limit])
    value -= limit
    while value >= 128:
        out.append(value % 128 + 128)
        value //= 128
    out.append(value)
    return bytes(out)


def _string(raw: bytes) -> bytes:
    return _integer(len(raw), 7) + raw


def header_block(headers: Sequence[tuple[str, str | bytes]]) -> bytes:
    """Every field a literal without indexing, with a literal name (RFC 7541 6.2.2)."""
    block = bytearray()
    for name, value in headers:
        raw = value if isinstance(value, bytes) else value.encode()
        block += b"\x00" + _string(name.encode()) + _string(raw)
    return bytes(block)


def grpc_headers(path: str, *extra: tuple[str, str | bytes]) -> bytes:
    """The header block of a gRPC call to ``path``."""
    return header_block(
        [
            (":method", "POST"),
            (":scheme", "http"),
            (":path", path),
            (":authority", "localhost"),
            ("content-type", "application/grpc"),
            ("te", "trailers"),
            *extra,
        ]
    )


@dataclass
class Connection:
    """One raw HTTP/2 connection: streams are opened on odd ids, in order."""

    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter
    next_stream: int = 1

    def stream_id(self) -> int:
        stream = self.next_stream
        self.next_stream += 2
        return stream

    async def send(self, data: bytes) -> None:
        self.writer.write(data)
        await self.writer.drain()


async def _discard(reader: asyncio.StreamReader) -> None:
    with contextlib.suppress(ConnectionError, asyncio.CancelledError):
        while await reader.read(65536):
            pass


@contextlib.asynccontextmanager
async def connection(host: str, port: int) -> AsyncIterator[Connection]:
    """A plaintext HTTP/2 connection, past the preface and settings exchange."""
    reader, writer = await asyncio.open_connection(host, port)
    drained = asyncio.create_task(_discard(reader))
    try:
        opened = Connection(reader, writer)
        # Our empty SETTINGS, and the ack of the server's (whatever they were).
        await opened.send(PREFACE + frame(SETTINGS, 0, 0) + frame(SETTINGS, ACK, 0))
        yield opened
    finally:
        drained.cancel()
        writer.close()
        with contextlib.suppress(ConnectionError, asyncio.CancelledError):
            await drained
            await writer.wait_closed()
