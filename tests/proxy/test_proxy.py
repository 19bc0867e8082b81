"""`handoff proxy` end to end: a real coordinator, stand-in engines (tests/support/proxy.py:
vLLM's two P/D legs over HTTP, reporting as real SDK engines; not vLLM, which
`make test-vllm` runs), and the proxy in between, all on loopback."""

from __future__ import annotations

import asyncio
import json
import logging
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from hypothesis import given
from hypothesis import strategies as st

import handoff_proxy
from handoff_client import Completion, HandoffClient
from handoff_proxy.config import EngineAddress
from handoff_proxy.flow import Endpoint
from handoff_proxy.pairs import Lease, NoEngineError, Pool
from handoff_server.commands.cli import main
from handoff_server.service.app import Server
from tests.support.fakes import free_port
from tests.support.proxy import TIMEOUT_S, rig, sse_events, standins
from tests.support.security import make_pki
from tests.support.servers import StartServer

PROMPT = {"model": "tiny", "prompt": "The KV moves", "max_tokens": 8, "temperature": 0}
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8}


def coordinator(server: Server) -> str:
    return f"127.0.0.1:{server.port}"


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as session:
        yield session


def request_for(endpoint: Endpoint, stream: bool) -> dict[str, Any]:
    body = dict(PROMPT if endpoint is Endpoint.COMPLETIONS else CHAT)
    if stream:
        body["stream"] = True
        body["stream_options"] = {"include_usage": True}
    return body


def text_of(endpoint: Endpoint, answer: dict[str, Any]) -> str:
    choice = answer["choices"][0]
    return str(choice["text"] if endpoint is Endpoint.COMPLETIONS else choice["message"]["content"])


def streamed_text(endpoint: Endpoint, events: list[Any]) -> str:
    parts = []
    for event in events:
        if event == "[DONE]":
            continue
        choice = event["choices"][0]
        parts.append(
            choice["text"] if endpoint is Endpoint.COMPLETIONS else choice["delta"]["content"]
        )
    return "".join(parts)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("endpoint", list(Endpoint), ids=lambda e: e.label)
async def test_a_request_runs_one_handoff_through_both_legs(
    lean_server: Server, http: aiohttp.ClientSession, endpoint: Endpoint, stream: bool
) -> None:
    async with asyncio.timeout(TIMEOUT_S), rig(coordinator(lean_server)) as proxy:
        prefill, decode = proxy.prefills[0], proxy.decodes[0]
        body = request_for(endpoint, stream)
        async with http.post(proxy.url + endpoint.value, json=body) as response:
            assert response.status == 200, await response.text()
            handoff_id = response.headers["X-Request-Id"]
            if stream:
                events = sse_events(await response.text())
                assert events[-1] == "[DONE]"
                text = streamed_text(endpoint, events)
            else:
                text = text_of(endpoint, await response.json())
        # The decode answered with the KV the prefill held (its params came along).
        assert text == "Tokens decoded after prefill-0"
        # The prefill leg: one token, not streamed, asking for a remote decode.
        sent = prefill.bodies[0]
        assert sent["max_tokens"] == 1
        assert sent["stream"] is False
        assert "stream_options" not in sent
        if endpoint is Endpoint.CHAT:
            assert sent["max_completion_tokens"] == 1
        assert sent["kv_transfer_params"] == {
            "do_remote_decode": True,
            "do_remote_prefill": False,
            "remote_engine_id": None,
            "remote_block_ids": None,
            "remote_host": None,
            "remote_port": None,
            "handoff_id": handoff_id,
        }
        # The decode leg: the client's own body, with the prefill's params and the id.
        decoded = decode.bodies[0]
        assert {k: v for k, v in decoded.items() if k != "kv_transfer_params"} == body
        assert decoded["kv_transfer_params"]["remote_engine_id"] == "prefill-0"
        assert decoded["kv_transfer_params"]["handoff_id"] == handoff_id
        assert prefill.request_ids == decode.request_ids == [handoff_id]
        assert prefill.authorizations == decode.authorizations == [None]
        await decode.ended(handoff_id, Completion.SUCCESS)
        assert prefill.freed[handoff_id].is_set()  # ReleaseSource
        assert proxy.client is not None
        handoff = await proxy.client.get_handoff(handoff_id)
        assert handoff.source_engine_id == "prefill-0"
        assert handoff.destination_engine_id == "decode-0"


