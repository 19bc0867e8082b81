"""The end-of-run check: every live pool full again, every handoff finished.

A handoff may end COMPLETE, or be abandoned by the server when one of its
engines died and can never acknowledge its cleanup (DESIGN.md §2, "cleanup
must finish"), or when a handler of its hung past the cleanup timeout (the
cancel waits for the handler it cancels; the hung handlers return when the
run is over, and the cancels then free their blocks). Abandonment is only
acceptable in those two cases; any other handoff the server dropped is a
failure, as is any handoff still unfinished and any block still held on a
live engine.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Sequence
from dataclasses import dataclass

from handoff_client.sim.cluster import Cluster
from handoff_client.sim.frontend import Journey


@dataclass(frozen=True, slots=True)
class PoolLeak:
    engine_id: str
    blocks: int
    holders: tuple[str, ...]  # handoff ids still holding blocks


@dataclass(frozen=True, slots=True)
class LeakCheck:
    pools_checked: int  # live engines; a dead engine's memory died with it
    leaks: tuple[PoolLeak, ...]
    stuck: tuple[Journey, ...]  # not finished when the run ended
    lost: tuple[Journey, ...]  # abandoned although both engines are alive
    abandoned_with_dead_engine: int
    abandoned_with_stuck_handler: int = 0

    @property
    def leaked_blocks(self) -> int:
        return sum(leak.blocks for leak in self.leaks)

    @property
    def ok(self) -> bool:
        return not (self.leaks or self.stuck or self.lost)


async def check_leaks(cluster: Cluster, journeys: Sequence[Journey], timeout_s: float) -> LeakCheck:
    live = [node for node in cluster.nodes if not node.engine.dead]
    cluster.unstick()
    # Decodes of successful handoffs hold their blocks until they finish; a
    # hung handler's blocks until the cancel that waited for it has run.
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(timeout_s):
            await asyncio.gather(*(node.engine.wait_stuck_freed() for node in live))
            await asyncio.gather(*(node.engine.wait_idle() for node in live))
    leaks = tuple(
        PoolLeak(node.engine_id, node.engine.pool.used, tuple(node.engine.pool.holders()))
        for node in live
        if node.engine.pool.used
    )
    dead, hung = cluster.dead_engine_ids, cluster.stuck_handoffs
    abandoned = [j for j in journeys if j.finished and j.final is None]
    with_dead = [j for j in abandoned if {j.source_engine_id, j.destination_engine_id} & dead]
    with_hung = [j for j in abandoned if j not in with_dead and j.handoff_id in hung]
    lost = tuple(j for j in abandoned if j not in with_dead and j not in with_hung)
    return LeakCheck(
        pools_checked=len(live),
        leaks=leaks,
        stuck=tuple(j for j in journeys if not j.finished),
        lost=lost,
        abandoned_with_dead_engine=len(with_dead),
        abandoned_with_stuck_handler=len(with_hung),
    )
