"""`handoff inspect ID --target HOST:PORT`: print one handoff in readable form."""

from __future__ import annotations

import argparse
import asyncio
import sys
from datetime import UTC, datetime

import grpc
from google.protobuf.timestamp_pb2 import Timestamp

from handoff.v1 import coordinator_pb2 as pb
from handoff.v1 import coordinator_pb2_grpc as pb_grpc


def add_parser(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = commands.add_parser(
        "inspect",
        help="show one handoff: phase, engines, outstanding actions, lifecycle",
        description="Fetch one handoff with GetHandoff and print it.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("handoff_id", metavar="ID", help="the handoff's UUID")
    parser.add_argument("--target", default="localhost:50051", help="server HOST:PORT")
    parser.add_argument("--timeout", type=float, default=5.0, help="RPC deadline, seconds")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    try:
        handoff = asyncio.run(_fetch(args.target, args.handoff_id, args.timeout))
    except grpc.aio.AioRpcError as error:
        print(f"handoff inspect: {error.code().name}: {error.details()}", file=sys.stderr)
        return 1
    print(render(handoff))
    return 0


async def _fetch(target: str, handoff_id: str, deadline_s: float) -> pb.Handoff:
    async with grpc.aio.insecure_channel(target) as channel:
        stub = pb_grpc.HandoffCoordinatorStub(channel)
        response = await stub.GetHandoff(
            pb.GetHandoffRequest(handoff_id=handoff_id), timeout=deadline_s
        )
        return response.handoff


def _name(enum_name: str, prefix: str) -> str:
    return enum_name.removeprefix(prefix).lower()


def _time(stamp: Timestamp) -> str:
    moment = datetime.fromtimestamp(stamp.ToNanoseconds() / 1e9, tz=UTC)
    return moment.isoformat(timespec="milliseconds").replace("+00:00", "Z")


def render(handoff: pb.Handoff) -> str:
    """A handoff as aligned text, lifecycle with offsets from the start."""
    started = handoff.started_at.ToNanoseconds() / 1e9
    completion = (
        _name(pb.Completion.Name(handoff.completion), "COMPLETION_") if handoff.completion else "-"
    )
    executor = _name(pb.Role.Name(handoff.transfer_executor), "ROLE_")
    lines = [
        f"handoff      {handoff.handoff_id}",
        f"order        {_name(pb.HandoffOrder.Name(handoff.order), 'HANDOFF_ORDER_')}",
        f"phase        {_name(pb.Phase.Name(handoff.phase), 'PHASE_')}",
        f"completion   {completion}",
        f"source       {handoff.source_engine_id}",
        f"destination  {handoff.destination_engine_id}  (transfer executed by {executor})",
        f"started      {_time(handoff.started_at)}",
        f"deadline     {_time(handoff.deadline)}",
    ]
    if handoff.HasField("completed_at"):
        lines.append(f"completed    {_time(handoff.completed_at)}")
    lines.append("lifecycle")
    for event in handoff.lifecycle:
        offset_ms = (event.at.ToNanoseconds() / 1e9 - started) * 1000
        kind = _name(pb.LifecycleEventKind.Name(event.kind), "LIFECYCLE_EVENT_KIND_")
        lines.append(f"  +{offset_ms:10.1f} ms  {kind}")
    lines.append("outstanding" if handoff.outstanding_actions else "outstanding  none")
    for action in handoff.outstanding_actions:
        kind = _name(pb.ActionKind.Name(action.kind), "ACTION_KIND_")
        delay = (
            f" delay {action.delay_ms:.3f} ms"
            if action.kind == pb.ACTION_KIND_START_TRANSFER
            else ""
        )
        lines.append(f"  #{action.id} {kind} -> {action.engine_id}{delay}")
    return "\n".join(lines)
