"""One simulation: fleet up, load, faults, settle, leak check, fleet down."""

from __future__ import annotations

import asyncio
import random
from collections import Counter
from dataclasses import dataclass, replace
from typing import TextIO

from handoff_client.client import HandoffClient
from handoff_client.sidecar import SidecarStats
from handoff_client.sim.cluster import Cluster
from handoff_client.sim.config import SimConfig
from handoff_client.sim.faults import CoordinatorCrash, CoordinatorCrasher
from handoff_client.sim.frontend import Counters, Frontend, Journey, Notices
from handoff_client.sim.leaks import LeakCheck, check_leaks
from handoff_client.sim.progress import Progress
from handoff_client.sim.workload import RequestBook

SUBSCRIBE_TIMEOUT_S = 10.0


@dataclass(frozen=True, slots=True)
class SimResult:
    journeys: tuple[Journey, ...]
    counters: Counters
    leaks: LeakCheck
    load_s: float  # how long handoffs were being started
    total_s: float  # load plus settling
    sidecars: SidecarStats  # summed over every engine
    stream_drops: int
    injected_failures: int
    killed: tuple[str, ...]
    slow: tuple[str, ...]
    restarted: tuple[str, ...] = ()
    stuck_handlers: int = 0  # handlers that hung until the run was over
    stuck_engine: str | None = None
    coordinator_crashes: tuple[CoordinatorCrash, ...] = ()
    # Against a sharded coordinator: handoffs started per shard, in ordinal order.
    handoffs_by_shard: tuple[tuple[str, int], ...] = ()

    @property
    def ok(self) -> bool:
        return self.counters.started > 0 and self.leaks.ok


async def simulate(
    client: HandoffClient,
    config: SimConfig,
    progress_to: TextIO | None = None,
    *,
    crasher: CoordinatorCrasher | None = None,
) -> SimResult:
    """Run ``config`` against the server behind ``client``, drawing progress on ``progress_to``.

    ``crasher`` crashes and restarts the coordinator, when the config's
    faults ask for coordinator crashes (it must be given then). Engines and
    frontend use ``client`` as the product does: against a sharded
    coordinator each engine's sidecar links to every shard, and the
    frontend's calls go where ``client`` routes them.
    Raises ConnectionError when the engines cannot subscribe to the server.
    """
    if config.faults.coordinator_crashes and crasher is None:
        raise ValueError(
            "coordinator crashes need the coordinator's process (handoff demo runs it)"
        )
    rng = random.Random(config.seed)
    book = RequestBook()
    notices = Notices()
    shard_map = await client.shard_map()
    shard_count = len(shard_map.shards)
    result = await _simulate(client, shard_count, config, progress_to, crasher, rng, book, notices)
    if shard_count == 1:
        return result
    # The shard that answered each start (the client remembers it).
    owners = Counter(client.owner_of(journey.handoff_id) for journey in result.journeys)
    return replace(result, handoffs_by_shard=tuple((n, owners[n]) for n in shard_map.names))


async def _simulate(
    client: HandoffClient,
    shard_count: int,
    config: SimConfig,
    progress_to: TextIO | None,
    crasher: CoordinatorCrasher | None,
    rng: random.Random,
    book: RequestBook,
    notices: Notices,
) -> SimResult:
    loop = asyncio.get_running_loop()
    cluster = Cluster(client, shard_count, config, book, notices.notify, rng)
    frontend = Frontend(client, cluster, book, notices, config, rng)
    progress = None
    if progress_to is not None:
        progress = Progress(
            progress_to,
            frontend.counters,
            duration_s=config.load.duration_s,
            max_handoffs=config.load.max_handoffs,
        )
    try:
        async with asyncio.timeout(SUBSCRIBE_TIMEOUT_S):
            await cluster.start()
    except TimeoutError:
        await cluster.stop()
        raise ConnectionError(
            f"the engines could not subscribe within {SUBSCRIBE_TIMEOUT_S:.0f} s"
        ) from None
    began = loop.time()
    background = [
        asyncio.create_task(_kill_doomed(cluster, config)),
        asyncio.create_task(_restart(cluster, config)),
        asyncio.create_task(_stick(cluster, config)),
    ]
    crashes: list[CoordinatorCrash] = []
    if crasher is not None:
        background.append(asyncio.create_task(_crash(crasher, config, frontend.counters, crashes)))
    if progress is not None:
        background.append(asyncio.create_task(progress.run()))
    try:
        load_s = await frontend.generate()
        if progress is not None:
            progress.stage = "settle"
        journeys = await frontend.settle(config.settle_timeout_s)
        leaks = await check_leaks(cluster, journeys, config.settle_timeout_s)
    finally:
        for task in background:
            task.cancel()
        ended = await asyncio.gather(*background, return_exceptions=True)
        await cluster.stop()
    # A fault that could not be injected (a coordinator that did not come
    # back) is no result: it is raised.
    for outcome in ended:
        if isinstance(outcome, Exception):
            raise outcome
    total_s = loop.time() - began
    if progress is not None:
        progress.finish(total_s)
    return SimResult(
        journeys=tuple(journeys),
        counters=frontend.counters,
        leaks=leaks,
        load_s=load_s,
        total_s=total_s,
        sidecars=cluster.sidecar_totals(),
        stream_drops=cluster.stream_drops,
        injected_failures=cluster.injected_failures,
        killed=tuple(sorted(cluster.dead_engine_ids)),
        slow=tuple(n.engine_id for n in cluster.nodes if n.engine.slowdown != 1.0),
        restarted=tuple(cluster.restarted),
        stuck_handlers=len(cluster.stuck_handoffs),
        stuck_engine=cluster.to_stick.engine_id if cluster.to_stick else None,
        coordinator_crashes=tuple(crashes),
    )


def _at(config: SimConfig, fraction: float) -> float:
    """Seconds into the load at ``fraction`` of it."""
    load = config.load
    # Count-bounded runs have no duration; estimate it from the rate.
    duration_s = load.duration_s if load.duration_s > 0 else load.max_handoffs / load.rate
    return fraction * duration_s


async def _kill_doomed(cluster: Cluster, config: SimConfig) -> None:
    if not cluster.doomed:
        return
    await asyncio.sleep(_at(config, config.faults.dead_at_fraction))
    await asyncio.gather(
        *(cluster.kill(node, config.faults.dead_detection_s) for node in cluster.doomed)
    )


async def _restart(cluster: Cluster, config: SimConfig) -> None:
    if not cluster.to_restart:
        return
    await asyncio.sleep(_at(config, config.faults.restart_at_fraction))
    await asyncio.gather(*(cluster.restart(node) for node in cluster.to_restart))


async def _stick(cluster: Cluster, config: SimConfig) -> None:
    if cluster.to_stick is None:
        return
    await asyncio.sleep(_at(config, config.faults.stuck_at_fraction))
    cluster.stick()


async def _crash(
    crasher: CoordinatorCrasher,
    config: SimConfig,
    counters: Counters,
    crashes: list[CoordinatorCrash],
) -> None:
    """Crash the coordinator ``coordinator_crashes`` times, the first at its fraction."""
    faults = config.faults
    loop = asyncio.get_running_loop()
    began = loop.time()
    first = faults.coordinator_crash_at_fraction
    step = (1.0 - first) / faults.coordinator_crashes if faults.coordinator_crashes else 0.0
    for index in range(faults.coordinator_crashes):
        at = began + _at(config, first + index * step)
        await asyncio.sleep(max(at - loop.time(), 0.0))
        in_flight = counters.in_flight
        crashes.append(replace(await crasher.crash(), in_flight=in_flight))