async def post_in_background(
    http: aiohttp.ClientSession, url: str, body: dict[str, Any]
) -> asyncio.Task[tuple[int, str]]:
    async def post() -> tuple[int, str]:
        async with http.post(url, json=body) as response:
            return response.status, await response.text()

    return asyncio.create_task(post())


@pytest.mark.parametrize("leg", ["prefill", "decode"])
async def test_a_client_gone_during_a_leg_cancels_the_handoff_and_closes_the_leg(
    lean_server: Server, caplog: pytest.LogCaptureFixture, leg: str
) -> None:
    caplog.set_level(logging.INFO, logger="handoff.proxy")
    async with asyncio.timeout(TIMEOUT_S), rig(coordinator(lean_server)) as proxy:
        prefill, decode = proxy.prefills[0], proxy.decodes[0]
        engine = prefill if leg == "prefill" else decode
        prefill.hang = leg == "prefill"  # the prefill never answers
        decode.stall = leg == "decode"  # the decode streams its first token, then waits
        session = aiohttp.ClientSession()
        body = request_for(Endpoint.COMPLETIONS, True)
        request = await post_in_background(session, proxy.url + "/v1/completions", body)
        handoff_id = await engine.arrivals.get()
        if leg == "decode":
            await decode.streaming[handoff_id].wait()
        request.cancel()
        await session.close()  # the client is gone
        await engine.closed[handoff_id].wait()  # the proxy closed that leg
        # During the decode the handoff had succeeded: the cancel reopens it.
        await engine.ended(handoff_id, Completion.CANCELED)
        assert engine.freed[handoff_id].is_set()  # CancelSource, CancelDestination
    reasons = [r.getMessage() for r in caplog.records if getattr(r, "handoff_id", "") == handoff_id]
    assert f"handoff proxy: client disconnected during the {leg} leg" in reasons


async def test_a_prefill_that_fails_is_a_502_naming_the_leg_the_engine_and_the_handoff(
    lean_server: Server, http: aiohttp.ClientSession
) -> None:
    async with asyncio.timeout(TIMEOUT_S), rig(coordinator(lean_server)) as proxy:
        prefill, decode = proxy.prefills[0], proxy.decodes[0]
        prefill.fail_status = 500
        async with http.post(proxy.url + "/v1/completions", json=PROMPT) as response:
            assert response.status == 502
            error = (await response.json())["error"]
        handoff_id = error["handoff_id"]
        assert error["leg"] == "prefill"
        assert error["engine_id"] == "prefill-0"
        assert error["type"] == "bad_gateway"
        assert error["code"] == 502
        message = error["message"]
        for needle in ("prefill leg", "prefill-0", handoff_id, "HTTP 500", "out of KV blocks"):
            assert needle in message
        assert not decode.bodies  # no decode leg
        # The proxy reported the failure: the handoff is canceled, the prefill freed.
        await prefill.ended(handoff_id, Completion.CANCELED)
        assert prefill.freed[handoff_id].is_set()


async def test_a_prefill_nobody_listens_on_is_a_502_naming_it(
    lean_server: Server, http: aiohttp.ClientSession
) -> None:
    async with asyncio.timeout(TIMEOUT_S), rig(coordinator(lean_server)) as proxy:
        await proxy.prefills[0].stop()  # its sidecar and its HTTP server are gone
        async with http.post(proxy.url + "/v1/completions", json=PROMPT) as response:
            assert response.status == 502
            error = (await response.json())["error"]
        assert error["leg"] == "prefill"
        assert error["engine_id"] == "prefill-0"
        assert "could not be reached" in error["message"]


async def test_without_a_coordinator_requests_fail_fast_with_503(
    http: aiohttp.ClientSession,
) -> None:
    nobody = f"127.0.0.1:{free_port()}"
    async with asyncio.timeout(TIMEOUT_S), rig(nobody, register=False) as proxy:
        for _ in range(2):  # the second as fast as the first: nothing queues up
            began = time.monotonic()
            async with http.post(proxy.url + "/v1/completions", json=PROMPT) as response:
                assert response.status == 503
                assert response.headers["Retry-After"] == "1"
                error = (await response.json())["error"]
            assert time.monotonic() - began < 5.0  # --coordinator-retry-s 1 and a refused port
            assert error["leg"] == "start"
            assert error["type"] == "service_unavailable"
            assert nobody in error["message"]
            assert "--coordinator" in error["message"]
            assert error["handoff_id"] in error["message"]
        assert not proxy.prefills[0].bodies  # no leg was sent without a handoff


