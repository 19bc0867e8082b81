"""Bearer tokens on a real server: every RPC, rotation, exemptions, refusals change nothing."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import hmac
import urllib.request
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from handoff_proto.v1 import coordinator_pb2 as pb
from handoff_proto.v1 import coordinator_pb2_grpc as pb_grpc
from handoff_server.domain.authorization import Binding
from handoff_server.ops import config
from handoff_server.ops.config import Settings
from handoff_server.service import arrival, bindings, security
from handoff_server.service.app import Server
from handoff_server.service.security import SecurityConfigError, TokenSet
from tests.support.rpc import DESTINATION, SOURCE
from tests.support.security import Stub, docs_block
from tests.support.servers import StartServer

TIMEOUT_S = 10.0
OLD = "old-token-0123456789abcdef"
NEW = "new-token-fedcba9876543210"
FROM_ENV = "env-token-aaaaaaaaaaaaaaaa"
DENIED = grpc.StatusCode.PERMISSION_DENIED

Metadata = Sequence[tuple[str, str]]


def bearer(token: str) -> Metadata:
    return (("authorization", f"Bearer {token}"),)


def start_request(handoff_id: str | None = None) -> pb.StartHandoffRequest:
    return pb.StartHandoffRequest(
        handoff_id=handoff_id or str(uuid.uuid4()),
        engine_type=pb.ENGINE_TYPE_VLLM,
        source_engine_id=SOURCE,
        destination_engine_id=DESTINATION,
    )


@pytest.fixture
async def guarded(start_server: StartServer, tmp_path: Path) -> Server:
    """Two tokens from a file (with a comment and blank lines), one from the
    variable; only the named one acts for the engines (its engines= names them)."""
    token_file = tmp_path / "tokens"
    token_file.write_text(
        f"# rotation in progress\n{OLD}\n\n"
        f"new {NEW} engines={SOURCE},{DESTINATION}  # added today\n"
    )
    return await start_server(token_file=str(token_file), tokens=FROM_ENV)


@pytest.fixture
async def channel(guarded: Server) -> AsyncIterator[grpc.aio.Channel]:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{guarded.port}") as channel:
        yield channel


async def hold_open(first: pb.ConnectRequest) -> AsyncIterator[pb.ConnectRequest]:
    yield first
    await asyncio.Event().wait()  # until the call is canceled


async def every_rpc(channel: grpc.aio.Channel, metadata: Metadata) -> dict[str, grpc.StatusCode]:
    """Calls each coordinator RPC once (all with a random handoff) and returns
    each one's status code; streams that are accepted are canceled after their
    headers arrive."""
    stub: Stub = pb_grpc.HandoffCoordinatorStub(channel)
    handoff_id = str(uuid.uuid4())
    codes: dict[str, grpc.StatusCode] = {}
    unary: dict[str, Callable[[], Awaitable[object]]] = {
        "StartHandoff": lambda: stub.StartHandoff(start_request(handoff_id), metadata=metadata),
        "ReportFact": lambda: stub.ReportFact(
            pb.ReportFactRequest(
                handoff_id=handoff_id, fact=pb.Fact(canceled=pb.Canceled(reason="x"))
            ),
            metadata=metadata,
        ),
        "ReportOutcome": lambda: stub.ReportOutcome(
            pb.ReportOutcomeRequest(
                handoff_id=handoff_id, outcome=pb.Outcome(kind=pb.OUTCOME_KIND_SUBMITTED)
            ),
            metadata=metadata,
        ),
        "GetHandoff": lambda: stub.GetHandoff(
            pb.GetHandoffRequest(handoff_id=handoff_id), metadata=metadata
        ),
    }
    for name, call in unary.items():
        try:
            await call()
            codes[name] = grpc.StatusCode.OK
        except grpc.aio.AioRpcError as error:
            codes[name] = error.code()
    actions = stub.StreamActions(pb.StreamActionsRequest(engine_id=SOURCE), metadata=metadata)
    # Connect stays open (no half-close), like StreamActions: both end only
    # when canceled, so an accepted stream always ends CANCELLED.
    connect = stub.Connect(
        hold_open(pb.ConnectRequest(hello=pb.ConnectHello(engine_id=DESTINATION))),
        metadata=metadata,
    )
    for name, stream in (("StreamActions", actions), ("Connect", connect)):
        await stream.initial_metadata()
        stream.cancel()
        codes[name] = await stream.code()
    return codes


async def test_calls_without_a_valid_token_are_unauthenticated_and_change_nothing(
    guarded: Server, channel: grpc.aio.Channel
) -> None:
    refused = {
        "no token": (),
        "unknown token": bearer("not-a-token-0123456789"),
        "a prefix of a token": bearer(OLD[:-1]),
        "a token plus more": bearer(OLD + "x"),
        "another scheme": (("authorization", f"Basic {OLD}"),),
        "no scheme": (("authorization", OLD),),
        "two headers": (*bearer(OLD), *bearer(NEW)),
    }
    async with asyncio.timeout(TIMEOUT_S):
        for case, metadata in refused.items():
            codes = await every_rpc(channel, metadata)
            assert set(codes.values()) == {grpc.StatusCode.UNAUTHENTICATED}, (case, codes)
            assert len(codes) == 6
    registry = guarded.registry
    assert registry.handoffs == {}
    assert registry.active_count == 0
    assert guarded.engine_streams.live == {}
    assert registry.next_wakeup() is None  # no engine channel, no timer
    metrics = guarded.metrics.registry
    assert metrics.get_sample_value("handoff_started_total") == 0
    for rpc in ("StartHandoff", "ReportFact", "StreamActions", "Connect"):
        labels = {"rpc": rpc, "code": "UNAUTHENTICATED"}
        assert metrics.get_sample_value("handoff_rejections_total", labels) == len(refused)


async def test_every_accepted_token_works_during_a_rotation(
    guarded: Server, channel: grpc.aio.Channel
) -> None:
    async with asyncio.timeout(TIMEOUT_S):
        for token in (OLD, NEW, FROM_ENV):
            codes = await every_rpc(channel, bearer(token))
            # Past authentication, each call gets its ordinary answer.
            assert grpc.StatusCode.UNAUTHENTICATED not in codes.values(), token
            assert codes["StartHandoff"] is grpc.StatusCode.OK
            assert codes["ReportFact"] is grpc.StatusCode.OK  # canceled it
            assert codes["GetHandoff"] is grpc.StatusCode.OK
            # A token that names no engine may act for none (docs/security.md).
            streams = grpc.StatusCode.CANCELLED if token == NEW else DENIED
            assert codes["StreamActions"] is streams, token
            assert codes["Connect"] is streams, token
        # The scheme is case-insensitive (RFC 7235).
        stub: Stub = pb_grpc.HandoffCoordinatorStub(channel)
        await stub.StartHandoff(start_request(), metadata=(("authorization", f"bearer {NEW}"),))
    assert len(guarded.registry.handoffs) == 4


async def test_health_check_is_exempt_and_watch_and_reflection_are_not(
    guarded: Server, channel: grpc.aio.Channel
) -> None:
    health = health_pb2_grpc.HealthStub(channel)
    reflection = reflection_pb2_grpc.ServerReflectionStub(channel)
    async with asyncio.timeout(TIMEOUT_S):
        answer = await health.Check(health_pb2.HealthCheckRequest())
        assert answer.status == health_pb2.HealthCheckResponse.SERVING
        # A Watch stays open: without a token, anyone could hold them by the thousand.
        watch = health.Watch(health_pb2.HealthCheckRequest())
        assert await watch.code() is grpc.StatusCode.UNAUTHENTICATED
        watch = health.Watch(health_pb2.HealthCheckRequest(), metadata=bearer(OLD))
        assert (await watch.read()).status == health_pb2.HealthCheckResponse.SERVING
        watch.cancel()
        listing = reflection.ServerReflectionInfo(
            iter([reflection_pb2.ServerReflectionRequest(list_services="")])
        )
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await listing.read()
        assert refused.value.code() is grpc.StatusCode.UNAUTHENTICATED
        listing = reflection.ServerReflectionInfo(
            iter([reflection_pb2.ServerReflectionRequest(list_services="")]),
            metadata=bearer(OLD),
        )
        assert (await listing.read()).list_services_response.service
        # An unknown method without a token learns nothing, not even that it
        # does not exist.
        unknown = channel.unary_unary(
            "/handoff.v1.HandoffCoordinator/Nope",
            request_serializer=None,
            response_deserializer=None,
        )
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await unknown(b"")
        assert refused.value.code() is grpc.StatusCode.UNAUTHENTICATED


async def test_health_needs_a_token_when_nothing_is_exempt(start_server: StartServer) -> None:
    server = await start_server(tokens=OLD, auth_exempt_methods="")
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        health = health_pb2_grpc.HealthStub(channel)
        async with asyncio.timeout(TIMEOUT_S):
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await health.Check(health_pb2.HealthCheckRequest())
            assert refused.value.code() is grpc.StatusCode.UNAUTHENTICATED
            answer = await health.Check(health_pb2.HealthCheckRequest(), metadata=bearer(OLD))
            assert answer.status == health_pb2.HealthCheckResponse.SERVING


async def test_metrics_endpoint_has_its_own_address() -> None:
    # 127.0.0.2 is loopback too on Linux: gRPC and metrics on different
    # addresses, and the metrics (plain HTTP) need no token.
    settings = Settings(
        host="127.0.0.1", port=0, metrics_host="127.0.0.2", metrics_port=0, tokens=OLD
    )
    server = Server(settings)
    await server.start()

    def scrape(host: str) -> str:
        url = f"http://{host}:{server.metrics_port}/metrics"
        with urllib.request.urlopen(url, timeout=5) as response:
            return str(response.read().decode())

    try:
        async with asyncio.timeout(TIMEOUT_S):
            assert "handoff_started_total" in await asyncio.to_thread(scrape, "127.0.0.2")
            with pytest.raises(OSError, match="refused"):
                await asyncio.to_thread(scrape, "127.0.0.1")
    finally:
        await server.stop()


def test_tokens_come_from_the_environment_and_stay_out_of_repr() -> None:
    args = argparse.Namespace()
    settings = config.from_arguments(args, {"HANDOFF_TOKENS": f"{OLD}, {NEW}"})
    loaded = security.load_tokens(settings)
    assert loaded is not None
    assert len(loaded) == 2
    assert loaded.identify(OLD) is not None
    assert loaded.identify(NEW) is not None
    assert OLD not in repr(settings)
    assert security.load_tokens(Settings()) is None


def test_comparison_looks_at_every_token_whichever_matches(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """No early exit: the work done does not depend on which token matches, or
    on how much of a token the caller got right."""
    compared: list[tuple[int, int]] = []
    real = hmac.compare_digest

    def counting(a: bytes, b: bytes) -> bool:
        compared.append((len(a), len(b)))
        return real(a, b)

    tokens = TokenSet([OLD, NEW, FROM_ENV])
    monkeypatch.setattr(hmac, "compare_digest", counting)
    for presented in (OLD, FROM_ENV, OLD[:-1], "x", "y" * 1000):
        compared.clear()
        tokens.identify(presented)
        # Always three comparisons of two SHA-256 digests, whatever was sent.
        assert compared == [(32, 32)] * 3, presented


def write_file(path: Path, text: str) -> str:
    path.write_text(text)
    return str(path)


@pytest.mark.parametrize(
    ("tokens", "file_text", "message"),
    [
        ("short", None, "shorter than 16"),
        ("has space in it 0123456789", None, "characters a bearer token cannot carry"),
        ("", "# only a comment\n\n", "hold no token"),
        ("", f"{OLD}\nbad!token-0123456789abc\n", "token 2 has characters"),
        ("", f"router {OLD} start,fly\n", "unknown scope fly"),
        ("", f"router {OLD}\nrouter {NEW}\n", "token names must differ: router"),
        ("", f"a/b {OLD}\n", "its name must be 1-64 characters"),
        ("", f"p {OLD} engines=\n", "'' in engines= is not an engine id"),
        ("", f"p {OLD} engine engines=a,b!\n", "'b!' in engines= is not an engine id"),
        ("", f"p {OLD} engine engines=*p\n", "'\\*p' in engines= is not an engine id"),
        ("", f"p {OLD} engine x engines=a\n", "expected NAME TOKEN .SCOPE,.... .engines=ID"),
    ],
)
async def test_unusable_tokens_stop_the_start(
    tmp_path: Path, tokens: str, file_text: str | None, message: str
) -> None:
    token_file = "" if file_text is None else write_file(tmp_path / "tokens", file_text)
    server = Server(
        Settings(host="127.0.0.1", port=0, metrics_port=-1, tokens=tokens, token_file=token_file)
    )
    with pytest.raises(SecurityConfigError, match=message):
        await server.start()
    missing = Server(Settings(metrics_port=-1, token_file=str(tmp_path / "absent")))
    with pytest.raises(SecurityConfigError, match="absent"):
        await missing.start()


def test_the_security_pages_list_every_security_flag() -> None:
    """Each flag is in docs/security.md or in docs/limits.md (every limit)."""
    docs = Path(__file__).resolve().parents[2] / "docs"
    section = (docs / "security.md").read_text() + (docs / "limits.md").read_text()
    names = [f.name for f in dataclasses.fields(Settings)]
    # The security settings are one block, tls_cert to health_port.
    security_settings = names[names.index("tls_cert") : names.index("health_port") + 1]
    for name in [*security_settings, "metrics_host", "max_queued_actions_per_engine"]:
        assert "--" + name.replace("_", "-") in section, name


async def test_a_named_token_may_call_only_what_its_scopes_allow(
    start_server: StartServer, tmp_path: Path
) -> None:
    token_file = tmp_path / "tokens"
    token_file.write_text(f"ops {OLD} read\nrouter {NEW} start,report,read\n")
    server = await start_server(token_file=str(token_file))
    async with (
        asyncio.timeout(TIMEOUT_S),
        grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel,
    ):
        stub: Stub = pb_grpc.HandoffCoordinatorStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await stub.StartHandoff(start_request(), metadata=bearer(OLD))
        assert refused.value.code() is grpc.StatusCode.PERMISSION_DENIED
        assert refused.value.details() == "token ops may not call StartHandoff (its scopes: read)"
        started = await stub.StartHandoff(start_request(), metadata=bearer(NEW))
        lookup = pb.GetHandoffRequest(handoff_id=started.handoff.handoff_id)
        assert (await stub.GetHandoff(lookup, metadata=bearer(OLD))).handoff == started.handoff
        engine = stub.StreamActions(pb.StreamActionsRequest(engine_id=SOURCE), metadata=bearer(NEW))
        assert await engine.code() is grpc.StatusCode.PERMISSION_DENIED
    assert len(server.registry.handoffs) == 1


def test_a_token_line_names_the_engines_its_holder_acts_for(tmp_path: Path) -> None:
    """engines= after the scopes (or in their place): ids, prefixes ending in *,
    or * alone; a line without it, and a bare token, act for no engine."""
    token_file = tmp_path / "tokens"
    token_file.write_text(
        f"fleet {OLD} engine,report engines=prefill-*,decode-0\n"
        f"any {NEW} engines=*\n{FROM_ENV}\nrouter router-token-0123456789 start\n"
    )
    loaded = security.load_tokens(Settings(token_file=str(token_file)))
    assert loaded is not None
    fleet, anyone, bare, router = loaded.holders
    assert fleet.scopes == {"engine", "report"}
    assert [fleet.engines.covers(e) for e in ("prefill-7", "decode-0", "decode-1")] == [
        True,
        True,
        False,
    ]
    assert anyone.scopes == security.ALL_SCOPES
    assert anyone.engines.any_engine
    for unbound in (bare, router):
        assert unbound.engines == Binding()
        assert not unbound.engines.engine
    warnings = bindings.binding_warnings(loaded, None, mutual=False)
    assert [w.split(" ", 2)[:2] for w in warnings] == [["token", "any"], ["token", "token-3"]]


def test_a_caller_with_two_credentials_acts_where_both_let_it() -> None:
    """A token and a certificate together: the engines both name, and an
    engine's caller even where they name none in common."""
    token = Binding.of(["prefill-*", "decode-0"])
    certificate = Binding.of(["prefill-0", "decode-1"])
    both = token & certificate
    assert (both.ids, both.prefixes, both.engine) == (frozenset({"prefill-0"}), (), True)
    assert (Binding.of(["p-*"]) & Binding.of(["p-1*"])).prefixes == ("p-1",)
    assert not (Binding.of(["a"]) & Binding.of(["b"])).covers("a")
    assert (Binding.of(["a"]) & Binding()).engine


