"""`handoff health` and `handoff inspect` share their TLS and token options, and
say what to change when the two ends disagree on TLS or on the token file."""

from __future__ import annotations

import asyncio
import sys
import uuid
from pathlib import Path

import pytest

from handoff_server.commands import caller_options, health
from handoff_server.commands.cli import build_parser
from tests.support.security import Pki, make_pki
from tests.support.servers import StartServer

TIMEOUT_S = 20.0
TOKEN = "caller-test-token-0123456789"


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"))


async def check(*argv: str) -> tuple[int, str]:
    args = build_parser().parse_args(["health", *argv, "--timeout=3"])
    return await asyncio.to_thread(health.check, args)


async def inspect(port: int, *options: str) -> tuple[int, str]:
    process = await asyncio.create_subprocess_exec(
        *(sys.executable, "-m", "handoff_server.commands.cli", "inspect", str(uuid.uuid4())),
        *(f"--target=127.0.0.1:{port}", "--timeout=3", *options),
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE,
    )
    _, err = await process.communicate()
    assert process.returncode is not None
    return process.returncode, err.decode()


def options_of(*argv: str) -> set[str]:
    parser = build_parser().parse_args(argv).command_parser
    return {option for action in parser._actions for option in action.option_strings}


def test_health_and_inspect_take_the_same_options() -> None:
    secure = {"--tls", "--tls-root-cert", "--tls-client-cert", "--tls-client-key", "--token-file"}
    assert secure <= options_of("health", "--target=localhost:1")
    assert secure <= options_of("inspect", str(uuid.uuid4()))


async def test_health_reaches_a_tls_server_that_exempts_nothing_from_tokens(
    start_server: StartServer, pki: Pki, tmp_path: Path
) -> None:
    server = await start_server(
        **pki.tls_settings(mutual=True), tokens=TOKEN, auth_exempt_methods=""
    )
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    target = f"--target=127.0.0.1:{server.port}"
    secure = (
        f"--tls-root-cert={pki.ca.cert_path}",
        f"--tls-client-cert={pki.client.cert_path}",
        f"--tls-client-key={pki.client.key_path}",
    )
    async with asyncio.timeout(TIMEOUT_S):
        assert await check(target, *secure, f"--token-file={token_file}") == (
            health.SERVING,
            f"127.0.0.1:{server.port} service '' is SERVING",
        )
        code, line = await check(target, *secure)
        assert (code, "UNAUTHENTICATED" in line) == (health.NOT_SERVING, True)


async def test_plaintext_against_tls_hints_at_the_tls_options(
    start_server: StartServer, pki: Pki
) -> None:
    server = await start_server(**pki.tls_settings(mutual=False))
    async with asyncio.timeout(TIMEOUT_S):
        code, line = await check(f"--target=127.0.0.1:{server.port}")
        assert code == health.NOT_SERVING
        assert "if the server speaks TLS, add --tls-root-cert" in line
        code, err = await inspect(server.port)
        assert code == 1
        assert "if the server speaks TLS, add --tls-root-cert" in err


async def test_tls_against_plaintext_hints_at_dropping_them(
    start_server: StartServer, pki: Pki
) -> None:
    server = await start_server()
    async with asyncio.timeout(TIMEOUT_S):
        code, line = await check(
            f"--target=127.0.0.1:{server.port}", f"--tls-root-cert={pki.ca.cert_path}"
        )
        assert code == health.NOT_SERVING
        assert "if the server is plaintext, drop --tls" in line
        code, err = await inspect(server.port, f"--tls-root-cert={pki.ca.cert_path}")
        assert code == 1
        assert "if the server is plaintext, drop --tls" in err


def test_the_servers_token_file_given_to_a_client_says_so(tmp_path: Path) -> None:
    token_file = tmp_path / "tokens"
    token_file.write_text(f"router {TOKEN} start,read\n")
    with pytest.raises(ValueError, match="looks like the server's token file") as refused:
        caller_options.read_token(str(token_file))
    assert f"--token-file {token_file}" in str(refused.value)
    token_file.write_text(f"{TOKEN}\n")
    assert caller_options.read_token(str(token_file)) == TOKEN
