"""`handoff health` (the container's HEALTHCHECK) against a real gRPC health service."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from concurrent import futures

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from handoff_server.commands.cli import main

SERVICE = "handoff.v1.HandoffCoordinator"


@pytest.fixture
def health_server() -> Iterator[tuple[str, health.HealthServicer]]:
    servicer = health.HealthServicer()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield f"127.0.0.1:{port}", servicer
    finally:
        server.stop(grace=None)


def test_serving_exits_zero(
    health_server: tuple[str, health.HealthServicer], capsys: pytest.CaptureFixture[str]
) -> None:
    address, servicer = health_server
    servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    servicer.set(SERVICE, health_pb2.HealthCheckResponse.SERVING)
    assert main(["health", "--target", address]) == 0
    assert main(["health", "--target", address, "--service", SERVICE]) == 0
    out = capsys.readouterr().out
    assert f"{address} service '' is SERVING" in out
    assert f"{address} service '{SERVICE}' is SERVING" in out


@pytest.mark.parametrize(
    "status",
    [
        health_pb2.HealthCheckResponse.NOT_SERVING,
        health_pb2.HealthCheckResponse.UNKNOWN,
    ],
)
def test_anything_but_serving_exits_one(
    health_server: tuple[str, health.HealthServicer],
    capsys: pytest.CaptureFixture[str],
    status: int,
) -> None:
    address, servicer = health_server
    servicer.set(SERVICE, status)
    assert main(["health", "--target", address, "--service", SERVICE]) == 1
    name = health_pb2.HealthCheckResponse.ServingStatus.Name(status)
    assert capsys.readouterr().err == f"handoff health: {address} service '{SERVICE}' is {name}\n"


def test_draining_server_fails_the_check(
    health_server: tuple[str, health.HealthServicer], capsys: pytest.CaptureFixture[str]
) -> None:
    address, servicer = health_server
    servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    assert main(["health", "--target", address]) == 0
    servicer.enter_graceful_shutdown()  # what a server does on SIGTERM
    assert main(["health", "--target", address]) == 1
    assert "is NOT_SERVING" in capsys.readouterr().err


def test_unknown_service_exits_one(
    health_server: tuple[str, health.HealthServicer], capsys: pytest.CaptureFixture[str]
) -> None:
    address, _ = health_server
    assert main(["health", "--target", address, "--service", "no.such.Service"]) == 1
    assert "'no.such.Service' is not known to the server (NOT_FOUND)" in capsys.readouterr().err


def test_nothing_listening_exits_one(capsys: pytest.CaptureFixture[str]) -> None:
    with socket.socket() as sock:  # a port that was free a moment ago and is closed now
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    assert main(["health", "--target", f"127.0.0.1:{port}", "--timeout", "2"]) == 1
    assert "is unreachable (UNAVAILABLE" in capsys.readouterr().err


def test_a_silent_server_times_out(capsys: pytest.CaptureFixture[str]) -> None:
    with socket.socket() as sock:  # accepts TCP connections, never speaks HTTP/2
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        port = sock.getsockname()[1]
        assert main(["health", "--target", f"127.0.0.1:{port}", "--timeout", "0.3"]) == 1
    assert "no answer within 0.3 s (DEADLINE_EXCEEDED)" in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv",
    [
        ["health"],
        ["health", "--target", "localhost"],
        ["health", "--target", ":50051"],
        ["health", "--target", "localhost:http"],
        ["health", "--target", "localhost:70000"],
        ["health", "--target", "localhost:50051", "--timeout", "0"],
        ["health", "--target", "localhost:50051", "--timeout", "nan"],
    ],
)
def test_bad_arguments_are_usage_errors(argv: list[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
