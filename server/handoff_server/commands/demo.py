"""`handoff demo`: a coordinator process on a free local port, and the simulator against it.

The coordinator is a `handoff serve` process of its own, journaling to a
state dir in a temporary directory (coordinators.py), so the demo can crash
it for real: the "coordinator crash" fault kills it with SIGKILL mid-run and
restarts it on the same port and state dir, and the engines and the frontend
ride through. The temporary directory (state dir and the coordinator's log)
is removed after a PASS and kept, and named, otherwise.

``--shards N`` runs N coordinator processes instead, the shards of one
coordinator (docs/sharding.md): each with its own state dir, all sharing a
shard map file written once their ports are known. The frontend routes by
owner, every engine is connected to every shard, and the crash fault kills
one shard (the second) and restarts it while the others serve on.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

from handoff_client.client import HandoffClient
from handoff_client.sim import options
from handoff_client.sim.config import FaultProfile, LoadProfile, SimConfig
from handoff_client.sim.faults import CoordinatorCrash
from handoff_client.sim.report import render
from handoff_client.sim.run import simulate
from handoff_client.sim.scrape import ServerMetrics, fetch, parse, scrape
from handoff_server.commands.coordinators import CoordinatorError, CoordinatorProcess, coordinators
from handoff_server.ops.config import Settings

# Handoffs that wait for a fact from the engine that died end at their
# deadline; a short one keeps the demo within the minute.
DEFAULTS = SimConfig(load=LoadProfile(handoff_timeout_s=10.0), faults=FaultProfile.demo())

# Short server timers, so that the demo's dead engine is noticed (delivery
# timeout), and its handoffs abandoned (cleanup timeout), within the minute.
# The cleanup timeout outlasts the coordinator's restart (seconds on a busy
# machine): deadlines keep running while it is down, and a cleanup whose
# timeout passed meanwhile is abandoned the moment it recovers, before its
# engines could acknowledge. (Host, ports and state dir are the
# coordinator process's: coordinators.py.)
SERVER_SETTINGS = Settings(
    delivery_timeout_s=2.0,
    cleanup_timeout_s=10.0,
    cleanup_redelivery_s=0.25,
    drain_grace_s=2.0,
)

SHARD_PREFIX = "handoff"  # shard names handoff-0 ..., whatever this machine's hostname
MAX_SHARDS = 8


def add_parser(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = commands.add_parser(
        "demo",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        help="start a local coordinator and run the simulator against it, with faults",
        description=(
            "Start a coordinator (a `handoff serve` process with a journal in a temporary "
            "state dir) on a free loopback port, with its metrics endpoint, run simulated "
            "vllm, sglang and trtllm engines against it with every fault on (failed actions, "
            "connection drops, a slow engine, an engine that dies, an engine that restarts "
            "under the same id, handlers that hang, and the coordinator killed with SIGKILL "
            "mid-run and restarted on its state dir), show "
            "live progress, and end with a summary: counts by completion, latency, "
            "throughput, leaks and the server's own counters. Exits 0 only if nothing "
            "leaked and every handoff finished."
        ),
    )
    options.add_arguments(parser, DEFAULTS, own_coordinator=True)
    parser.add_argument(
        "--shards",
        type=int,
        default=1,
        help="coordinator shards, each its own process with its own state dir; the crash "
        "fault kills one of them (the second)",
    )
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    try:
        config = options.config_from(args, DEFAULTS)
    except ValueError as error:
        print(f"handoff demo: {error}", file=sys.stderr)
        return 2
    if not 1 <= args.shards <= MAX_SHARDS:
        print(f"handoff demo: --shards must be 1 to {MAX_SHARDS}", file=sys.stderr)
        return 2
    log_path = options.log_to_file(args.log_file)
    try:
        ok = asyncio.run(_demo(config, args.shards))
    except CoordinatorError as error:
        print(f"handoff demo: {error}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("handoff demo: interrupted; the coordinator is stopped", file=sys.stderr)
        return 128 + signal.SIGINT
    except asyncio.CancelledError:  # SIGTERM (see _demo)
        print("handoff demo: terminated; the coordinator is stopped", file=sys.stderr)
        return 128 + signal.SIGTERM
    finally:
        print(options.logs_line(log_path))
    return 0 if ok else 1


def shard_settings(count: int, shard_map: Path) -> list[Settings]:
    """Each shard's settings: the demo's, with its identity; one shard: the demo's alone."""
    if count == 1:
        return [SERVER_SETTINGS]
    return [
        replace(
            SERVER_SETTINGS,
            shard_count=count,
            shard_ordinal=ordinal,
            shard_name_prefix=SHARD_PREFIX,
            shard_map=str(shard_map),
        )
        for ordinal in range(count)
    ]


