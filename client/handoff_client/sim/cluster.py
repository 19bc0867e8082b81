"""The simulated fleet: per stack, prefill and decode engines, each behind its own sidecar.

Each engine's sidecar is the product's EngineSidecar given the routing
client, as a real engine's is: against a sharded coordinator it holds a link
per shard, each with its lease and reconcile. Injected connection drops wrap
each link's transport in a :class:`FlakyTransport`.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from handoff_client.client import HandoffClient
from handoff_client.model import EngineType, Role
from handoff_client.retry import Backoff
from handoff_client.sidecar import EngineSidecar, SidecarStats
from handoff_client.sim.config import SimConfig
from handoff_client.sim.engine import SimEngine
from handoff_client.sim.faults import FlakyTransport
from handoff_client.sim.pool import KvBlockPool
from handoff_client.sim.workload import RequestBook
from handoff_client.transport import LeasedTransport, SidecarTransport

# Simulated sidecars reconnect quickly: the demo's delivery timeout is short.
SIM_RECONNECT = Backoff(initial_s=0.02, max_s=0.5)


def sum_stats(stats: Sequence[SidecarStats]) -> SidecarStats:
    return SidecarStats(
        *(sum(getattr(s, f) for s in stats) for f in SidecarStats.__dataclass_fields__)
    )


@dataclass(slots=True)
class Node:
    """One engine, its sidecar, and its connections (flaky when drops are injected).

    A restart replaces them all: a new process under the same engine id.
    """

    stack: EngineType
    role: Role  # SOURCE: a prefill engine; DESTINATION: a decode engine
    engine: SimEngine
    sidecar: EngineSidecar
    # One per shard, made as the sidecar opens its links; none when no drops are injected.
    transports: list[FlakyTransport] = field(default_factory=list)

    @property
    def engine_id(self) -> str:
        return self.engine.engine_id


class Cluster:
    def __init__(
        self,
        client: HandoffClient,
        shard_count: int,
        config: SimConfig,
        book: RequestBook,
        on_complete: Callable[[str], None],
        rng: random.Random,
    ) -> None:
        """``client`` routes to the coordinator's ``shard_count`` shards (1: not sharded)."""
        self.nodes: list[Node] = []
        self._client = client
        self._shard_count = shard_count
        self._config = config
        self._book = book
        self._on_complete = on_complete
        self._rng = rng
        faults = config.faults
        for stack in config.load.stacks:
            for role, count in (
                (Role.SOURCE, config.prefill_engines),
                (Role.DESTINATION, config.decode_engines),
            ):
                for index in range(count):
                    kind = "prefill" if role is Role.SOURCE else "decode"
                    engine_id = f"{stack.name.lower()}-{kind}-{index}"
                    engine, sidecar, flaky = self._process(engine_id, role)
                    self.nodes.append(Node(stack, role, engine, sidecar, flaky))
        self._unroutable: set[str] = set()
        self._retired: list[SidecarStats] = []  # sidecars of restarted processes
        self._old_drops = self._old_failures = 0  # of restarted processes
        self.restarted: list[str] = []
        self.doomed = self._pick_doomed(faults.dead_engines, rng)
        healthy = [n for n in self.nodes if n not in self.doomed]
        slow = rng.sample(healthy, faults.slow_engines)
        for node in slow:
            node.engine.slowdown = faults.slow_factor
        # Prefill engines restart: a decode's handoffs are mostly complete
        # (the decode owns them), a prefill's are still under way.
        prefills = [n for n in healthy if n not in slow and n.role is Role.SOURCE]
        if faults.restarted_engines > len(prefills):
            raise ValueError(
                f"cannot restart {faults.restarted_engines} prefill engines: "
                f"{len(prefills)} neither die nor are slow"
            )
        self.to_restart = rng.sample(prefills, faults.restarted_engines)
        steady = [n for n in healthy if n not in self.to_restart]
        self.to_stick = rng.choice(steady) if faults.stuck_handlers and steady else None

    def _process(
        self, engine_id: str, role: Role
    ) -> tuple[SimEngine, EngineSidecar, list[FlakyTransport]]:
        """A new engine process: empty memory, a sidecar with a new incarnation."""
        config, rng = self._config, self._rng
        faults, profile = config.faults, config.engine
        blocks = profile.prefill_blocks if role is Role.SOURCE else profile.decode_blocks
        engine = SimEngine(
            engine_id,
            KvBlockPool(blocks, profile.block_size),
            self._book,
            profile,
            rng=random.Random(rng.random()),
            on_complete=self._on_complete,
            time_scale=config.time_scale,
            failure_rate=faults.action_failure_rate,
        )
        flaky: list[FlakyTransport] = []
        flaky_rng = random.Random(rng.random())

        def drop_now_and_then(shard: str, transport: SidecarTransport) -> SidecarTransport:
            if not isinstance(transport, LeasedTransport):
                raise TypeError(f"{engine_id}: the link to shard {shard} has no lease to keep")
            # Each of the engine's links drops as often as the engine's drop
            # rate shared out over them.
            wrapped = FlakyTransport(
                transport,
                mean_interval_s=faults.stream_drop_every_s * self._shard_count,
                blackout_s=faults.blackout_s,
                rng=random.Random(flaky_rng.random()),
            )
            flaky.append(wrapped)
            return wrapped

        sidecar = EngineSidecar(
            self._client,
            engine_id,
            engine,
            reconnect_backoff=SIM_RECONNECT,
            rng=random.Random(rng.random()),
            transport=config.transport,
            wrap_transport=drop_now_and_then if faults.stream_drop_every_s > 0 else None,
        )
        return engine, sidecar, flaky

    def _pick_doomed(self, count: int, rng: random.Random) -> list[Node]:
        """Engines that will die, chosen so every stack keeps one engine of each role."""
        doomed: list[Node] = []
        for node in rng.sample(self.nodes, len(self.nodes)):
            if len(doomed) == count:
                break
            peers = [n for n in self.nodes if (n.stack, n.role) == (node.stack, node.role)]
            if sum(1 for n in peers if n not in doomed) > 1:
                doomed.append(node)
        if len(doomed) < count:
            raise ValueError(
                f"cannot kill {count} engines and keep one of each role per stack alive"
            )
        return doomed

    async def start(self) -> None:
        for node in self.nodes:
            node.sidecar.start()
        await asyncio.gather(*(node.sidecar.wait_subscribed() for node in self.nodes))

    async def stop(self) -> None:
        await asyncio.gather(*(n.sidecar.stop() for n in self.nodes if not n.engine.dead))

    async def kill(self, node: Node, detection_s: float) -> None:
        """Kill ``node``; the router keeps sending it work until it notices, ``detection_s`` on."""
        node.engine.kill()
        await node.sidecar.stop(grace_s=0)
        await asyncio.sleep(detection_s)
        self._unroutable.add(node.engine_id)

    async def restart(self, node: Node) -> None:
        """``node``'s process dies and comes back at once under the same engine id.

        Its memory is gone with it: the blocks it held vanish (nothing to
        leak), and the new sidecar subscribes with a new incarnation, which
        tells the server that the old one is lost.
        """
        node.engine.kill()
        await node.sidecar.stop(grace_s=0)
        self._retired.append(node.sidecar.stats)
        self._old_drops += sum(transport.drops for transport in node.transports)
        self._old_failures += node.engine.injected_failures
        node.engine, node.sidecar, node.transports = self._process(node.engine_id, node.role)
        self.restarted.append(node.engine_id)
        node.sidecar.start()
        await node.sidecar.wait_subscribed()

    def stick(self) -> None:
        """Hang the next few prefills or reservations of the engine chosen for it."""
        if self.to_stick is not None:
            self.to_stick.engine.hang(self._config.faults.stuck_handlers)

    def unstick(self) -> None:
        """The run is over: hung handlers return, and the cancels waiting for them run."""
        for node in self.nodes:
            node.engine.unstick()

    @property
    def stuck_handoffs(self) -> frozenset[str]:
        return frozenset(h for node in self.nodes for h in node.engine.stuck)

    def routable(self, stack: EngineType, role: Role) -> list[Node]:
        """The engines the router believes alive, for one stack and role."""
        return [
            n
            for n in self.nodes
            if n.stack is stack and n.role is role and n.engine_id not in self._unroutable
        ]

    @property
    def dead_engine_ids(self) -> frozenset[str]:
        return frozenset(n.engine_id for n in self.nodes if n.engine.dead)

    def sidecar_totals(self) -> SidecarStats:
        return sum_stats([n.sidecar.stats for n in self.nodes] + self._retired)

    @property
    def stream_drops(self) -> int:
        live = sum(t.drops for n in self.nodes for t in n.transports)
        return live + self._old_drops

    @property
    def injected_failures(self) -> int:
        return sum(n.engine.injected_failures for n in self.nodes) + self._old_failures
