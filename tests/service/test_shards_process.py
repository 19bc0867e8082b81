"""Real `handoff serve` shards with state dirs: ownership survives a change of shard count.

Two shards start handoffs; both are killed with -9 and come back as three
(the same state dirs, and a new third shard); later all three come back with
the third draining (--placing-shards 2). Through both changes every
in-flight handoff is finished where it started, a retried start is answered
by its owner as already started, no report is refused, and new handoffs go
only where the current placement puts them (a frontend still on the old map
is redirected once, by the shard it asked). And one of three shards killed
with -9 stops only its own handoffs, which finish once it is back.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import subprocess
import sys
import urllib.request
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest

from handoff_client import APPLIED, SUBMITTED, ActionKind, HandoffClient, Order
from handoff_client.errors import NotFoundError
from handoff_client.model import Completion, Phase
from handoff_client.placement import place
from handoff_client.retry import Backoff, RetryPolicy
from handoff_proto.v1 import coordinator_pb2 as pb
from handoff_proto.v1 import coordinator_pb2_grpc as pb_grpc
from tests.support.fakes import free_port
from tests.support.servers import FAST_RECONNECT

ROOT = Path(__file__).resolve().parents[2]
NAMES = ("handoff-0", "handoff-1", "handoff-2")
TIMEOUT_S = 120
RETRY = RetryPolicy(max_attempts=60, backoff=Backoff(initial_s=0.05, max_s=0.5))


class Shard:
    """One `handoff serve` process for shard ``ordinal``: its ports and state dir are its own."""

    # No engine subscribes in these tests: they must not be declared lost.
    delivery_timeout_s = 600.0

    def __init__(self, tmp: Path, ordinal: int, shard_map: Path) -> None:
        self.ordinal = ordinal
        self.port, self.metrics_port = free_port(), free_port()
        self.state_dir = tmp / f"state-{ordinal}"
        self.log = tmp / f"shard-{ordinal}.log"
        self.shard_map = shard_map
        self.process: subprocess.Popen[bytes] | None = None

    def start(self, count: int, placing: int = 0) -> None:
        self.process = subprocess.Popen(
            [
                *(sys.executable, "-m", "handoff_server.commands.cli", "serve"),
                *("--host", "127.0.0.1", "--port", str(self.port)),
                *("--metrics-host", "127.0.0.1", "--metrics-port", str(self.metrics_port)),
                *("--state-dir", str(self.state_dir), "--shard-map", str(self.shard_map)),
                *("--shard-count", str(count), "--shard-ordinal", str(self.ordinal)),
                *("--shard-name-prefix", "handoff"),  # not this machine's hostname
                *("--placing-shards", str(placing)),
                *("--delivery-timeout-s", str(self.delivery_timeout_s)),
            ],
            cwd=ROOT,
            stdout=self.log.open("ab"),
            stderr=subprocess.STDOUT,
        )

    def kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait(timeout=30)

    async def serving(self) -> None:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{self.port}") as channel:
            stub = pb_grpc.HandoffCoordinatorStub(channel)
            await stub.GetShardMap(pb.GetShardMapRequest(), timeout=60, wait_for_ready=True)

    def misrouted(self) -> float:
        url = f"http://127.0.0.1:{self.metrics_port}/metrics"
        with urllib.request.urlopen(url, timeout=10) as page:
            text: str = page.read().decode()
        line = next(x for x in text.splitlines() if x.startswith("handoff_misrouted_starts_total"))
        return float(line.split()[1])


@contextlib.asynccontextmanager
async def deployment(tmp: Path) -> AsyncIterator[list[Shard]]:
    shard_map = tmp / "shards.json"
    shards = [Shard(tmp, ordinal, shard_map) for ordinal in range(3)]
    shard_map.write_text(
        json.dumps({n: f"127.0.0.1:{s.port}" for n, s in zip(NAMES, shards, strict=True)})
    )
    try:
        yield shards
    finally:
        for shard in shards:
            shard.kill()


async def restart(shards: list[Shard], count: int, placing: int = 0) -> None:
    for shard in shards:
        shard.kill()
    for shard in shards[:count]:
        shard.start(count, placing)
    await asyncio.gather(*(shard.serving() for shard in shards[:count]))


def new_ids(count: int, rng: random.Random) -> list[str]:
    return [str(uuid.UUID(int=rng.getrandbits(128), version=4)) for _ in range(count)]


async def start_all(client: HandoffClient, ids: list[str]) -> list[bool]:
    updates = await asyncio.gather(
        *(
            client.start_handoff(
                h,
                source_engine_id="prefill-0",
                destination_engine_id="decode-0",
                order=Order.SOURCE_FIRST,
            )
            for h in ids
        )
    )
    return [update.already_started for update in updates]


async def finish(client: HandoffClient, handoff_id: str) -> None:
    """SubmitPrefill acknowledged, then canceled: the source's cleanup applied ends it."""
    await client.report_outcome(handoff_id, 0, SUBMITTED)
    canceled = await client.cancel(handoff_id, "test over")
    (cancel_source,) = (a for a in canceled.actions if a.kind is ActionKind.CANCEL_SOURCE)
    done = await client.report_outcome(handoff_id, cancel_source.id, APPLIED)
    assert done.handoff.phase is Phase.COMPLETE
    assert done.handoff.completion is Completion.CANCELED


