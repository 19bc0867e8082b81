"""TLS and mutual TLS on a real server, with certificates made at test time."""

from __future__ import annotations

import asyncio
import dataclasses
import sys
import uuid
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from handoff_client import EngineType, HandoffClient, RetryPolicy
from handoff_client.errors import NotFoundError, UnavailableError
from handoff_proto.v1 import coordinator_pb2 as pb
from handoff_proto.v1 import coordinator_pb2_grpc as pb_grpc
from handoff_server.commands import health
from handoff_server.commands.cli import build_parser
from handoff_server.ops.config import Settings
from handoff_server.service.app import Server
from handoff_server.service.security import SecurityConfigError
from tests.support.security import Pki, TlsSettings, make_pki, secure_channel
from tests.support.servers import StartServer

TIMEOUT_S = 10.0
TOKEN = "tls-test-token-0123456789"


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"))


async def reaches_handler(channel: grpc.aio.Channel) -> bool:
    """True when a call gets through the transport to the coordinator (which
    answers NOT_FOUND for a random id); False when the transport refuses it."""
    stub = pb_grpc.HandoffCoordinatorStub(channel)
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await stub.GetHandoff(pb.GetHandoffRequest(handoff_id=str(uuid.uuid4())), timeout=5)
    code = refused.value.code()
    assert code in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.UNAVAILABLE), refused.value
    return code is grpc.StatusCode.NOT_FOUND


async def test_tls_server_refuses_plaintext_and_serves_tls(
    start_server: StartServer, pki: Pki
) -> None:
    server = await start_server(**pki.tls_settings(mutual=False))
    async with asyncio.timeout(TIMEOUT_S):
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as plaintext:
            assert not await reaches_handler(plaintext)
        async with secure_channel(server.port, pki.ca.cert) as tls:
            assert await reaches_handler(tls)
        # A client that does not trust the server's CA does not talk to it.
        async with secure_channel(server.port, pki.rogue_ca.cert) as untrusting:
            assert not await reaches_handler(untrusting)
    assert server.registry.handoffs == {}


async def test_mutual_tls_refuses_missing_and_foreign_client_certificates(
    start_server: StartServer, pki: Pki
) -> None:
    server = await start_server(**pki.tls_settings(mutual=True))
    async with asyncio.timeout(TIMEOUT_S):
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as plaintext:
            assert not await reaches_handler(plaintext)
        async with secure_channel(server.port, pki.ca.cert) as without_certificate:
            assert not await reaches_handler(without_certificate)
        async with secure_channel(server.port, pki.ca.cert, pki.rogue_client) as foreign:
            assert not await reaches_handler(foreign)
        async with secure_channel(server.port, pki.ca.cert, pki.client) as trusted:
            assert await reaches_handler(trusted)
            # Health is served on the same TLS port.
            health = health_pb2_grpc.HealthStub(trusted)
            answer = await health.Check(health_pb2.HealthCheckRequest())
            assert answer.status == health_pb2.HealthCheckResponse.SERVING


async def test_sdk_client_over_mutual_tls_with_a_token(start_server: StartServer, pki: Pki) -> None:
    server = await start_server(**pki.tls_settings(mutual=True), tokens=TOKEN)
    target = f"127.0.0.1:{server.port}"
    one_try = RetryPolicy(max_attempts=1)
    async with asyncio.timeout(TIMEOUT_S):
        async with HandoffClient(
            target,
            tls_root_cert=pki.ca.cert_path,
            tls_client_cert=pki.client.cert_path,
            tls_client_key=pki.client.key_path,
            token=TOKEN,
            retry=one_try,
        ) as client:
            with pytest.raises(NotFoundError):
                await client.get_handoff(str(uuid.uuid4()))
        async with HandoffClient(
            target, tls_root_cert=pki.ca.cert_path, token=TOKEN, retry=one_try
        ) as no_certificate:
            with pytest.raises(UnavailableError):
                await no_certificate.get_handoff(str(uuid.uuid4()))


def write(folder: Path, name: str, data: bytes) -> str:
    path = folder / name
    path.write_bytes(data)
    return str(path)