async def test_a_handoff_past_its_deadline_is_a_504_and_its_open_leg_is_closed(
    lean_server: Server, http: aiohttp.ClientSession
) -> None:
    async with asyncio.timeout(TIMEOUT_S), rig(coordinator(lean_server), deadline_s=0.5) as proxy:
        decode = proxy.decodes[0]
        decode.hold = True  # never reserves: the decode waits for an activation that never comes
        async with http.post(proxy.url + "/v1/completions", json=PROMPT) as response:
            assert response.status == 504
            error = (await response.json())["error"]
        handoff_id = error["handoff_id"]
        assert error["leg"] == "decode"
        assert error["engine_id"] == "decode-0"
        assert "deadline" in error["message"]
        assert "--deadline-s" in error["message"]
        await decode.closed[handoff_id].wait()
        await decode.ended(handoff_id, Completion.CANCELED)


@pytest.mark.parametrize("leg", ["prefill", "decode"])
async def test_a_handoff_canceled_on_the_coordinator_closes_the_open_leg(
    lean_server: Server, http: aiohttp.ClientSession, leg: str
) -> None:
    async with asyncio.timeout(TIMEOUT_S), rig(coordinator(lean_server)) as proxy:
        prefill, decode = proxy.prefills[0], proxy.decodes[0]
        engine = prefill if leg == "prefill" else decode
        prefill.hang = leg == "prefill"
        decode.hold = leg == "decode"
        request = await post_in_background(http, proxy.url + "/v1/completions", PROMPT)
        handoff_id = await engine.arrivals.get()
        assert proxy.client is not None
        await proxy.client.cancel(handoff_id, "an operator canceled it")
        status, text = await request
        assert status == 502, text
        assert f"canceled on the coordinator during the {leg} leg" in text
        assert handoff_id in text
        assert engine.engine_id in text
        await engine.closed[handoff_id].wait()


def test_each_side_goes_to_its_engine_with_the_fewest_requests_in_flight() -> None:
    prefill = tuple(EngineAddress(f"prefill-{n}", f"http://p{n}:1") for n in range(3))
    decode = tuple(EngineAddress(f"decode-{n}", f"http://d{n}:1") for n in range(2))
    pool = Pool(prefill, decode, max_in_flight=2)
    first = pool.pick()
    assert [lease.engine.engine_id for lease in first] == ["prefill-0", "decode-0"]
    second = pool.pick()  # ties go to the engine given first
    assert [lease.engine.engine_id for lease in second] == ["prefill-1", "decode-1"]
    first[0].end()
    first[0].end()  # a lease is given back once
    third = pool.pick()
    assert [lease.engine.engine_id for lease in third] == ["prefill-0", "decode-0"]
    pool.pick()
    with pytest.raises(NoEngineError, match=r"no decode engine free.*--max-in-flight"):
        pool.pick()  # both decodes have 2 in flight
    assert [engine.in_flight for engine in pool.prefill] == [1, 1, 1]  # none taken by it


async def test_a_request_goes_to_the_engines_with_the_fewest_in_flight(
    lean_server: Server, http: aiohttp.ClientSession
) -> None:
    async with (
        asyncio.timeout(TIMEOUT_S),
        rig(coordinator(lean_server), prefills=2, decodes=2, max_in_flight=1) as proxy,
    ):
        url = proxy.url + "/v1/completions"
        for decode in proxy.decodes:
            decode.stall = True
        # The first request stays in its decode leg on decode-0; its prefill leg is over.
        first = await http.post(url, json=request_for(Endpoint.COMPLETIONS, True))
        first_id = first.headers["X-Request-Id"]
        await proxy.decodes[0].streaming[first_id].wait()
        second = await http.post(url, json=request_for(Endpoint.COMPLETIONS, True))
        second_id = second.headers["X-Request-Id"]
        await proxy.decodes[1].streaming[second_id].wait()
        assert proxy.client is not None
        handoff = await proxy.client.get_handoff(second_id)
        assert handoff.source_engine_id == "prefill-0"  # free again: ties to the first given
        assert handoff.destination_engine_id == "decode-1"  # decode-0 has one in flight
        # Both decodes at --max-in-flight 1: no pair, 503, and no handoff started.
        async with http.post(url, json=PROMPT) as refused:
            assert refused.status == 503
            error = (await refused.json())["error"]
        assert "no decode engine free" in error["message"]
        assert "handoff_id" not in error
        first.close()
        second.close()
        await proxy.decodes[0].closed[first_id].wait()
        await proxy.decodes[1].closed[second_id].wait()