async def held_by(client: HandoffClient, handoff_id: str) -> str:
    """Which shard holds ``handoff_id``: asked of each shard alone."""
    shard_map = await client.shard_map()
    for name in shard_map.names:
        bound = client.for_shard(name)
        try:
            await bound.get_handoff(handoff_id)
            return name
        except NotFoundError:
            continue
        finally:
            await bound.close()
    raise AssertionError(f"no shard holds {handoff_id}")


@pytest.mark.timeout(300)
async def test_ownership_is_sticky_when_the_shard_count_and_placing_change(tmp_path: Path) -> None:
    rng = random.Random(13)
    async with deployment(tmp_path) as shards:
        await restart(shards, count=2)
        seed = f"127.0.0.1:{shards[0].port}"
        async with (
            HandoffClient(seed, retry=RETRY, channel_options=FAST_RECONNECT) as frontend,
            asyncio.timeout(TIMEOUT_S),
        ):
            # Two shards: handoffs in flight on both.
            first = new_ids(40, rng)
            assert not any(await start_all(frontend, first))
            owners = {h: place(h, NAMES[:2]) for h in first}
            assert {frontend.owner_of(h) for h in first} == set(NAMES[:2])
            assert all(frontend.owner_of(h) == owners[h] for h in first)

            # Killed and back as three: a third shard places new handoffs.
            await restart(shards, count=3)
            moved = [h for h in first if place(h, NAMES) != owners[h]]
            assert moved, "some ids would be placed elsewhere now"
            # Retried starts go where the first attempt went, and are answered there.
            assert all(await start_all(frontend, first))
            # The frontend may still route on the two-shard map (refreshed every
            # 10 s): the first new id that handoff-2 wins is then refused as
            # misrouted, naming handoff-2; the frontend learns the map and
            # follows. One at a time, so that at most one is.
            second = new_ids(30, rng)
            for h in second:
                assert not any(await start_all(frontend, [h]))
            assert (await frontend.shard_map()).names == NAMES
            assert all(frontend.owner_of(h) == place(h, NAMES) for h in second)

            async with HandoffClient(seed, retry=RETRY) as other:
                # A client that started none of them finds each on its owner.
                for h in first:
                    await finish(other, h)
                    assert await held_by(other, h) == owners[h]

            # All three back with handoff-2 draining: it gets nothing new and
            # serves what it owns.
            await restart(shards, count=3, placing=2)
            third = new_ids(30, rng)
            async with HandoffClient(seed, retry=RETRY) as other:
                assert [s.placing for s in (await other.shard_map()).shards] == [True, True, False]
                assert not any(await start_all(other, third))
                assert {other.owner_of(h) for h in third} <= set(NAMES[:2])
                for h in second:
                    await finish(other, h)
                    assert await held_by(other, h) == place(h, NAMES)
                for h in third:
                    assert await held_by(other, h) == place(h, NAMES[:2])
        assert sum(shard.misrouted() for shard in shards) <= 1


@pytest.mark.timeout(300)
async def test_one_shard_killed_leaves_the_others_flowing_and_recovers_its_own(
    tmp_path: Path,
) -> None:
    """kill -9 of handoff-1: the other shards' handoffs finish meanwhile, with no
    error; handoff-1 comes back on its state dir and its handoffs finish too."""
    rng = random.Random(21)
    async with deployment(tmp_path) as shards:
        await restart(shards, count=3)
        async with (
            HandoffClient(f"127.0.0.1:{shards[0].port}", retry=RETRY) as frontend,
            asyncio.timeout(TIMEOUT_S),
        ):
            ids = new_ids(45, rng)
            await start_all(frontend, ids)
            on_killed = [h for h in ids if place(h, NAMES) == "handoff-1"]
            elsewhere = [h for h in ids if h not in on_killed]
            assert on_killed
            assert elsewhere
            shards[1].kill()
            await asyncio.gather(*(finish(frontend, h) for h in elsewhere))
            started = new_ids(30, rng)
            placed_alive = [h for h in started if place(h, NAMES) != "handoff-1"]
            assert not any(await start_all(frontend, placed_alive))
            shards[1].start(3)
            await shards[1].serving()
            await asyncio.gather(*(finish(frontend, h) for h in on_killed))
        assert sum(shard.misrouted() for shard in shards) == 0
