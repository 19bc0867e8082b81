"""`handoff demo`: a real coordinator on a free local port, and the simulator against it."""

from __future__ import annotations

import argparse
import asyncio
import sys

from handoff_client.client import HandoffClient
from handoff_client.sim import options
from handoff_client.sim.config import FaultProfile, LoadProfile, SimConfig
from handoff_client.sim.report import render
from handoff_client.sim.run import simulate
from handoff_client.sim.scrape import scrape
from handoff_server.app import Server
from handoff_server.config import Settings

# Handoffs that wait for a fact from the engine that died end at their
# deadline; a short one keeps the demo within the minute.
DEFAULTS = SimConfig(load=LoadProfile(handoff_timeout_s=10.0), faults=FaultProfile.demo())

# Short server timers, so that the demo's dead engine is noticed (delivery
# timeout), and its handoffs abandoned (cleanup timeout), within the minute.
SERVER_SETTINGS = Settings(
    host="127.0.0.1",
    port=0,
    metrics_host="127.0.0.1",
    metrics_port=0,
    delivery_timeout_s=2.0,
    cleanup_timeout_s=4.0,
    cleanup_redelivery_s=0.25,
    drain_grace_s=2.0,
)


def add_parser(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = commands.add_parser(
        "demo",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        help="start a local coordinator and run the simulator against it, with faults",
        description=(
            "Start a real coordinator on a free loopback port (with its metrics endpoint), "
            "run simulated vllm, sglang and trtllm engines against it with every fault on "
            "(failed actions, connection drops, a slow engine, an engine that dies, an engine "
            "that restarts under the same id, handlers that hang), show "
            "live progress, and end with a summary: counts by completion, latency, "
            "throughput, leaks and the server's own counters. Exits 0 only if nothing "
            "leaked and every handoff finished."
        ),
    )
    options.add_arguments(parser, DEFAULTS)
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    try:
        config = options.config_from(args, DEFAULTS)
    except ValueError as error:
        print(f"handoff demo: {error}", file=sys.stderr)
        return 2
    log_path = options.log_to_file(args.log_file)
    ok = asyncio.run(_demo(config))
    print(f"logs: {log_path}")
    return 0 if ok else 1


async def _demo(config: SimConfig) -> bool:
    server = Server(SERVER_SETTINGS)
    await server.start()
    try:
        print(
            f"coordinator on 127.0.0.1:{server.port}, metrics on "
            f"http://127.0.0.1:{server.metrics_port}/metrics; "
            f"{config.engine_count} simulated engines, {options.sidecars_on(config)}",
            flush=True,
        )
        async with HandoffClient(f"127.0.0.1:{server.port}") as client:
            result = await simulate(client, config, sys.stdout)
        metrics = await scrape(f"http://127.0.0.1:{server.metrics_port}/metrics")
    finally:
        await server.stop()
    print(render(result, metrics))
    return result.ok
