"""The Prometheus /metrics endpoint, served on the event loop.

prometheus_client's own server starts a thread per connection, so a crowd of
idle connections is a crowd of threads. Here a connection is a coroutine, at
most :data:`MAX_CONNECTIONS` at once: a new one past that closes the one idle
longest (so idle connections cannot lock a scraper out), and a connection is
closed when its request does not arrive within :data:`REQUEST_WITHIN_S` or
its head is larger than :data:`MAX_HEAD_BYTES`. The exposition text itself
is rendered in the loop's default executor (a small, bounded pool), off the
loop. A peer that goes away is normal and logged at debug, without a traceback.
"""

from __future__ import annotations

import asyncio
import contextlib
import gzip
import logging

from prometheus_client import CollectorRegistry
from prometheus_client.exposition import choose_encoder

log = logging.getLogger("handoff.metrics")

MAX_CONNECTIONS = 64
REQUEST_WITHIN_S = 10.0
MAX_HEAD_BYTES = 8192
PATHS = ("/metrics", "/")


class MetricsEndpoint:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        self.connections = 0
        # Connections waiting for a request, longest-waiting first.
        self._idle: dict[asyncio.StreamWriter, None] = {}
        self._server: asyncio.Server | None = None

    async def start(self, host: str, port: int) -> int:
        """Listen on ``host:port`` (0: a free port); the port bound."""
        self._server = await asyncio.start_server(self._serve, host, port, limit=MAX_HEAD_BYTES)
        bound: int = self._server.sockets[0].getsockname()[1]
        return bound

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self.connections >= MAX_CONNECTIONS:
            if not self._idle:
                log.debug("metrics: %d connections busy, closing a new one", self.connections)
                writer.close()
                return
            oldest = next(iter(self._idle))
            del self._idle[oldest]
            oldest.transport.abort()  # its wait for a request ends, and it leaves
            log.debug("metrics: %d connections open, closed the one idle longest", MAX_CONNECTIONS)
        self.connections += 1
        try:
            while await self._answer(reader, writer):
                pass
        except (ConnectionError, TimeoutError, asyncio.IncompleteReadError) as error:
            log.debug("metrics: connection ended (%s)", type(error).__name__)
        except asyncio.LimitOverrunError:
            log.debug("metrics: request head over %d bytes; connection closed", MAX_HEAD_BYTES)
        finally:
            self._idle.pop(writer, None)
            self.connections -= 1
            writer.close()
            with contextlib.suppress(ConnectionError):
                await writer.wait_closed()

    async def _answer(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        """Answer one request; False when the connection is to be closed."""
        self._idle[writer] = None
        try:
            async with asyncio.timeout(REQUEST_WITHIN_S):
                head = await reader.readuntil(b"\r\n\r\n")
        finally:
            self._idle.pop(writer, None)
        lines = head.decode("latin-1").split("\r\n")
        method, _, rest = lines[0].partition(" ")
        target, _, version = rest.partition(" ")
        headers = {}
        for line in lines[1:]:
            name, colon, value = line.partition(":")
            if colon:
                headers[name.strip().lower()] = value.strip()
        keep_alive = version == "HTTP/1.1" and headers.get("connection", "").lower() != "close"
        if method not in ("GET", "HEAD"):
            await _respond(writer, "405 Method Not Allowed", b"only GET and HEAD\n", keep_alive)
        elif target.partition("?")[0] not in PATHS:
            await _respond(writer, "404 Not Found", b"metrics are at /metrics\n", keep_alive)
        else:
            encoder, content_type = choose_encoder(headers.get("accept", ""))
            body = await asyncio.get_running_loop().run_in_executor(None, encoder, self.registry)
            extra = [("Content-Type", content_type)]
            if "gzip" in headers.get("accept-encoding", ""):
                body = gzip.compress(body)
                extra.append(("Content-Encoding", "gzip"))
            await _respond(writer, "200 OK", body, keep_alive, extra, with_body=method == "GET")
        return keep_alive


async def _respond(
    writer: asyncio.StreamWriter,
    status: str,
    body: bytes,
    keep_alive: bool,
    headers: list[tuple[str, str]] | None = None,
    with_body: bool = True,
) -> None:
    lines = [f"HTTP/1.1 {status}", f"Content-Length: {len(body)}"]
    lines += [f"{name}: {value}" for name, value in headers or [("Content-Type", "text/plain")]]
    if not keep_alive:
        lines.append("Connection: close")
    writer.write("\r\n".join(lines).encode("latin-1") + b"\r\n\r\n")
    if with_body:
        writer.write(body)
    await writer.drain()
