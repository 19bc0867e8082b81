"""A sidecar's links, one per shard, against real in-process shards on loopback (issue 13).

tests/client/test_sidecar_shards_process.py kills and moves `handoff serve` shards;
these are the rules that need no process: which links a sidecar opens, on
both transports, and where its reports go.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

from handoff_client import EngineSidecar, EngineType, HandoffClient, TransportKind
from handoff_client.placement import place
from handoff_server.service.app import Server
from tests.service.test_shards import NAMES
from tests.support.fakes import free_port
from tests.support.lease import until
from tests.support.servers import FAST_RECONNECT, StartServer
from tests.support.sidecar import DESTINATION, QUICK, SOURCE, ScriptedEngine, start

TIMEOUT_S = 30


async def shards_on(start_server: StartServer, ports: list[int], tmp_path: Path) -> list[Server]:
    shard_map = tmp_path / "shards.json"
    shard_map.write_text(
        json.dumps({n: f"127.0.0.1:{p}" for n, p in zip(NAMES, ports, strict=True)})
    )
    return [
        await start_server(
            port=port,
            shard_count=3,
            shard_ordinal=ordinal,
            shard_map=str(shard_map),
            shard_name_prefix="handoff",  # not this machine's hostname
        )
        for ordinal, port in enumerate(ports)
    ]


async def test_a_single_coordinator_is_one_link(lean_server: Server, kind: TransportKind) -> None:
    async with (
        HandoffClient(f"127.0.0.1:{lean_server.port}") as client,
        EngineSidecar(client, SOURCE, ScriptedEngine(), transport=kind) as sidecar,
        asyncio.timeout(TIMEOUT_S),
    ):
        await sidecar.wait_subscribed()
        assert sidecar.shards == (await client.shard_map()).names
        assert len(sidecar.shards) == 1
        await until(lambda: sidecar.stats.reconciles == 1)  # one link, one reconcile


async def test_a_sidecar_started_before_the_shards_links_each_once_they_answer(
    start_lean_server: StartServer, tmp_path: Path, kind: TransportKind
) -> None:
    """Nothing answers at first: no link (not even one to the address it was given,
    which would duplicate the link to whichever shard that is). Once the shards are
    up: one link to each, each handoff's actions and reports on its owner's."""
    ports = [free_port() for _ in NAMES]
    prefill, decode = ScriptedEngine(), ScriptedEngine()
    async with (
        HandoffClient(f"127.0.0.1:{ports[0]}", channel_options=FAST_RECONNECT) as client,
        EngineSidecar(client, SOURCE, prefill, reconnect_backoff=QUICK, transport=kind) as p,
        asyncio.timeout(TIMEOUT_S),
    ):
        await until(lambda: p.stats.reconnects >= 3)
        assert p.shards == ()
        shards = await shards_on(start_lean_server, ports, tmp_path)
        async with EngineSidecar(
            client, DESTINATION, decode, reconnect_backoff=QUICK, transport=kind
        ) as d:
            await p.wait_subscribed()
            await d.wait_subscribed()
            assert p.shards == d.shards == NAMES
            ids = [await start(client, EngineType.VLLM) for _ in range(30)]
            for h in ids:
                await asyncio.wait_for(decode.notices[h].get(), TIMEOUT_S)
            for name, server in zip(NAMES, shards, strict=True):
                mine = {h for h in ids if place(h, NAMES) == name}
                assert mine
                assert set(server.registry.handoffs) == mine
            for sidecar in (p, d):
                assert sidecar.stats.reports_rejected == 0
                assert sidecar.stats.session_conflicts == 0
                assert sidecar.stats.reconciles >= len(NAMES)  # one per link at least


async def test_links_follow_shards_added_to_and_removed_from_the_map(
    start_lean_server: StartServer, tmp_path: Path, kind: TransportKind
) -> None:
    """Two shards, then three (a link to the new one), then two again (the third's
    link closed: the engine holds nothing it owns)."""
    ports = [free_port() for _ in NAMES]
    shard_map = tmp_path / "shards.json"
    shard_map.write_text(
        json.dumps({n: f"127.0.0.1:{p}" for n, p in zip(NAMES, ports, strict=True)})
    )

    async def deploy(count: int) -> list[Server]:
        return [
            await start_lean_server(
                port=ports[ordinal],
                shard_count=count,
                shard_ordinal=ordinal,
                shard_map=str(shard_map),
                shard_name_prefix="handoff",
            )
            for ordinal in range(count)
        ]

    servers = await deploy(2)
    async with (
        HandoffClient(
            f"127.0.0.1:{ports[0]}", channel_options=FAST_RECONNECT, shard_refresh_s=0.2
        ) as client,
        EngineSidecar(
            client, SOURCE, ScriptedEngine(), reconnect_backoff=QUICK, transport=kind
        ) as sidecar,
        asyncio.timeout(TIMEOUT_S),
    ):
        await sidecar.wait_subscribed()
        assert sidecar.shards == NAMES[:2]
        for count in (3, 2):
            for server in servers:
                await server.stop()
            servers = await deploy(count)
            await until(lambda: sidecar.shards == NAMES[:count])  # noqa: B023 - awaited here
            await sidecar.wait_subscribed()
        assert sidecar.stats.reports_rejected == 0