async def test_many_requests_at_once_each_run_their_own_handoff(
    lean_server: Server, http: aiohttp.ClientSession
) -> None:
    async with (
        asyncio.timeout(TIMEOUT_S),
        rig(coordinator(lean_server), prefills=2, decodes=2) as proxy,
    ):

        async def one(n: int) -> str:
            endpoint = list(Endpoint)[n % 2]
            stream = n % 3 == 0
            async with http.post(
                proxy.url + endpoint.value, json=request_for(endpoint, stream)
            ) as response:
                assert response.status == 200
                if stream:
                    text = streamed_text(endpoint, sse_events(await response.text()))
                else:
                    text = text_of(endpoint, await response.json())
                assert text.startswith("Tokens decoded after prefill-")
                return response.headers["X-Request-Id"]

        handoff_ids = await asyncio.gather(*(one(n) for n in range(24)))
        assert len(set(handoff_ids)) == 24
        for handoff_id in handoff_ids:
            decode = next(d for d in proxy.decodes if handoff_id in d.arrived)
            await decode.ended(handoff_id, Completion.SUCCESS)
        # Spread over both pairs, and nothing left counted in flight.
        assert all(engine.bodies for engine in [*proxy.prefills, *proxy.decodes])
        pool = proxy.proxy.services.pool
        assert [e.in_flight for e in [*pool.prefill, *pool.decode]] == [0, 0, 0, 0]


async def test_metrics_are_named_handoff_proxy_and_count_what_happened(
    lean_server: Server, http: aiohttp.ClientSession
) -> None:
    async with asyncio.timeout(TIMEOUT_S), rig(coordinator(lean_server)) as proxy:
        async with http.post(proxy.url + "/v1/completions", json=PROMPT) as response:
            assert response.status == 200
        proxy.prefills[0].fail_status = 500
        async with http.post(proxy.url + "/v1/chat/completions", json=CHAT) as response:
            assert response.status == 502
        async with http.get(proxy.url + "/metrics") as response:
            assert response.status == 200
            assert response.headers["Content-Type"].startswith("text/plain")
            exposition = await response.text()
    names = {line.split()[2] for line in exposition.splitlines() if line.startswith("# TYPE ")}
    assert all(name.startswith("handoff_proxy_") for name in names)
    assert {
        "handoff_proxy_requests_total",
        "handoff_proxy_requests_in_flight",
        "handoff_proxy_engine_requests_in_flight",
        "handoff_proxy_failures_total",
        "handoff_proxy_client_disconnects_total",
        "handoff_proxy_request_duration_seconds",
        "handoff_proxy_time_to_first_byte_seconds",
        "handoff_proxy_leg_duration_seconds",
        "handoff_proxy_coordinator_errors_total",
        "handoff_proxy_polls_total",
    } <= names
    assert 'handoff_proxy_requests_total{code="200",endpoint="completions"} 1.0' in exposition
    assert 'handoff_proxy_requests_total{code="502",endpoint="chat_completions"} 1.0' in exposition
    assert 'handoff_proxy_failures_total{leg="prefill",why="engine_error"} 1.0' in exposition
    assert 'handoff_proxy_engine_requests_in_flight{engine="decode-0",role="decode"} 0.0' in (
        exposition
    )


