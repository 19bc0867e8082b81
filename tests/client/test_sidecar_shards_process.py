"""SDK sidecars connected to every shard of three `handoff serve` processes (issue 13).

Each sidecar holds one link per shard (tests/service/test_shards_process.py's
processes, with state dirs and a shard map file); the engines count every
KV block they hold and every double free (tests/support/lease.py). Killing
one shard with -9 stops only its own handoffs, which finish from its journal
once it is back; a shard that comes back on a new address is followed there;
held ids the sidecar cannot attribute are asked of every shard and freed
only once none expects them held.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from handoff_client import (
    Completion,
    EngineSidecar,
    EngineType,
    Handoff,
    HandoffClient,
    Phase,
    Role,
)
from handoff_client.placement import place
from tests.service.test_shards_process import NAMES, RETRY, Shard, deployment, new_ids, restart
from tests.support.lease import BlockEngine, until
from tests.support.servers import FAST_RECONNECT
from tests.support.sidecar import DESTINATION, QUICK, SOURCE

TIMEOUT_S = 120


class Fleet:
    """A prefill and a decode engine, each behind a sidecar linked to every shard."""

    def __init__(self, client: HandoffClient) -> None:
        self.client = client
        self.prefill, self.decode = BlockEngine(), BlockEngine()
        self.p: EngineSidecar | None = None
        self.d: EngineSidecar | None = None

    @contextlib.asynccontextmanager
    async def sidecars(
        self, incarnations: tuple[str | None, str | None] = (None, None)
    ) -> AsyncIterator[tuple[EngineSidecar, EngineSidecar]]:
        p_inc, d_inc = incarnations
        async with (
            EngineSidecar(
                self.client, SOURCE, self.prefill, reconnect_backoff=QUICK, incarnation=p_inc
            ) as p,
            EngineSidecar(
                self.client, DESTINATION, self.decode, reconnect_backoff=QUICK, incarnation=d_inc
            ) as d,
        ):
            self.p, self.d = p, d
            yield p, d

    async def start(self, ids: list[str]) -> None:
        await asyncio.gather(
            *(
                self.client.start_handoff(
                    h,
                    engine_type=EngineType.VLLM,
                    source_engine_id=SOURCE,
                    destination_engine_id=DESTINATION,
                    transfer_executor=Role.DESTINATION,  # vLLM's decode pulls the KV
                )
                for h in ids
            )
        )

    async def held(self, ids: list[str]) -> None:
        """Until both engines hold a side of each (the decode stalled on its reservation)."""
        await until(
            lambda: all(
                (h, Role.SOURCE) in self.prefill.blocks
                and (h, Role.DESTINATION) in self.decode.blocks
                for h in ids
            )
        )

    async def reserved(self, ids: list[str]) -> None:
        """The stalled decode reports each reservation now: the handoffs go on."""
        assert self.d is not None
        await asyncio.gather(*(self.d.facts.destination_reserved(h, 512) for h in ids))

    async def succeeded(self, ids: list[str]) -> None:
        """Until each completed SUCCESS: the prefill released, the decode owns it."""
        await until(lambda: all((h, Role.SOURCE) in self.prefill.freed_at for h in ids))
        for h in ids:
            handoff = await self.client.get_handoff(h)
            assert handoff.phase is Phase.COMPLETE, h
            assert handoff.completion is Completion.SUCCESS, (h, handoff.completion)

    def no_leaks(self, decoding: list[str]) -> None:
        """Only the activated decodes hold; once they finish, nothing does."""
        assert self.prefill.held_blocks == 0, self.prefill.blocks
        assert set(self.decode.blocks) == {(h, Role.DESTINATION) for h in decoding}
        for h in decoding:
            self.decode.finish_decode(h)
        assert self.decode.held_blocks == 0
        assert self.prefill.double_frees == self.decode.double_frees == 0


@contextlib.asynccontextmanager
async def three(
    tmp: Path, delivery_timeout_s: float = Shard.delivery_timeout_s
) -> AsyncIterator[tuple[list[Shard], Fleet]]:
    async with deployment(tmp) as shards:
        for shard in shards:
            shard.delivery_timeout_s = delivery_timeout_s
        await restart(shards, count=3)
        async with HandoffClient(
            f"127.0.0.1:{shards[0].port}",
            timeout_s=5.0,
            retry=RETRY,
            channel_options=FAST_RECONNECT,
        ) as client:
            yield shards, Fleet(client)


async def ended(client: HandoffClient, handoff_id: str) -> Handoff:
    """The handoff once its shard says it is over: polled, a client has nothing to await."""
    while (handoff := await client.get_handoff(handoff_id)).phase is not Phase.COMPLETE:  # noqa: ASYNC110
        await asyncio.sleep(0.05)
    return handoff


def clean(sidecar: EngineSidecar) -> None:
    stats = sidecar.stats
    assert stats.reports_rejected == 0, stats
    assert stats.handler_errors == 0, stats
    assert stats.lease_expiries == 0, stats
    assert stats.orphans_reclaimed == 0, stats


@pytest.mark.timeout(300)
async def test_one_shard_killed_stops_only_its_handoffs_which_recover_from_its_journal(
    tmp_path: Path,
) -> None:
    rng = random.Random(31)
    async with three(tmp_path) as (shards, fleet), asyncio.timeout(TIMEOUT_S):
        async with fleet.sidecars() as (p, d):
            await p.wait_subscribed()
            await d.wait_subscribed()
            assert p.shards == d.shards == NAMES  # one link per shard
            fleet.decode.stall.add(Role.DESTINATION)
            ids = new_ids(45, rng)
            await fleet.start(ids)
            await fleet.held(ids)
            on_killed = [h for h in ids if place(h, NAMES) == "handoff-1"]
            elsewhere = [h for h in ids if h not in on_killed]
            assert on_killed
            assert elsewhere

            shards[1].kill()
            # The killed shard's reports wait for it (retried until they land);
            # the others' go on meanwhile, and new handoffs flow on too.
            late = asyncio.ensure_future(fleet.reserved(on_killed))
            await fleet.reserved(elsewhere)
            await fleet.succeeded(elsewhere)
            fleet.decode.stall.clear()
            fresh = [h for h in new_ids(30, rng) if place(h, NAMES) != "handoff-1"]
            await fleet.start(fresh)
            await fleet.succeeded(fresh)
            assert not late.done()

            shards[1].start(3)
            await shards[1].serving()
            await late
            await fleet.succeeded(on_killed)
            for sidecar in (p, d):
                clean(sidecar)
        fleet.no_leaks(ids + fresh)


@pytest.mark.timeout(300)
async def test_a_shard_that_stays_down_expires_only_its_own_links_lease(tmp_path: Path) -> None:
    """Delivery timeout 3 s (the lease is 2 s): handoff-1 killed and left down. Each
    sidecar's handoff-1 link frees that shard's held sides, and only those; the
    other links flow on. Back on its journal, handoff-1 hears what was freed
    and ends those handoffs CANCELED at once."""
    rng = random.Random(43)
    async with three(tmp_path, delivery_timeout_s=3.0) as (shards, fleet):
        async with fleet.sidecars() as (p, d), asyncio.timeout(TIMEOUT_S):
            await p.wait_subscribed()
            await d.wait_subscribed()
            fleet.decode.stall.add(Role.DESTINATION)
            ids = new_ids(45, rng)
            await fleet.start(ids)
            await fleet.held(ids)
            on_killed = [h for h in ids if place(h, NAMES) == "handoff-1"]
            elsewhere = [h for h in ids if h not in on_killed]

            shards[1].kill()
            await until(lambda: p.stats.lease_expiries == d.stats.lease_expiries == 1)
            await until(lambda: p.stats.freed_on_lease == d.stats.freed_on_lease == len(on_killed))
            freed = {h for h, _ in fleet.prefill.freed_at} | {h for h, _ in fleet.decode.freed_at}
            assert freed == set(on_killed)
            await fleet.reserved(elsewhere)
            await fleet.succeeded(elsewhere)
            assert p.stats.lease_expiries == d.stats.lease_expiries == 1  # the others' never

            shards[1].start(3)
            await shards[1].serving()
            for h in on_killed:
                assert (await ended(fleet.client, h)).completion is Completion.CANCELED, h
            for sidecar in (p, d):
                assert sidecar.stats.reports_rejected == 0
                assert sidecar.stats.handler_errors == 0
        fleet.no_leaks(elsewhere)


@pytest.mark.timeout(300)
async def test_sidecars_follow_a_shard_that_comes_back_on_a_new_address(tmp_path: Path) -> None:
    rng = random.Random(37)
    async with three(tmp_path) as (shards, fleet), asyncio.timeout(TIMEOUT_S):
        async with fleet.sidecars() as (p, d):
            await p.wait_subscribed()
            await d.wait_subscribed()
            fleet.decode.stall.add(Role.DESTINATION)
            before = [h for h in new_ids(60, rng) if place(h, NAMES) == "handoff-1"]
            await fleet.start(before)
            await fleet.held(before)

            # handoff-1's pod moves: killed, back on another port with its journal.
            shards[1].kill()
            moved = Shard(tmp_path, 1, shards[0].shard_map)
            moved.start(3)
            shards[1] = moved
            addresses = json.loads(moved.shard_map.read_text())
            addresses["handoff-1"] = f"127.0.0.1:{moved.port}"
            moved.shard_map.write_text(json.dumps(addresses))
            await moved.serving()

            await fleet.reserved(before)
            await fleet.succeeded(before)
            fleet.decode.stall.clear()
            after = [h for h in new_ids(60, rng) if place(h, NAMES) == "handoff-1"]
            await fleet.start(after)
            await fleet.succeeded(after)
            assert p.shards == d.shards == NAMES
            assert (await fleet.client.shard_map()).address("handoff-1") == addresses["handoff-1"]
            for sidecar in (p, d):
                clean(sidecar)
        fleet.no_leaks(before + after)


@pytest.mark.timeout(300)
async def test_unattributed_held_ids_are_freed_only_when_no_shard_expects_them(
    tmp_path: Path,
) -> None:
    """Sidecars restarted beside engines that survived (same incarnations): the
    engines list what they hold, not which shard it belongs to. Sides a shard
    still expects are kept (and finish there); sides no shard knows are freed,
    but only once every shard has answered: not while one shard is down."""
    rng = random.Random(41)
    incarnations = ("1700000000000-prefill", "1700000000000-decode")
    async with three(tmp_path) as (shards, fleet), asyncio.timeout(TIMEOUT_S):
        fleet.decode.stall.add(Role.DESTINATION)
        ids = new_ids(30, rng)
        async with fleet.sidecars(incarnations) as (p, d):
            await p.wait_subscribed()
            await d.wait_subscribed()
            await fleet.start(ids)
            await fleet.held(ids)
            await p.stop(grace_s=0)
            await d.stop(grace_s=0)

        # Held by the engines, known to no shard (their handoffs are long gone).
        unknown = new_ids(6, rng)
        for h in unknown:
            fleet.prefill.blocks[(h, Role.SOURCE)] = 8
            fleet.decode.blocks[(h, Role.DESTINATION)] = 8
        fleet.prefill.surviving = list(fleet.prefill.blocks)
        fleet.decode.surviving = list(fleet.decode.blocks)
        orphans = [(fleet.prefill, (h, Role.SOURCE)) for h in unknown] + [
            (fleet.decode, (h, Role.DESTINATION)) for h in unknown
        ]

        shards[2].kill()
        async with fleet.sidecars(incarnations) as (p, d):
            # The two shards that are up answer: neither expects the unknown
            # sides, but handoff-2 has not said so yet.
            await until(lambda: p.stats.reconciles >= 2 and d.stats.reconciles >= 2)
            assert all(side in engine.blocks for engine, side in orphans)
            assert not fleet.prefill.freed_at
            assert not fleet.decode.freed_at

            shards[2].start(3)
            await shards[2].serving()
            await until(lambda: all(side in engine.freed_at for engine, side in orphans))
            # Every side of a real handoff was kept: its shard expects it.
            for h in ids:
                assert (h, Role.SOURCE) in fleet.prefill.blocks
                assert (h, Role.DESTINATION) in fleet.decode.blocks
            assert p.stats.orphans_reclaimed == d.stats.orphans_reclaimed == len(unknown)

            fleet.decode.stall.clear()
            await fleet.reserved(ids)
            await fleet.succeeded(ids)
            assert p.stats.reports_rejected == d.stats.reports_rejected == 0
        fleet.no_leaks(ids)
