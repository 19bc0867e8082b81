"""`handoff sim`: simulated engines and load against a running coordinator."""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path

from handoff_client.client import HandoffClient
from handoff_client.sim import options
from handoff_client.sim.config import SimConfig
from handoff_client.sim.report import render
from handoff_client.sim.run import simulate
from handoff_client.sim.scrape import ServerMetrics, scrape

DEFAULTS = SimConfig()


def add_parser(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = commands.add_parser(
        "sim",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        help="run simulated engines and load against a coordinator",
        description=(
            "Start simulated prefill and decode engines (vllm, sglang and trtllm stacks, "
            "each engine with a finite KV block pool, each behind an EngineSidecar), play "
            "the frontend against the coordinator at --target, inject the faults asked "
            "for, and check at the end that every handoff finished and every KV pool is "
            "full again. Exits 0 only then."
        ),
    )
    parser.add_argument("--target", required=True, help="the coordinator, HOST:PORT")
    parser.add_argument(
        "--metrics-url",
        help="the coordinator's Prometheus endpoint; without it, http://HOST:9464/metrics",
    )
    parser.add_argument("--token", help="bearer token sent on every call")
    parser.add_argument("--tls-root-cert", type=Path, help="PEM file of the CA to trust")
    parser.add_argument("--tls-client-cert", type=Path, help="PEM client certificate (mTLS)")
    parser.add_argument("--tls-client-key", type=Path, help="PEM client key (mTLS)")
    options.add_arguments(parser, DEFAULTS)
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    try:
        config = options.config_from(args, DEFAULTS)
    except ValueError as error:
        print(f"handoff sim: {error}", file=sys.stderr)
        return 2
    log_path = options.log_to_file(args.log_file)
    host = args.target.rsplit(":", 1)[0]
    metrics_url = args.metrics_url or f"http://{host}:9464/metrics"
    try:
        ok = asyncio.run(_sim(args, config, metrics_url))
    except ConnectionError as error:
        print(f"handoff sim: {args.target}: {error}", file=sys.stderr)
        return 1
    finally:
        print(options.logs_line(log_path))
    return 0 if ok else 1


async def _sim(args: argparse.Namespace, config: SimConfig, metrics_url: str) -> bool:
    async with HandoffClient(
        args.target,
        token=args.token,
        tls_root_cert=args.tls_root_cert,
        tls_client_cert=args.tls_client_cert,
        tls_client_key=args.tls_client_key,
    ) as client:
        print(
            f"simulating against {args.target}: {config.engine_count} engines, "
            f"{options.sidecars_on(config)}",
            flush=True,
        )
        result = await simulate(client, config, sys.stdout)
    metrics: ServerMetrics | str
    try:
        metrics = await scrape(metrics_url)
    except OSError as error:
        metrics = f"{metrics_url}: {error}"
    print(render(result, metrics))
    return result.ok