async def test_health_says_what_the_proxy_fronts(
    lean_server: Server, http: aiohttp.ClientSession
) -> None:
    async with (
        asyncio.timeout(TIMEOUT_S),
        rig(coordinator(lean_server)) as proxy,
        http.get(proxy.url + "/health") as response,
    ):
        assert response.status == 200
        health = await response.json()
    assert health == {
        "status": "ok",
        "coordinator": coordinator(lean_server),
        "prefill": ["prefill-0"],
        "decode": ["decode-0"],
    }


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
async def test_without_the_coordinator_the_two_legs_are_plain_vllm_p_d(
    http: aiohttp.ClientSession, stream: bool
) -> None:
    async with asyncio.timeout(TIMEOUT_S), rig(None) as proxy:
        body = request_for(Endpoint.COMPLETIONS, stream) | {"max_tokens": 3}
        async with http.post(
            proxy.url + "/v1/completions",
            json=body,
            headers={"X-Request-Id": "req-7", "Authorization": "Bearer vllm-key"},
        ) as response:
            assert response.status == 200
            assert response.headers["X-Request-Id"] == "req-7"
            raw = await response.text()
        text = (
            streamed_text(Endpoint.COMPLETIONS, sse_events(raw))
            if stream
            else text_of(Endpoint.COMPLETIONS, json.loads(raw))
        )
        assert text == "Tokens decoded after prefill-0"
        prefill, decode = proxy.prefills[0], proxy.decodes[0]
        assert "handoff_id" not in prefill.bodies[0]["kv_transfer_params"]
        assert decode.bodies[0]["kv_transfer_params"]["remote_engine_id"] == "prefill-0"
        assert "handoff_id" not in decode.bodies[0]["kv_transfer_params"]
        assert decode.bodies[0]["max_tokens"] == 3
        assert prefill.request_ids == decode.request_ids == ["req-7"]
        assert prefill.authorizations == decode.authorizations == ["Bearer vllm-key"]