def write_shard_map(path: Path, shards: Sequence[CoordinatorProcess]) -> None:
    """Every shard's address, by name; replaced whole, so a shard never reads half of it."""
    addresses = {f"{SHARD_PREFIX}-{k}": shard.address for k, shard in enumerate(shards)}
    partial = path.with_suffix(".partial")
    partial.write_text(json.dumps(addresses), encoding="utf-8")
    partial.replace(path)


async def _demo(config: SimConfig, shards: int = 1) -> bool:
    # SIGTERM ends the demo as Ctrl-C does (asyncio.run handles that one):
    # the main task is cancelled, so the coordinator is stopped on the way out.
    main = asyncio.current_task()
    assert main is not None
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, main.cancel)
    directory = Path(tempfile.mkdtemp(prefix="handoff-demo-"))
    shard_map = directory / "shards.json"
    # A shard reads its map file at start; the addresses come once all serve.
    shard_map.write_text("{}", encoding="utf-8")
    ok = False
    try:
        async with coordinators(shard_settings(shards, shard_map), directory) as running:
            if shards > 1:
                write_shard_map(shard_map, running)
            engines = f"{config.engine_count} simulated engines, {options.sidecars_on(config)}"
            if shards == 1:
                (coordinator,) = running
                print(f"{_where(coordinator)}; {engines}", flush=True)
            else:
                for ordinal, coordinator in enumerate(running):
                    print(f"shard {SHARD_PREFIX}-{ordinal}: {_where(coordinator)}")
                print(f"{engines}, each connected to all {shards} shards", flush=True)
            # The second shard is the one that crashes: the client's first
            # address (the first shard) stays up, as a Service would.
            victim = 1 % shards
            crasher = Crasher(running[victim], f"{SHARD_PREFIX}-{victim}" if shards > 1 else "")
            # The SDK's default retries ride through the coordinator's restart.
            async with HandoffClient(running[0].address) as client:
                result = await simulate(
                    client,
                    config,
                    sys.stdout,
                    crasher=crasher if config.faults.coordinator_crashes else None,
                )
            metrics = [
                (await scrape(c.metrics_url)).after(crasher.earlier if k == victim else ())
                for k, c in enumerate(running)
            ]
        print(render(result, metrics))
        ok = result.ok
    finally:
        if ok:
            shutil.rmtree(directory, ignore_errors=True)
        else:
            print(f"coordinator log and state dir kept in {directory}")
    return ok


def _where(coordinator: CoordinatorProcess) -> str:
    return (
        f"coordinator pid {coordinator.pid} on {coordinator.address}, metrics on "
        f"{coordinator.metrics_url}, journal in {coordinator.state_dir}"
    )


class Crasher:
    """Crashes the demo's coordinator (one shard) when the simulator says: kill -9, restart,
    recover."""

    def __init__(self, coordinator: CoordinatorProcess, shard: str = "") -> None:
        self._coordinator = coordinator
        self._shard = shard  # its name, when sharded
        # Each killed process's counters, scraped just before its kill.
        self.earlier: list[ServerMetrics] = []

    async def crash(self) -> CoordinatorCrash:
        coordinator = self._coordinator
        pid = coordinator.pid
        if pid is None:
            raise CoordinatorError(f"{coordinator.name} is not running: nothing to crash")

        def last_scrape_then_kill() -> tuple[str, float, float]:
            # SIGKILL from this thread the moment the scrape is in: a hop back
            # to the busy event loop would let the process count on unseen.
            began = time.monotonic()
            text = fetch(coordinator.metrics_url)
            os.kill(pid, signal.SIGKILL)
            killed_at = time.monotonic()
            return text, killed_at - began, killed_at

        text, scraped_before_s, killed_at = await asyncio.to_thread(last_scrape_then_kill)
        self.earlier.append(parse(text))
        await coordinator.kill()  # reaps it
        await coordinator.start()
        restarted_in_s = time.monotonic() - killed_at
        now = await scrape(coordinator.metrics_url)
        assert coordinator.pid is not None
        return CoordinatorCrash(
            killed_pid=pid,
            scraped_before_s=scraped_before_s,
            pid=coordinator.pid,
            restarted_in_s=restarted_in_s,
            recovered=round(now.latest("handoff_recovered_handoffs")),
            recovery_s=now.latest("handoff_recovery_seconds"),
            shard=self._shard,
        )