async def test_unusable_tls_material_stops_the_start(pki: Pki, tmp_path: Path) -> None:
    base = Settings(host="127.0.0.1", port=0, metrics_port=-1)
    other_key = pki.client.key_path
    cases: dict[str, tuple[TlsSettings, str]] = {
        "missing file": ({"tls_cert": str(tmp_path / "nope.pem")}, "nope.pem"),
        "key of another certificate": ({"tls_key": str(other_key)}, "tls_key"),
        "not PEM": ({"tls_cert": write(tmp_path, "junk.pem", b"junk")}, "junk.pem"),
        "client CA not PEM": (
            {"tls_client_ca": write(tmp_path, "ca-junk.pem", b"-----BEGIN nothing")},
            "ca-junk.pem",
        ),
    }
    for case, (override, named) in cases.items():
        settings = dataclasses.replace(base, **pki.tls_settings(mutual=True))
        settings = dataclasses.replace(settings, **override)
        server = Server(settings)
        with pytest.raises(SecurityConfigError, match=named):
            await server.start()
        assert server.port == 0, case  # nothing was bound


def test_tls_settings_that_cannot_work_are_refused() -> None:
    with pytest.raises(ValueError, match="tls_cert and tls_key go together"):
        Settings(tls_cert="cert.pem")
    with pytest.raises(ValueError, match="needs tls_cert"):
        Settings(tls_client_ca="ca.pem")
    with pytest.raises(ValueError, match="needs mutual TLS"):
        Settings(tls_cert="c", tls_key="k", engine_identity_file="ids.json")


async def test_a_plaintext_health_port_serves_probes_and_nothing_else(
    start_server: StartServer, pki: Pki
) -> None:
    server = await start_server(**pki.tls_settings(mutual=True), tokens=TOKEN, health_port=0)
    assert server.health_port not in (0, server.port)
    target = f"127.0.0.1:{server.health_port}"
    # What the container's HEALTHCHECK and an exec probe run: plaintext, no token.
    args = build_parser().parse_args(["health", "--target", target])
    assert await asyncio.to_thread(health.check, args) == (0, f"{target} service '' is SERVING")
    async with asyncio.timeout(TIMEOUT_S), grpc.aio.insecure_channel(target) as plaintext:
        stub = pb_grpc.HandoffCoordinatorStub(plaintext)
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await stub.GetHandoff(pb.GetHandoffRequest(handoff_id=str(uuid.uuid4())))
        assert refused.value.code() is grpc.StatusCode.UNIMPLEMENTED
        watch = health_pb2_grpc.HealthStub(plaintext).Watch(
            health_pb2.HealthCheckRequest(service="handoff.v1.HandoffCoordinator")
        )
        assert (await watch.read()).status == health_pb2.HealthCheckResponse.SERVING
        # Draining shows on the health port too, so readiness drops at once.
        stopping = asyncio.create_task(server.stop())
        assert (await watch.read()).status == health_pb2.HealthCheckResponse.NOT_SERVING
        await stopping


async def test_inspect_reaches_a_server_with_mutual_tls_and_a_token(
    start_server: StartServer, pki: Pki, tmp_path: Path
) -> None:
    server = await start_server(**pki.tls_settings(mutual=True), tokens=TOKEN)
    handoff_id = str(uuid.uuid4())
    async with HandoffClient(
        f"127.0.0.1:{server.port}",
        tls_root_cert=pki.ca.cert_path,
        tls_client_cert=pki.client.cert_path,
        tls_client_key=pki.client.key_path,
        token=TOKEN,
    ) as client:
        await client.start_handoff(
            handoff_id,
            engine_type=EngineType.VLLM,
            source_engine_id="prefill-0",
            destination_engine_id="decode-0",
        )
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    secure = [
        f"--tls-root-cert={pki.ca.cert_path}",
        f"--tls-client-cert={pki.client.cert_path}",
        f"--tls-client-key={pki.client.key_path}",
        f"--token-file={token_file}",
    ]

    async def inspect(*options: str) -> tuple[int, str, str]:
        process = await asyncio.create_subprocess_exec(
            *(sys.executable, "-m", "handoff_server.commands.cli", "inspect", handoff_id),
            *(f"--target=127.0.0.1:{server.port}", "--timeout=3", *options),
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        async with asyncio.timeout(TIMEOUT_S):
            out, err = await process.communicate()
        assert process.returncode is not None
        return process.returncode, out.decode(), err.decode()

    code, out, err = await inspect(*secure)
    assert code == 0, err
    assert f"handoff      {handoff_id}" in out
    code, _, err = await inspect(*secure[:3])  # no token
    assert code == 1
    assert "UNAUTHENTICATED" in err
    code, _, err = await inspect(*secure[:3], f"--token-file={tmp_path / 'missing'}")
    assert code == 2
    assert "missing" in err