def test_the_token_file_in_the_docs_loads_with_its_names_and_scopes(tmp_path: Path) -> None:
    token_file = tmp_path / "tokens"
    token_file.write_text(docs_block("text"))
    loaded = security.load_tokens(Settings(token_file=str(token_file)))
    assert loaded is not None
    router = loaded.identify("rtr-7f3c9a1e5b2d4c6a8e0f")
    where = f"token_file {token_file}"
    assert router == security.Token("router", frozenset({"start", "report", "read"}), source=where)
    prefill = loaded.identify("pf0-1a2b3c4d5e6f7a8b9c0d")
    assert prefill is not None
    assert prefill.engines == Binding.of(["prefill-0"])
    ops = loaded.identify("ops-00112233445566778899")
    assert ops is not None
    assert not ops.may_call("StartHandoff")
    assert ops.may_call("GetHandoff")


async def test_a_refusal_waits_for_the_hello_it_would_race(
    guarded: Server, channel: grpc.aio.Channel
) -> None:
    # gRPC's asyncio client reports INTERNAL "Internal error from Core" when
    # its write of the hello fails because a refusal already ended the call
    # (grpc/grpc issue 36066); under load about 1 in 300 refused Connects
    # did. The server reads the hello before it refuses.
    stub: Stub = pb_grpc.HandoffCoordinatorStub(channel)
    hello = pb.ConnectRequest(hello=pb.ConnectHello(engine_id=DESTINATION))
    send = asyncio.Event()
    async with asyncio.timeout(TIMEOUT_S):
        call = stub.Connect(hold_open_after(send, hello), metadata=bearer("not-a-token-0123456789"))
        code = asyncio.ensure_future(call.code())
        ended, _ = await asyncio.wait([code], timeout=arrival.REFUSAL_READ_S / 4)
        assert not ended, "refused before the hello came"
        send.set()
        assert await code == grpc.StatusCode.UNAUTHENTICATED
        # A caller that never sends its first message is refused all the same.
        never = asyncio.Event()
        silent = stub.Connect(hold_open_after(never, hello), metadata=bearer("x" * 20))
        assert await silent.code() == grpc.StatusCode.UNAUTHENTICATED


async def hold_open_after(
    send: asyncio.Event, first: pb.ConnectRequest
) -> AsyncIterator[pb.ConnectRequest]:
    """:func:`hold_open`, its first message sent once ``send`` is set."""
    await send.wait()
    async for request in hold_open(first):
        yield request
