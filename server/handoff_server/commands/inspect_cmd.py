"""`handoff inspect ID --target HOST:PORT`: print one handoff in readable form.

The target may be any shard (or the Service in front of them): the SDK's
routing client asks the shard that owns the id, and the others if that one
does not know it (docs/sharding.md).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from datetime import UTC, datetime
from enum import Enum

from handoff_client import HandoffClient
from handoff_client.errors import HandoffRpcError, UnavailableError
from handoff_client.model import ActionKind, Handoff
from handoff_server.commands import caller_options


def add_parser(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = commands.add_parser(
        "inspect",
        help="show one handoff: phase, engines, outstanding actions, lifecycle",
        description="Fetch one handoff with GetHandoff, from the shard that owns it, and print it.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("handoff_id", metavar="ID", help="the handoff's UUID")
    parser.add_argument("--target", default="localhost:50051", help="server HOST:PORT")
    parser.add_argument("--timeout", type=float, default=5.0, help="RPC deadline, seconds")
    caller_options.add_arguments(parser, " with the `read` scope")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    try:
        handoff = asyncio.run(_fetch(args))
    except (OSError, ValueError) as error:  # unreadable TLS material or token file
        print(f"handoff inspect: {error}", file=sys.stderr)
        return 2
    except UnavailableError as error:
        hint = caller_options.transport_hint(str(error), bool(args.tls or args.tls_root_cert))
        print(f"handoff inspect: {error}{hint}", file=sys.stderr)
        return 1
    except HandoffRpcError as error:
        print(f"handoff inspect: {error}", file=sys.stderr)
        return 1
    print(render(handoff))
    return 0


async def _fetch(args: argparse.Namespace) -> Handoff:
    security = caller_options.security(args)
    client = HandoffClient(
        args.target,
        timeout_s=args.timeout,
        tls=security.tls or None,
        tls_root_cert=security.root_cert,
        tls_client_cert=security.client_cert,
        tls_client_key=security.client_key,
        token=security.token,
    )
    async with client:
        return await client.get_handoff(args.handoff_id)


def _name(value: Enum | None) -> str:
    return "-" if value is None else value.name.lower()


def _time(moment: datetime | None) -> str:
    if moment is None:
        return "-"
    return moment.astimezone(UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def render(handoff: Handoff) -> str:
    """A handoff as aligned text, lifecycle with offsets from the start."""
    lines = [
        f"handoff      {handoff.handoff_id}",
        f"order        {_name(handoff.order)}",
        f"phase        {_name(handoff.phase)}",
        f"completion   {_name(handoff.completion)}",
        f"source       {handoff.source_engine_id}",
        f"destination  {handoff.destination_engine_id}  "
        f"(transfer executed by {_name(handoff.transfer_executor)})",
        f"started      {_time(handoff.started_at)}",
        f"deadline     {_time(handoff.deadline)}",
    ]
    if handoff.completed_at is not None:
        lines.append(f"completed    {_time(handoff.completed_at)}")
    for reason in handoff.end_reasons:
        lines.append(f"ended        {reason.describe()}")
    if handoff.abandoned:
        lines.append("abandoned    still cleaning up after cleanup_timeout")
    lines.append("lifecycle")
    for event in handoff.lifecycle:
        started = handoff.started_at or event.at
        offset_ms = (event.at - started).total_seconds() * 1000
        lines.append(f"  +{offset_ms:10.1f} ms  {_name(event.kind)}")
    lines.append("outstanding" if handoff.outstanding_actions else "outstanding  none")
    for action in handoff.outstanding_actions:
        delay = (
            f" delay {action.delay_ms:.3f} ms" if action.kind is ActionKind.START_TRANSFER else ""
        )
        lines.append(f"  #{action.id} {_name(action.kind)} -> {action.engine_id}{delay}")
    return "\n".join(lines)
