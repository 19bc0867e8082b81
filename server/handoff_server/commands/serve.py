"""`handoff serve`: run the coordinator until SIGTERM or SIGINT, then drain and exit 0.

Another process holding the journal's write lock past
--journal-busy-timeout-s drains the server the same way, and it then exits 1
(docs/durability.md). A second SIGTERM or SIGINT during the drain (Ctrl-C again, or an impatient
supervisor) exits at once with 128 + the signal's number, as a shell reports
a process the signal killed; unfinished handoffs are left to the engines'
own timeouts.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import logging
import os
import signal
import sys
from collections.abc import Callable

from handoff_server.durability.journal import JournalError
from handoff_server.ops import config, logs
from handoff_server.service.app import Server
from handoff_server.service.shards import ShardIdentity, ShardSettingsError, hostname

log = logging.getLogger("handoff.serve")
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


def add_parser(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = commands.add_parser(
        "serve",
        help="run the coordinator gRPC service",
        description=(
            "Run the handoff coordinator: gRPC (with health and reflection) plus a "
            "Prometheus /metrics endpoint. Every setting is a flag or a HANDOFF_* "
            "environment variable; flags win. On SIGTERM or SIGINT the server reports "
            "NOT_SERVING, refuses new handoffs, waits up to --drain-grace-s for active "
            "ones, cancels the rest, waits for their cleanup, and exits 0. With --state-dir "
            "every accepted call is journaled first, and a restart on the same directory "
            "recovers the handoffs (docs/durability.md)."
        ),
    )
    config.add_arguments(parser)
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    try:
        settings = config.from_arguments(args)
        shard = ShardIdentity.resolve(settings, hostname())
    except ValueError as error:
        print(f"handoff serve: {error}", file=sys.stderr)
        return 2
    logs.configure(settings.log_format, settings.log_level, capture_native=True)
    for variable in config.service_links():
        log.warning(
            "ignoring %s: its value looks like a Kubernetes service link (tcp://...) for a "
            "Service named 'handoff', not a setting; set enableServiceLinks: false in the pod",
            variable,
        )
    try:
        with asyncio.Runner(loop_factory=loop_factory(settings.event_loop)) as runner:
            return runner.run(_serve(settings, shard))
    except (JournalError, ShardSettingsError) as error:
        log.error("cannot start: %s", error)
        return 2
    except OSError as error:
        log.error("cannot start: %s", error)
        return 1


def loop_factory(name: str) -> Callable[[], asyncio.AbstractEventLoop] | None:
    """The event loop `--event-loop` names; None is asyncio's own."""
    if name == "uvloop":
        import uvloop  # imported only when asked for

        return uvloop.new_event_loop
    return None


async def _serve(settings: config.Settings, shard: ShardIdentity) -> int:
    # What is loaded by now (modules, gRPC, protobuf's descriptors) lives as
    # long as the process: the cyclic collector's full collections need not
    # walk it again each time, and each is a pause of the loop that every
    # handoff waits out (bench/RESULTS.md).
    gc.freeze()
    server = Server(settings, shard=shard)
    await server.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in STOP_SIGNALS:
        loop.add_signal_handler(signum, stop.set)
    waits = [asyncio.create_task(event.wait()) for event in (stop, server.failed, server.held)]
    await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    for wait in waits:
        wait.cancel()
    if server.failed.is_set():
        # Nothing more can be made durable, so nothing more may be answered:
        # exit at once, as a crash would; a restart recovers what was committed.
        log.critical("the journal failed; exiting without draining")
        return 1
    held = server.held.is_set()  # the journal said by whom, and that it drains
    if not held:
        log.info("signal received; shutting down")
    for signum in STOP_SIGNALS:
        loop.add_signal_handler(signum, _exit_now, signum, server)
    await server.stop()
    return 1 if held else 0


def _exit_now(signum: int, server: Server) -> None:
    log.error(
        "%s again during the drain: exiting now, %d handoffs unfinished",
        signal.Signals(signum).name,
        server.registry.active_count,
    )
    logging.shutdown()
    os._exit(128 + signum)
