"""`handoff health`: ask a running server's gRPC health service whether it is SERVING.

Used by the container's HEALTHCHECK and by operators. Exits 0 only when the
checked service reports SERVING, 1 otherwise (not serving, unknown service,
unreachable, timed out), with one line on stderr saying which. Exit code 2 is
left to argparse's usage errors; Docker reserves it, so a health check never
returns it for a server's state.
"""

from __future__ import annotations

import argparse
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from handoff_client.credentials import ChannelSecurity
from handoff_server.commands import caller_options

SERVING = 0
NOT_SERVING = 1


def target(value: str) -> str:
    """An argparse type: HOST:PORT, with a numeric port (IPv6 hosts in brackets)."""
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise argparse.ArgumentTypeError(f"expected HOST:PORT, got {value!r}")
    return value


def positive_seconds(value: str) -> float:
    seconds = float(value)
    if not seconds > 0 or seconds == float("inf"):
        raise argparse.ArgumentTypeError(f"expected a positive number of seconds, got {value!r}")
    return seconds


def add_parser(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = commands.add_parser(
        "health",
        help="check a running server through gRPC health (grpc.health.v1)",
        description=(
            "Call grpc.health.v1.Health/Check on TARGET. Exits 0 only when SERVICE "
            "is SERVING; otherwise prints why on stderr and exits 1."
        ),
    )
    parser.add_argument(
        "--target", required=True, type=target, metavar="HOST:PORT", help="the server's gRPC port"
    )
    parser.add_argument(
        "--service",
        default="",
        metavar="NAME",
        help="service to check, e.g. handoff.v1.HandoffCoordinator (default: the whole server)",
    )
    parser.add_argument(
        "--timeout",
        type=positive_seconds,
        default=5.0,
        metavar="S",
        help="give up after S seconds (default: 5)",
    )
    # Check is exempt from tokens by default (--auth-exempt-methods); a token
    # is for a server that exempts nothing.
    caller_options.add_arguments(parser, "")
    parser.set_defaults(run=run)


def open_channel(args: argparse.Namespace, security: ChannelSecurity) -> grpc.Channel:
    """The channel to the server, with the same TLS as `handoff inspect`."""
    credentials = security.channel_credentials()
    if credentials is None:
        return grpc.insecure_channel(args.target)
    return grpc.secure_channel(args.target, credentials)


def check(args: argparse.Namespace) -> tuple[int, str]:
    """Returns the exit code and the line that explains it."""
    what = f"{args.target} service {args.service!r}"
    try:
        security = caller_options.security(args)
    except (OSError, ValueError) as error:  # unreadable TLS material or token file
        return NOT_SERVING, f"cannot check {what}: {error}"
    with open_channel(args, security) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        request = health_pb2.HealthCheckRequest(service=args.service)
        try:
            response = stub.Check(request, timeout=args.timeout, metadata=security.metadata())
        except grpc.RpcError as error:
            code: grpc.StatusCode = error.code()
            details: str = error.details() or ""
            if code is grpc.StatusCode.NOT_FOUND:
                reason = "not known to the server (NOT_FOUND)"
            elif code is grpc.StatusCode.DEADLINE_EXCEEDED:
                reason = f"no answer within {args.timeout:g} s (DEADLINE_EXCEEDED)"
            elif code is grpc.StatusCode.UNAVAILABLE:
                hint = caller_options.transport_hint(details, security.tls)
                reason = f"unreachable (UNAVAILABLE: {details}){hint}"
            else:
                reason = f"health check failed ({code.name}: {details})"
            return NOT_SERVING, f"{what} is {reason}"
    status: str = health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)
    if response.status == health_pb2.HealthCheckResponse.SERVING:
        return SERVING, f"{what} is SERVING"
    return NOT_SERVING, f"{what} is {status}"


def run(args: argparse.Namespace) -> int:
    code, line = check(args)
    print(f"handoff health: {line}", file=sys.stdout if code == SERVING else sys.stderr)
    return code
