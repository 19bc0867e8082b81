"""deploy/proxy/nghttpx.conf in front of a real `handoff serve`: the defence
against HTTP/2 rapid reset that gRPC's core does not have (issue 27, item 11).

A real nghttpx (Debian's nghttp2-proxy) runs the shipped file, with only its
listening and backend addresses put on free loopback ports and its TLS
lines dropped (the attacker speaks plaintext HTTP/2).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest

from tests.service.test_security_attacks import (
    GOOD,
    MIN_COMPLETED,
    TOKEN,
    UNPACED,
    assert_unharmed,
    reset_flood,
)
from tests.support.attack import Served, alongside, attacker, bearer, rate_kept, serving
from tests.support.fakes import free_port
from tests.support.processes import debian_binary

pytestmark = pytest.mark.serial

CONF = Path(__file__).parents[2] / "deploy" / "proxy" / "nghttpx.conf"
TIMEOUT_S = 60.0


def conf_for(backend_port: int, port: int, folder: Path) -> Path:
    """The shipped file, listening on loopback ``port`` without TLS, in front
    of the coordinator on ``backend_port``; every other line as shipped."""
    lines = []
    for line in CONF.read_text().splitlines():
        if line.startswith("frontend="):
            line = f"frontend=127.0.0.1,{port};no-tls"
        elif line.startswith("backend="):
            line = f"backend=127.0.0.1,{backend_port};;proto=h2"
        elif line.startswith(("private-key-file=", "certificate-file=")):
            continue
        lines.append(line)
    lines.append(f"errorlog-file={folder / 'nghttpx.log'}")
    conf = folder / "nghttpx.conf"
    conf.write_text("\n".join(lines) + "\n")
    return conf


@contextlib.asynccontextmanager
async def proxying(served: Served, folder: Path) -> AsyncIterator[int]:
    """nghttpx in front of ``served`` for the block; its port."""
    port = free_port()
    process = await asyncio.create_subprocess_exec(
        debian_binary("nghttpx", "nghttp2-proxy"), f"--conf={conf_for(served.port, port, folder)}"
    )
    try:
        while True:  # until it listens (it says nothing else when it is ready)
            try:
                _, writer = await asyncio.open_connection("127.0.0.1", port)
            except ConnectionError:
                assert process.returncode is None, "nghttpx exited at start"
                await asyncio.sleep(0.05)
                continue
            writer.close()
            break
        yield port
    finally:
        process.terminate()
        await process.wait()


async def reset_floods(port: int, seconds: float, rpc: str, per_s: float) -> tuple[int, int]:
    """:func:`reset_flood` for ``seconds``, on a new connection each time the
    proxy closes one; streams opened and connections used (run in
    :func:`attacker`)."""
    loop = asyncio.get_running_loop()
    until = loop.time() + seconds
    opened = connections = 0
    while loop.time() < until:
        connections += 1
        with contextlib.suppress(ConnectionError):
            opened += await reset_flood(port, until - loop.time(), rpc, per_s)
    return opened, connections


async def test_a_rapid_reset_flood_through_the_proxy_leaves_the_rpc_its_rate(
    tmp_path: Path,
) -> None:
    """One tokenless connection at a time opens and resets `StartHandoff`
    streams at 8,750 a second, through the proxy, for 3 s, while the
    well-behaved client, a frontend with 40 handoffs a second of work,
    starts its handoffs through the proxy too. Straight to the coordinator
    this flood leaves such a client 0.15 of its rate (each RPC's calls are
    taken one at a time, docs/limits.md, "HTTP/2"); the proxy closes each
    attacker connection after its limit of resets, and the client keeps at
    least 90 % of its rate."""
    tokens = tmp_path / "tokens"
    tokens.write_text(f"{GOOD}\n")
    async with (
        asyncio.timeout(TIMEOUT_S),
        serving(tmp_path, "--token-file", str(tokens), *UNPACED) as served,
        proxying(served, tmp_path) as port,
        contextlib.AsyncExitStack() as stack,
        grpc.aio.insecure_channel(f"127.0.0.1:{port}") as good,
        alongside(good, bearer(TOKEN), per_s=40.0) as client,
    ):
        attack = await stack.enter_async_context(attacker("tests.service.test_front_proxy"))
        await client.completed_at_least(MIN_COMPLETED)
        flood = attack(reset_floods, port, 3.0, "StartHandoff", 8750.0)
        (opened, connections), kept = await rate_kept(client, flood)
        assert opened >= 8750 * 3 // 2, opened
        assert connections > 1, "the proxy never closed the flooding connection"
        assert kept >= 0.9, kept
        assert_unharmed(client, served)