def test_proxy_help_explains_itself_in_groups(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["proxy", "--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    for needle in ("engines:", "coordinator:", "TLS and tokens:", "--prefill ENGINE_ID=URL"):
        assert needle in out
    assert "docs/proxy.md" in out


ENGINES = ["--prefill", "p=http://x:1", "--decode", "d=http://y:2"]


@pytest.mark.parametrize(
    ("argv", "line"),
    [
        ([], "--prefill: give at least one ENGINE_ID=URL"),
        (["--prefill", "p", "--decode", "d=http://y:2"], "--prefill: 'p' is not ENGINE_ID=URL"),
        (["--prefill", "p=ftp://x", *ENGINES[2:]], "--prefill: 'ftp://x' is not an http"),
        ([*ENGINES, "--decode", "d=http://z:3"], "--decode: engine id 'd' is given twice"),
        ([*ENGINES, "--deadline-s", "soon"], "--deadline-s: 'soon' is not a number"),
        ([*ENGINES, "--poll-interval-s", "0"], "--poll-interval-s: must be > 0"),
        ([*ENGINES, "--port", "70000"], "--port: must be between 0 and 65535"),
        ([*ENGINES, "--coordinator", "nowhere"], "--coordinator: 'nowhere' is not HOST:PORT"),
        ([*ENGINES, "--tls-client-key", "k.pem"], "--tls-client-key: needs --tls-client-cert"),
    ],
)
def test_a_bad_value_is_one_line_naming_its_flag(
    capsys: pytest.CaptureFixture[str], argv: list[str], line: str
) -> None:
    assert main(["proxy", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"handoff proxy: {line}")
    assert len(err.splitlines()) == 1


async def test_a_proxy_stopping_cuts_off_what_is_left_and_cancels_its_handoffs(
    lean_server: Server, http: aiohttp.ClientSession, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="handoff.proxy")
    async with asyncio.timeout(TIMEOUT_S), rig(coordinator(lean_server), drain_grace_s=0) as proxy:
        prefill = proxy.prefills[0]
        prefill.hang = True
        request = await post_in_background(http, proxy.url + "/v1/completions", PROMPT)
        handoff_id = await prefill.arrivals.get()
        await proxy.proxy.stop()  # as on SIGTERM, with nothing left to wait for
        with pytest.raises(aiohttp.ClientError):
            await request
        await prefill.closed[handoff_id].wait()
        # Reported before stop() returned: the cancels are drained before the client closes.
        await prefill.ended(handoff_id, Completion.CANCELED)
    reasons = [r.getMessage() for r in caplog.records if getattr(r, "handoff_id", "") == handoff_id]
    assert "handoff proxy: the proxy is shutting down during the prefill leg" in reasons


TOKEN = "proxy-test-token-0123456789"
PROCESS_TIMEOUT_S = 60.0  # two Python processes start, on a machine that may be busy


async def proxy_process(*flags: str) -> tuple[asyncio.subprocess.Process, str]:
    """``handoff proxy`` as a process on a free port, once it says where it listens."""
    process = await asyncio.create_subprocess_exec(
        *(sys.executable, "-m", "handoff_server.commands.cli", "proxy", "--port", "0"),
        *("--log-format", "json", *flags),
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE,
    )
    assert process.stderr is not None
    async for line in process.stderr:
        record = json.loads(line)
        if record["message"].startswith("handoff proxy on http://"):
            return process, record["message"].split()[3]
    raise AssertionError(f"handoff proxy exited with {await process.wait()} before listening")


async def test_the_command_reaches_a_coordinator_over_mutual_tls_with_a_token(
    start_lean_server: StartServer, http: aiohttp.ClientSession, tmp_path: Path
) -> None:
    pki = make_pki(tmp_path)
    served = tmp_path / "served-tokens"
    served.write_text(f"everyone {TOKEN} engines=prefill-0,decode-0\n")  # the stand-ins' too
    server = await start_lean_server(**pki.tls_settings(mutual=True), token_file=str(served))
    target = f"127.0.0.1:{server.port}"
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    engines = HandoffClient(
        target,
        tls_root_cert=pki.ca.cert_path,
        tls_client_cert=pki.client.cert_path,
        tls_client_key=pki.client.key_path,
        token=TOKEN,
    )
    async with (
        asyncio.timeout(PROCESS_TIMEOUT_S),
        engines,
        standins(engines) as (prefills, decodes),
    ):
        process, url = await proxy_process(
            *("--coordinator", target, "--poll-interval-s", "0.05"),
            *(
                "--prefill",
                f"prefill-0={prefills[0].url}",
                "--decode",
                f"decode-0={decodes[0].url}",
            ),
            *(f"--tls-root-cert={pki.ca.cert_path}", f"--tls-client-cert={pki.client.cert_path}"),
            *(f"--tls-client-key={pki.client.key_path}", f"--token-file={token_file}"),
        )
        try:
            async with http.post(url + "/v1/completions", json=PROMPT) as response:
                assert response.status == 200, await response.text()
                handoff_id = response.headers["X-Request-Id"]
            await decodes[0].ended(handoff_id, Completion.SUCCESS)
        finally:
            process.terminate()
            assert await process.wait() == 0  # SIGTERM: drained, stopped cleanly
        # Without the token the coordinator refuses, and the proxy says which flag fixes it.
        process, url = await proxy_process(
            *("--coordinator", target, "--prefill", f"prefill-0={prefills[0].url}"),
            *("--decode", f"decode-0={decodes[0].url}", f"--tls-root-cert={pki.ca.cert_path}"),
            *(
                f"--tls-client-cert={pki.client.cert_path}",
                f"--tls-client-key={pki.client.key_path}",
            ),
        )
        try:
            async with http.post(url + "/v1/completions", json=PROMPT) as response:
                assert response.status == 503
                error = (await response.json())["error"]
            assert "--token-file" in error["message"]
        finally:
            process.terminate()
            assert await process.wait() == 0


async def test_an_engine_the_coordinator_lost_is_a_502_naming_it(
    lean_server: Server, http: aiohttp.ClientSession
) -> None:
    async with asyncio.timeout(TIMEOUT_S), rig(coordinator(lean_server)) as proxy:
        decode = proxy.decodes[0]
        decode.hold = True
        request = await post_in_background(http, proxy.url + "/v1/completions", PROMPT)
        handoff_id = await decode.arrivals.get()
        await decode.restart_sidecar()  # a new incarnation: what the old one reserved is gone
        status, text = await request
        assert status == 502, text
        error = json.loads(text)["error"]
        assert error["leg"] == "decode"
        assert error["engine_id"] == "decode-0"
        assert "it lost decode engine decode-0" in error["message"]
        await decode.closed[handoff_id].wait()


def test_without_the_extra_the_command_says_how_to_get_it(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "aiohttp", None)  # as if not installed
    monkeypatch.delitem(sys.modules, "handoff_proxy.app")
    monkeypatch.delattr(handoff_proxy, "app")
    with pytest.raises(SystemExit):
        main(["--help"])  # the command list needs no aiohttp
    assert "proxy" in capsys.readouterr().out
    assert main(["proxy", *ENGINES]) == 2
    assert capsys.readouterr().err == (
        "handoff proxy: needs module 'aiohttp'; install it with: pip install 'handoff[proxy]'\n"
    )


@given(st.lists(st.integers(min_value=-1, max_value=7), max_size=60), st.integers(1, 4))
def test_every_pick_takes_the_least_loaded_engine_first_given(
    steps: list[int], engines: int
) -> None:
    """-1 picks a pair; n >= 0 ends the lease of the live request n (mod how many there are)."""
    addresses = tuple(EngineAddress(f"e-{n}", f"http://e{n}:1") for n in range(engines))
    pool = Pool(addresses, addresses)
    live: list[tuple[Lease, Lease]] = []
    for step in steps:
        if step < 0 or not live:
            loads = [[engine.in_flight for engine in side] for side in (pool.prefill, pool.decode)]
            prefill, decode = pool.pick()
            # The least loaded; of equals, the first given (index() finds the first).
            assert prefill.engine is pool.prefill[loads[0].index(min(loads[0]))]
            assert decode.engine is pool.decode[loads[1].index(min(loads[1]))]
            live.append((prefill, decode))
        else:
            prefill, decode = live.pop(step % len(live))
            prefill.end()
            decode.end()
        for side in (pool.prefill, pool.decode):  # every lease counted once, while it lives
            assert sum(engine.in_flight for engine in side) == len(live)


async def test_a_decode_that_breaks_off_its_stream_ends_it_with_an_error_event(
    lean_server: Server, http: aiohttp.ClientSession
) -> None:
    async with asyncio.timeout(TIMEOUT_S), rig(coordinator(lean_server)) as proxy:
        decode = proxy.decodes[0]
        decode.break_off = True
        body = request_for(Endpoint.CHAT, True)
        async with http.post(proxy.url + "/v1/chat/completions", json=body) as response:
            assert response.status == 200  # the headers went out with the first token
            handoff_id = response.headers["X-Request-Id"]
            first = await response.content.readany()
            decode.proceed[handoff_id].set()
            events = sse_events((first + await response.content.read()).decode())
        assert events[0]["choices"][0]["delta"]["content"] == "Tokens"
        error = events[-1]["error"]
        assert error["leg"] == "decode"
        assert error["engine_id"] == "decode-0"
        assert error["handoff_id"] == handoff_id
        assert "broke off its stream" in error["message"]
        assert "[DONE]" not in events
        # Reported as Failed: the handoff (a success by then) reopens and frees the decode.
        await decode.ended(handoff_id, Completion.CANCELED)
        assert decode.freed[handoff_id].is_set()


async def test_a_handoff_canceled_while_its_decode_streams_stops_the_stream(
    lean_server: Server, http: aiohttp.ClientSession
) -> None:
    async with asyncio.timeout(TIMEOUT_S), rig(coordinator(lean_server)) as proxy:
        decode = proxy.decodes[0]
        decode.stall = True
        body = request_for(Endpoint.COMPLETIONS, True)
        async with http.post(proxy.url + "/v1/completions", json=body) as response:
            handoff_id = response.headers["X-Request-Id"]
            first = await response.content.readany()
            await decode.ended(handoff_id, Completion.SUCCESS)  # activated, source released
            assert proxy.client is not None
            # Only the proxy can stop an activated decode: by closing its leg.
            await proxy.client.cancel(handoff_id, "an operator canceled it")
            events = sse_events((first + await response.content.read()).decode())
        error = events[-1]["error"]
        assert error["leg"] == "decode"
        assert "canceled on the coordinator during the decode leg" in error["message"]
        await decode.closed[handoff_id].wait()
        await decode.ended(handoff_id, Completion.CANCELED)  # reopened, the decode freed


async def test_without_the_coordinator_the_deadline_bounds_the_prefill_leg(
    http: aiohttp.ClientSession,
) -> None:
    async with asyncio.timeout(TIMEOUT_S), rig(None, deadline_s=0.3) as proxy:
        prefill = proxy.prefills[0]
        prefill.hang = True
        async with http.post(proxy.url + "/v1/completions", json=PROMPT) as response:
            assert response.status == 504
            error = (await response.json())["error"]
        assert error["leg"] == "prefill"
        assert "so the proxy closed it" in error["message"]
        await prefill.closed[error["handoff_id"]].wait()
