"""Issue 17's attacks, each against a real `handoff serve` with a well-behaved client alongside.

Each test attacks for a bounded number of calls and seconds, on loopback
only, then checks that the well-behaved client's handoffs kept completing
without errors, and that the server's memory stayed bounded.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import ssl
import stat
import sys
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from handoff_proto.v1 import coordinator_pb2 as pb
from handoff_proto.v1 import coordinator_pb2_grpc as pb_grpc
from handoff_server.domain.entries import StartRequest
from handoff_server.domain.model import Order
from handoff_server.domain.registry import Registry
from handoff_server.durability.journal import Journal
from handoff_server.durability.records import JournalRecorder
from handoff_server.durability.recovery import ReplayClock, recover
from handoff_server.ops.config import Settings
from handoff_server.ops.metrics import Metrics
from handoff_server.service.servicer import MAX_REPORTS_PER_MESSAGE
from tests.support import rawh2
from tests.support.attack import (
    Metadata,
    Served,
    WellBehaved,
    alongside,
    attacker,
    bearer,
    engine_streams,
    fill,
    finish,
    metric,
    rate,
    rate_kept,
    serving,
    small_volume,
    start_request,
)
from tests.support.holder import holding
from tests.support.rpc import SUBMITTED
from tests.support.security import Stub, make_pki, secure_channel

# They compare the legit client's rate before and during an attack: run alone
# (make test's second pass), so no other test's load sits in the measurement.
pytestmark = pytest.mark.serial

TOKEN = "attack-test-token-0123456789"
ATTACKER = "attacker-token-0123456789ab"
TIMEOUT_S = 60.0
# The well-behaved client's token: it acts as its two engines (good-prefill,
# good-decode) and the engines a test subscribes for it; a token names the
# engines it may act for (docs/security.md, "Engine bindings").
GOOD = f"good {TOKEN} engines=good-*,fenced-victim"
# Generous: the server idles at ~50 MiB; the issue's attacks took it past 1.6 GiB.
RSS_CEILING_MIB = 300.0
# What the well-behaved client must manage while under attack, at the least.
MIN_COMPLETED = 3
# The well-behaved client is a frontend and both its engines on one token,
# as fast as the server answers: ~1,400 calls a second here, past one
# identity's default share (max_calls_per_s_per_identity, 1,000). The tests
# of other limits raise it; item 11's test keeps the defaults.
UNPACED = ("--max-calls-per-s-per-identity", "100000")


@pytest.fixture
async def served(tmp_path: Path) -> AsyncIterator[Served]:
    tokens = tmp_path / "tokens"
    tokens.write_text(f"{GOOD}\nattacker {ATTACKER} engines=bomber-*,flooder-*\n")
    async with serving(tmp_path, "--token-file", str(tokens), *UNPACED) as served:
        yield served


def assert_unharmed(client: WellBehaved, served: Served) -> None:
    assert not client.errors, f"the well-behaved client failed: {dict(client.errors)}"
    assert client.completed >= MIN_COMPLETED, f"only {client.completed} handoffs completed"
    assert served.rss_mib() < RSS_CEILING_MIB
    log = served.log_text()
    assert "Traceback" not in log, log[-4000:]
    assert " ERROR " not in log, log[-4000:]


def bomb(reports: int) -> pb.ConnectRequest:
    """One message of ``reports`` empty reports: ~2 bytes each on the wire."""
    message = pb.ConnectRequest()
    for _ in range(reports):
        message.reports.add()
    return message


async def test_connect_report_bombs_are_refused_before_any_report_is_handled(
    served: Served,
) -> None:
    """The issue's bomb: 32,767 empty reports in one 64 KiB message, acks never read."""
    streams = 30
    payload = bomb(32_767)
    assert payload.ByteSize() <= 65_536

    async def requests(engine_id: str) -> AsyncIterator[pb.ConnectRequest]:
        yield pb.ConnectRequest(hello=pb.ConnectHello(engine_id=engine_id, batch=True))
        yield payload
        # Held open, never reading: a write after the refusal would fail on
        # the client's side (INTERNAL), which says nothing about the server.
        await asyncio.Event().wait()

    async with (
        asyncio.timeout(TIMEOUT_S),
        grpc.aio.insecure_channel(served.target) as good,
        grpc.aio.insecure_channel(served.target) as bad,
        alongside(good, bearer(TOKEN)) as client,
    ):
        stub: Stub = pb_grpc.HandoffCoordinatorStub(bad)
        calls = [
            stub.Connect(requests(f"bomber-{n}"), metadata=bearer(ATTACKER)) for n in range(streams)
        ]
        codes = await asyncio.gather(*(call.code() for call in calls))
        rss_after = served.rss_mib()
        assert set(codes) == {grpc.StatusCode.RESOURCE_EXHAUSTED}
        details = await calls[0].details()
        assert details == (
            f"engine bomber-0: a Connect message carries 32767 reports; the limit is "
            f"{MAX_REPORTS_PER_MESSAGE} per message (max_reports_per_message)"
        )
        # The refusal came before any report was handled: no ack was sent.
        with pytest.raises(grpc.aio.AioRpcError):
            await calls[0].read()
        await client.completed_at_least(MIN_COMPLETED)
    assert_unharmed(client, served)
    assert rss_after < RSS_CEILING_MIB


async def test_a_connect_peer_at_the_cap_that_reads_its_acks_does_not_starve_others(
    served: Served,
) -> None:
    """Four streams sending full messages as fast as their acks come back."""
    per_stream = 40  # messages of MAX_REPORTS_PER_MESSAGE reports each
    report = pb.ConnectReport(
        fact=pb.ReportFactRequest(
            handoff_id="00000000-0000-4000-8000-000000000000",
            fact=pb.Fact(timed_out=pb.TimedOut()),
        )
    )

    async def flood(stub: Stub, engine_id: str) -> int:
        sent = asyncio.Semaphore(2)  # two messages in flight at most: it reads its acks

        async def requests() -> AsyncIterator[pb.ConnectRequest]:
            yield pb.ConnectRequest(hello=pb.ConnectHello(engine_id=engine_id, batch=True))
            for number in range(per_stream):
                await sent.acquire()
                message = pb.ConnectRequest()
                for index in range(MAX_REPORTS_PER_MESSAGE):
                    added = message.reports.add(request_id=number * 1000 + index)
                    added.CopyFrom(report)
                yield message

        acks = 0
        call = stub.Connect(requests(), metadata=bearer(ATTACKER))
        async for response in call:
            acks += len(response.acks)
            if acks % MAX_REPORTS_PER_MESSAGE == 0:
                sent.release()
            if acks == per_stream * MAX_REPORTS_PER_MESSAGE:
                call.cancel()
        return acks

    async with (
        asyncio.timeout(TIMEOUT_S),
        grpc.aio.insecure_channel(served.target) as good,
        grpc.aio.insecure_channel(served.target) as bad,
        alongside(good, bearer(TOKEN)) as client,
    ):
        stub: Stub = pb_grpc.HandoffCoordinatorStub(bad)
        floods = [asyncio.create_task(flood(stub, f"flooder-{n}")) for n in range(4)]
        await client.completed_at_least(MIN_COMPLETED)
        for task in floods:
            task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.gather(*floods, return_exceptions=True)
    assert_unharmed(client, served)


async def silent_check(channel: grpc.aio.Channel) -> grpc.StatusCode:
    """A health Check that sends its headers and never its request."""

    async def nothing() -> AsyncIterator[health_pb2.HealthCheckRequest]:
        await asyncio.Event().wait()
        yield health_pb2.HealthCheckRequest()  # pragma: no cover (never reached)

    call = channel.stream_unary(
        "/grpc.health.v1.Health/Check",
        request_serializer=health_pb2.HealthCheckRequest.SerializeToString,
        response_deserializer=health_pb2.HealthCheckResponse.FromString,
    )(nothing())
    return await call.code()


async def health_stream_flood(target: str) -> tuple[list[str], list[str]]:
    """4 connections of 150 Watch streams and 150 Checks that never send
    their request, all without a token: the codes the Watches and the Checks
    ended with (run :func:`elsewhere`)."""
    connections, per_connection = 4, 150
    own = ("grpc.use_local_subchannel_pool", 1)
    async with contextlib.AsyncExitStack() as stack:
        channels = [
            await stack.enter_async_context(grpc.aio.insecure_channel(target, options=[own]))
            for _ in range(connections)
        ]
        watches = [
            health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest())
            for channel in channels
            for _ in range(per_connection)
        ]
        checks = [
            asyncio.create_task(silent_check(channel))
            for channel in channels
            for _ in range(per_connection)
        ]
        watch_codes = await asyncio.gather(*(call.code() for call in watches))
        check_codes = await asyncio.gather(*checks)
    return [code.name for code in watch_codes], [code.name for code in check_codes]


async def test_unauthenticated_health_streams_take_none_of_the_service_s_calls(
    tmp_path: Path,
) -> None:
    """600 Watch streams and 600 Checks that never send their request, all
    without a token, on the gRPC port of a server taking 200 calls: were they
    the service's calls, the well-behaved client's would be refused.

    (The flood is sized from the limit, not to load the server: 4,000 calls
    against the default 10,000 proved nothing and, on a loaded machine, kept
    the well-behaved client's calls queued in gRPC behind them past its 5 s.)"""
    tokens = tmp_path / "tokens"
    tokens.write_text(f"{GOOD}\n{ATTACKER}\n")
    flags = (
        *("--token-file", str(tokens), "--max-concurrent-rpcs", "200", "--max-engines", "50"),
        *UNPACED,
    )
    async with (
        asyncio.timeout(TIMEOUT_S),
        serving(tmp_path, *flags) as served,
        grpc.aio.insecure_channel(served.target) as good,
        alongside(good, bearer(TOKEN)) as client,
    ):
        async with attacker() as attack:
            watch_codes, check_codes = await attack(health_stream_flood, served.target)
        # Refused without the request being parsed; the client sometimes sees
        # the stream's reset (CANCELLED) before the refusal. Never served.
        assert set(watch_codes) <= {"UNAUTHENTICATED", "CANCELLED"}
        assert watch_codes.count("UNAUTHENTICATED") > len(watch_codes) // 2
        # Each silent Check is ended after health_request_within_s, or at
        # once for a newer one when half the checks' budget is waiting (or
        # reset, as above).
        assert set(check_codes) <= {"DEADLINE_EXCEEDED", "RESOURCE_EXHAUSTED", "CANCELLED"}
        assert "DEADLINE_EXCEEDED" in check_codes
        await client.completed_at_least(MIN_COMPLETED)
        assert_unharmed(client, served)


async def test_watch_streams_on_the_health_port_never_fail_a_probe(served: Served) -> None:
    """The issue's 64 Watch streams on the plaintext health port, then `handoff health`.

    The health port takes 8 calls per connection, so the 64 come over 8 connections.
    """
    health_target = f"127.0.0.1:{served.health_port}"
    own = ("grpc.use_local_subchannel_pool", 1)
    async with (
        asyncio.timeout(TIMEOUT_S),
        contextlib.AsyncExitStack() as stack,
        grpc.aio.insecure_channel(served.target) as good,
        alongside(good, bearer(TOKEN)) as client,
    ):
        channels = [
            await stack.enter_async_context(grpc.aio.insecure_channel(health_target, options=[own]))
            for _ in range(8)
        ]
        watches = [
            health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest())
            for channel in channels
            for _ in range(8)
        ]
        codes = await asyncio.gather(*(_first_or_code(call) for call in watches))
        assert codes.count(grpc.StatusCode.OK) == 16  # max_health_watches, held open
        assert codes.count(grpc.StatusCode.RESOURCE_EXHAUSTED) == 48
        probe = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "handoff_server.commands.cli",
            "health",
            "--target",
            health_target,
            stdout=asyncio.subprocess.PIPE,
        )
        output, _ = await probe.communicate()
        assert probe.returncode == 0, output
        assert b"is SERVING" in output
        await client.completed_at_least(MIN_COMPLETED)
        for call in watches:
            call.cancel()
    assert_unharmed(client, served)


async def _first_or_code(call: grpc.aio.UnaryStreamCall[object, object]) -> grpc.StatusCode:
    """OK once the stream's first answer arrived (it stays open), else its status."""
    try:
        await call.read()
    except grpc.aio.AioRpcError as error:
        return error.code()
    return grpc.StatusCode.OK


@pytest.fixture
async def strict(tmp_path: Path) -> AsyncIterator[Served]:
    """Named tokens, and per-identity limits low enough to reach in a few seconds."""
    tokens = tmp_path / "tokens"
    tokens.write_text(f"{GOOD}\nflood {ATTACKER} start,engine,report\n")
    flags = (
        *("--token-file", str(tokens)),
        *("--max-starts-per-s-per-identity", "100"),
        *("--max-active-handoffs-per-identity", "300"),
        *("--max-calls-per-identity", "50"),
        *UNPACED,
    )
    async with serving(tmp_path, *flags) as served:
        yield served


async def test_a_start_handoff_flood_hits_its_own_limits_and_nobody_else_s(
    strict: Served,
) -> None:
    """One token holder starts handoffs as fast as it can (never finishing
    them); the other's StartHandoff is never refused."""
    flood_size, in_flight = 2000, 40
    codes: Counter[str] = Counter()
    details: set[str] = set()

    async def flood(stub: Stub) -> None:
        for _ in range(flood_size // in_flight):
            request = start_request("flood-src", "flood-dst")
            try:
                await stub.StartHandoff(request, metadata=bearer(ATTACKER))
                codes["OK"] += 1
            except grpc.aio.AioRpcError as error:
                codes[error.code().name] += 1
                details.add(error.details() or "")

    async with (
        asyncio.timeout(TIMEOUT_S),
        grpc.aio.insecure_channel(strict.target) as good,
        grpc.aio.insecure_channel(strict.target) as bad,
        alongside(good, bearer(TOKEN)) as client,
    ):
        stub: Stub = pb_grpc.HandoffCoordinatorStub(bad)
        await asyncio.gather(*(flood(stub) for _ in range(in_flight)))
        await client.completed_at_least(MIN_COMPLETED)
    assert codes["OK"] <= 300  # max_active_handoffs_per_identity: none of them completes
    assert codes["RESOURCE_EXHAUSTED"] == flood_size - codes["OK"]
    assert details <= {
        "token flood starts more than 100 handoffs per second, the limit per identity "
        "(max_starts_per_s_per_identity)",
        "token flood has 300 active handoffs, the limit per identity "
        "(max_active_handoffs_per_identity)",
    }
    assert_unharmed(client, strict)


async def test_idle_connections_to_metrics_start_no_threads_and_never_lock_out_a_scrape(
    served: Served,
) -> None:
    """The issue's 600 idle connections to /metrics, then a scrape."""
    threads_before = served.threads()
    async with (
        asyncio.timeout(TIMEOUT_S),
        grpc.aio.insecure_channel(served.target) as good,
        alongside(good, bearer(TOKEN)) as client,
    ):
        idle = [await asyncio.open_connection("127.0.0.1", served.metrics_port) for _ in range(600)]
        # Half a request each, never finished.
        for _, writer in idle:
            writer.write(b"GET /metrics HTTP/1.1\r\n")
        await asyncio.gather(*(writer.drain() for _, writer in idle), return_exceptions=True)
        assert served.threads() <= threads_before + 2  # the rendering pool, at most
        reader, writer = await asyncio.open_connection("127.0.0.1", served.metrics_port)
        writer.write(b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        answer = await reader.read()
        assert answer.startswith(b"HTTP/1.1 200 OK\r\n")
        assert b"handoff_started_total" in answer
        writer.close()
        await client.completed_at_least(MIN_COMPLETED)
        for _, held in idle:
            held.close()
    assert_unharmed(client, served)


# --- issue 27 ------------------------------------------------------------------


async def probe_latencies(target: str, until: asyncio.Event, latencies: list[float]) -> None:
    """Health Check round trips on ``target``, one after another, until ``until``."""
    loop = asyncio.get_running_loop()
    async with grpc.aio.insecure_channel(target) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while not until.is_set():
            began = loop.time()
            await stub.Check(health_pb2.HealthCheckRequest(), timeout=5.0)
            latencies.append(loop.time() - began)
            await asyncio.sleep(0.01)


def journal_backlog(state_dir: Path, handoffs: int) -> None:
    """A journal of ``handoffs`` unfinished handoffs from engine ``crashing`` to
    ``gone``, each with its first action written to the engine: what a
    coordinator restarted after a crash of both holds (both are lost, with
    their backlog, a delivery timeout after it recovers)."""
    journal = Journal.open(state_dir)
    clock = ReplayClock(time.time)
    registry = Registry(Settings(default_timeout_s=600.0), Metrics(), clock)
    recover(journal, registry, clock)
    registry.recorder = JournalRecorder(journal)
    streams = [registry.subscribe(engine_id, lambda: None) for engine_id in ("crashing", "gone")]
    for number in range(handoffs):
        registry.start(
            StartRequest(f"backlog-{number}", Order.SOURCE_FIRST, "crashing", "gone", 1.0)
        )
        if number % 1000 == 999:
            for stream in streams:
                while registry.delivery.take(stream):
                    pass  # written to the engine's stream (and journaled so)
            journal.commit_now()
    journal.commit_now()
    journal.close_now()


async def test_an_engine_lost_with_20000_handoffs_never_stalls_health(tmp_path: Path) -> None:
    """Item 4: two engines with a backlog of 20,000 handoffs are gone; while
    their losses are reported (one line each), health answers within 100 ms
    (95 % of its answers; on a loaded machine, within twice what they took just
    before), none in more than a second, and the well-behaved client keeps
    completing handoffs."""
    state = tmp_path / "state"
    await asyncio.to_thread(journal_backlog, state, 20_000)
    flags = ("--state-dir", str(state), "--delivery-timeout-s", "3")
    loop = asyncio.get_running_loop()
    async with (
        asyncio.timeout(TIMEOUT_S),
        serving(tmp_path, *flags) as served,
        grpc.aio.insecure_channel(served.target) as good,
        alongside(good) as client,
    ):
        done = asyncio.Event()
        latencies: list[float] = []
        probes = asyncio.create_task(
            probe_latencies(f"127.0.0.1:{served.health_port}", done, latencies)
        )
        await client.completed_at_least(MIN_COMPLETED)
        before = await rate(client, 1.0)
        # The server announces nothing as it loses engines: its own counts say.
        while not await metric(served, "handoff_engines_lost_total"):  # noqa: ASYNC110
            await asyncio.sleep(0.02)
        probed, began, completed = len(latencies), loop.time(), client.completed
        while await metric(served, 'handoff_handoffs{phase="active"}') > 1:  # noqa: ASYNC110
            await asyncio.sleep(0.05)
        during = (client.completed - completed) / (loop.time() - began)
        done.set()
        await probes
        assert await_lost(served) == 2
        # The issue's stall was 20 s: three probes failed in a row. A loaded
        # machine slows every answer, so the bound is relative to its own before.
        assert max(latencies[probed:]) < 1.0, max(latencies[probed:])
        assert p95(latencies[probed:]) < max(0.1, 2 * p95(latencies[:probed])), latencies
        # Reporting 40,000 losses is real work, given half the loop at most (the
        # server's timer loop): the client keeps going at a lower rate, never stops.
        assert during >= 0.25 * before, (during, before)
        assert_unharmed(client, served)


def p95(values: list[float]) -> float:
    return sorted(values)[int(len(values) * 0.95)]


def await_lost(served: Served) -> int:
    """How many summary lines of a lost engine the server logged."""
    return served.log_text().count("engine lost (no live stream for 3.0 s)")


VALID_PARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


async def test_trace_context_kept_with_a_handoff_is_bounded_and_valid(tmp_path: Path) -> None:
    """Item 2: starts carrying a 6 KiB tracestate, or a malformed traceparent:
    each handoff starts, and keeps only a valid traceparent and a tracestate
    of at most 512 bytes (the rest dropped, counted)."""
    state = tmp_path / "state"
    oversized = "vendor=" + "x" * 6000
    headers = [
        (("traceparent", VALID_PARENT), ("tracestate", oversized)),
        (("traceparent", VALID_PARENT.upper()), ("tracestate", "a=b")),
        (("traceparent", "00-" + "0" * 32 + "-b7ad6b7169203331-01"), ("tracestate", "a=b")),
        (("traceparent", "garbage" * 100),),
    ]
    starts = 100  # paced: a flood's share of the server is item 11's
    async with (
        asyncio.timeout(TIMEOUT_S),
        serving(tmp_path, "--state-dir", str(state)) as served,
        grpc.aio.insecure_channel(served.target) as good,
        grpc.aio.insecure_channel(served.target) as bad,
        alongside(good) as client,
    ):
        await client.completed_at_least(MIN_COMPLETED)
        before = await rate(client, 1.0)
        stub: Stub = pb_grpc.HandoffCoordinatorStub(bad)
        loop = asyncio.get_running_loop()
        began, completed = loop.time(), client.completed
        for number in range(starts):
            metadata = headers[number % len(headers)]
            await stub.StartHandoff(start_request("t-src", "t-dst"), metadata=metadata)
            await asyncio.sleep(0.02)  # pacing the attack, not waiting for an event
        await stub.StartHandoff(
            start_request("t-src", "t-dst"),
            metadata=(("traceparent", VALID_PARENT), ("tracestate", "k=" + "v" * 500)),
        )
        during = (client.completed - completed) / (loop.time() - began)
        dropped_parents = await metric(
            served, 'handoff_trace_context_dropped_total{header="traceparent"}'
        )
        dropped_states = await metric(
            served, 'handoff_trace_context_dropped_total{header="tracestate"}'
        )
        assert dropped_parents == starts // 4 * 3  # upper case, all-zero trace id, garbage
        assert dropped_states == starts // 4 * 3  # oversized; without a valid traceparent
        # The paced starts come from this test's own event loop, beside the
        # well-behaved client, on a 2-core machine: a fresh clone's CI saw
        # 0.88 of the rate. The issue's 0.9 for floods is item 11's (fair
        # shares), not this item's, whose point is what the server keeps.
        assert during >= 0.75 * before, (during, before)
        assert_unharmed(client, served)
    journal = b"".join(path.read_bytes() for path in state.iterdir() if path.is_file())
    assert b"x" * 600 not in journal
    assert b"garbage" not in journal
    assert b"v" * 500 in journal  # 502 bytes: kept


async def test_an_engine_token_cannot_report_over_connect(tmp_path: Path) -> None:
    """Item 9: the Canceled fact ReportFact refuses an engine-only token is
    refused the same way inside a Connect message, and the handoff goes on."""
    tokens = tmp_path / "tokens"
    tokens.write_text(f"{GOOD}\nengine-only {ATTACKER} engine engines=victim-src\n")
    async with (
        asyncio.timeout(TIMEOUT_S),
        serving(tmp_path, "--token-file", str(tokens), *UNPACED) as served,
        grpc.aio.insecure_channel(served.target) as good,
        grpc.aio.insecure_channel(served.target) as bad,
        alongside(good, bearer(TOKEN)) as client,
    ):
        await client.completed_at_least(MIN_COMPLETED)
        good_stub: Stub = pb_grpc.HandoffCoordinatorStub(good)
        started = await good_stub.StartHandoff(
            start_request("victim-src", "victim-dst"), metadata=bearer(TOKEN)
        )
        handoff_id = started.handoff.handoff_id
        cancel = pb.ReportFactRequest(handoff_id=handoff_id, fact=pb.Fact(canceled=pb.Canceled()))
        stub: Stub = pb_grpc.HandoffCoordinatorStub(bad)
        with pytest.raises(grpc.aio.AioRpcError) as unary:
            await stub.ReportFact(cancel, metadata=bearer(ATTACKER))
        assert unary.value.code() == grpc.StatusCode.PERMISSION_DENIED

        async def requests() -> AsyncIterator[pb.ConnectRequest]:
            yield pb.ConnectRequest(hello=pb.ConnectHello(engine_id="victim-src", batch=True))
            yield pb.ConnectRequest(reports=[pb.ConnectReport(request_id=1, fact=cancel)])
            await asyncio.Event().wait()

        call = stub.Connect(requests(), metadata=bearer(ATTACKER))
        async for response in call:
            if response.acks:
                break
        call.cancel()
        (ack,) = response.acks
        assert ack.code == grpc.StatusCode.PERMISSION_DENIED.value[0]
        assert ack.message == (
            f"handoff {handoff_id}, fact canceled: "
            "token engine-only may not call ReportFact (its scopes: engine)"
        )
        handoff = (
            await good_stub.GetHandoff(
                pb.GetHandoffRequest(handoff_id=handoff_id), metadata=bearer(TOKEN)
            )
        ).handoff
        assert handoff.phase == pb.PHASE_ACTIVE
        assert_unharmed(client, served)


async def serve_exit(state: Path) -> tuple[int, str]:
    """A second `handoff serve` on ``state``: its exit code and output."""
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "handoff_server.commands.cli",
        "serve",
        *("--host", "127.0.0.1", "--port", "0", "--metrics-port", "0"),
        *("--state-dir", str(state)),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    output, _ = await process.communicate()
    assert process.returncode is not None
    return process.returncode, output.decode()


async def test_the_state_dir_is_private_and_held_by_one_server(tmp_path: Path) -> None:
    """Item 10: the state dir is 0700 and its files 0600; with its lock file
    deleted a second server is still refused; a planted `lock` symlink is
    not followed (its target is untouched) and the server says why."""
    state = tmp_path / "state"
    async with (
        asyncio.timeout(TIMEOUT_S),
        serving(tmp_path, "--state-dir", str(state)) as served,
        grpc.aio.insecure_channel(served.target) as good,
        alongside(good) as client,
    ):
        await client.completed_at_least(MIN_COMPLETED)
        assert stat.S_IMODE(state.stat().st_mode) == 0o700
        modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in state.iterdir()}
        assert set(modes.values()) == {0o600}, modes
        (state / "lock").unlink()
        code, output = await serve_exit(state)
        assert code == 2, output
        assert "is in use by another handoff server" in output
        await client.completed_at_least(client.completed + MIN_COMPLETED)
        assert_unharmed(client, served)
    planted = tmp_path / "planted"
    planted.mkdir()
    target = tmp_path / "precious"
    target.write_text("keep me\n")
    (planted / "lock").symlink_to(target)
    code, output = await serve_exit(planted)
    assert code == 2, output
    assert f"{planted / 'lock'}: not a regular file the server may write" in output
    assert target.read_text() == "keep me\n"


async def test_a_client_certificate_without_a_san_has_its_own_quota(tmp_path: Path) -> None:
    """Item 8: under mutual TLS, a certificate with no DNS or URI SAN is
    identified by its SHA-256 fingerprint, so the per-identity start rate
    applies to it as to any caller; the frontend with a SAN, starting within
    the same limit meanwhile, is never refused. (The well-behaved client of
    the other tests would exceed a limit this low on its own.)"""
    pki = make_pki(tmp_path)
    bare = pki.ca.issue("no-san")
    fingerprint = hashlib.sha256(ssl.PEM_cert_to_DER_cert(bare.cert.decode())).hexdigest()
    flags = (
        *("--tls-cert", str(pki.server.cert_path), "--tls-key", str(pki.server.key_path)),
        *("--tls-client-ca", str(pki.ca.cert_path)),
        *("--max-starts-per-s-per-identity", "20"),
    )
    codes: Counter[str] = Counter()
    details: set[str] = set()

    async def flood(stub: Stub) -> None:
        for _ in range(100):
            try:
                await stub.StartHandoff(start_request("bare-src", "bare-dst"))
                codes["OK"] += 1
            except grpc.aio.AioRpcError as error:
                codes[error.code().name] += 1
                details.add(error.details() or "")

    async def frontend(stub: Stub) -> int:
        for _ in range(10):
            await stub.StartHandoff(start_request("good-src", "good-dst"))
            await asyncio.sleep(0.1)  # 10 starts a second: within its limit
        return 10

    async with (
        asyncio.timeout(TIMEOUT_S),
        serving(tmp_path, *flags) as served,
        secure_channel(served.port, pki.ca.cert, pki.client) as good,
        secure_channel(served.port, pki.ca.cert, bare) as bad,
    ):
        started, _ = await asyncio.gather(
            frontend(pb_grpc.HandoffCoordinatorStub(good)),
            flood(pb_grpc.HandoffCoordinatorStub(bad)),
        )
        assert started == 10
        assert 20 <= codes["OK"] <= 45, codes  # a second's burst, then 20 a second
        assert codes["RESOURCE_EXHAUSTED"] == 100 - codes["OK"]
        assert details == {
            f"certificate sha256:{fingerprint} starts more than 20 handoffs per second, "
            "the limit per identity (max_starts_per_s_per_identity)"
        }
        assert served.rss_mib() < RSS_CEILING_MIB
        log = served.log_text()
        assert "Traceback" not in log
        assert " ERROR " not in log


async def header_only(channel: grpc.aio.Channel, method: str, metadata: Metadata) -> grpc.aio.Call:
    """A unary call that sends its headers and never its message."""

    async def nothing() -> AsyncIterator[health_pb2.HealthCheckRequest]:
        await asyncio.Event().wait()
        yield health_pb2.HealthCheckRequest()  # pragma: no cover (never reached)

    # Whatever the method, nothing is ever serialized or answered.
    call = channel.stream_unary(
        method,
        request_serializer=health_pb2.HealthCheckRequest.SerializeToString,
        response_deserializer=health_pb2.HealthCheckResponse.FromString,
    )
    return call(nothing(), metadata=metadata)


async def slowloris(
    channel: grpc.aio.Channel,
    method: str,
    calls: int,
    until: asyncio.Event,
    ended: Counter[tuple[str, str]],
    metadata: Metadata = (),
) -> None:
    """``calls`` header-only calls held open, each renewed 0.9 s after it
    began or when it ends, whichever is later (the issue's attack)."""

    async def one() -> None:
        loop = asyncio.get_running_loop()
        while not until.is_set():
            began = loop.time()
            call = await header_only(channel, method, metadata)
            code = await call.code()
            ended[(code.name, await call.details() or "")] += 1
            await asyncio.sleep(max(0.0, began + 0.9 - loop.time()))  # the attack's pace

    await asyncio.gather(*(one() for _ in range(calls)))


async def probes_answer(target: str, until: asyncio.Event, codes: Counter[str]) -> None:
    """Health Check after health Check on ``target`` (a connection of its own),
    as a kubelet probes, until ``until``; each answer's code counted."""
    async with grpc.aio.insecure_channel(target, options=[OWN_CONNECTION]) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while not until.is_set():
            try:
                await stub.Check(health_pb2.HealthCheckRequest(), timeout=2.0)
                codes["OK"] += 1
            except grpc.aio.AioRpcError as error:
                codes[error.code().name] += 1
            await asyncio.sleep(0.05)  # a probe's period, not a wait for an event


OWN_CONNECTION = ("grpc.use_local_subchannel_pool", 1)


async def header_only_crowd(
    target: str, health_target: str, seconds: float
) -> Counter[tuple[str, str]]:
    """For ``seconds``: the read-only token's 60 header-only GetShardMap
    calls over 2 connections, and tokenless header-only health Checks, 64 on
    each port over 8 connections (the health port takes 8 calls per
    connection); how their calls ended, by code and message (run
    :func:`elsewhere`)."""
    ended: Counter[tuple[str, str]] = Counter()
    until = asyncio.Event()
    shard_map = "/handoff.v1.HandoffCoordinator/GetShardMap"
    check = "/grpc.health.v1.Health/Check"
    async with contextlib.AsyncExitStack() as stack:

        async def connection(to: str) -> grpc.aio.Channel:
            channel = grpc.aio.insecure_channel(to, options=[OWN_CONNECTION])
            return await stack.enter_async_context(channel)

        attacks = [
            *[
                slowloris(await connection(target), shard_map, 30, until, ended, bearer(ATTACKER))
                for _ in range(2)
            ],
            *[slowloris(await connection(target), check, 8, until, ended) for _ in range(8)],
            *[slowloris(await connection(health_target), check, 8, until, ended) for _ in range(8)],
        ]
        running = [asyncio.create_task(attack) for attack in attacks]
        await asyncio.sleep(seconds)  # the attack's length, not a wait for an event
        until.set()
        await asyncio.gather(*running)
    return ended


async def test_calls_without_their_message_are_counted_when_they_arrive(tmp_path: Path) -> None:
    """Items 1 and 7: a read-only token holds 60 GetShardMap calls that send
    headers and no message, and tokenless callers hold 64 such health Checks
    on each port, renewed every 0.9 s. The token's calls count against its own
    limit from their arrival and end after request_within_s; the health
    checks waiting for a request hold half their budget at most (a new arrival
    ends the oldest); every probe on either port is answered SERVING, and the
    well-behaved client keeps going (at half its rate at least)."""
    tokens = tmp_path / "tokens"
    tokens.write_text(f"{GOOD}\nreader {ATTACKER} read\n")
    flags = (
        *("--token-file", str(tokens)),
        *("--max-calls-per-identity", "50"),
        *("--request-within-s", "1"),
        *UNPACED,
    )
    probed: Counter[str] = Counter()
    until = asyncio.Event()
    async with (
        asyncio.timeout(TIMEOUT_S),
        serving(tmp_path, *flags) as served,
        contextlib.AsyncExitStack() as stack,
        grpc.aio.insecure_channel(served.target) as good,
        alongside(good, bearer(TOKEN)) as client,
    ):
        health_target = f"127.0.0.1:{served.health_port}"
        attack = await stack.enter_async_context(attacker())
        await client.completed_at_least(MIN_COMPLETED)
        before = await rate(client, 1.0)
        loop = asyncio.get_running_loop()
        began, completed = loop.time(), client.completed
        probes = [
            asyncio.create_task(probes_answer(target, until, probed))
            for target in (served.target, health_target)
        ]
        ended = await attack(header_only_crowd, served.target, health_target, 3.0)
        rss_after = served.rss_mib()
        during = (client.completed - completed) / (loop.time() - began)
        until.set()
        await asyncio.gather(*probes)
        assert set(probed) == {"OK"}, probed
        assert probed["OK"] >= 20, probed
        # Not the issue's 90 %: each header-only call still costs the server
        # a call's setup and end (~200 a second here, on the client's 2
        # cores); sharing the server fairly between identities is item 11's.
        assert during >= 0.5 * before, (during, before)
        assert rss_after < RSS_CEILING_MIB
        assert_unharmed(client, served)
    details = {detail for _, detail in ended}
    assert (
        "RESOURCE_EXHAUSTED",
        "token reader has 50 calls waiting for their first message or their turn, the limit per "
        "identity (max_calls_per_identity)",
    ) in ended, details
    assert ("DEADLINE_EXCEEDED", "GetShardMap: no request within 1 s (request_within_s)") in ended
    assert (
        "RESOURCE_EXHAUSTED",
        "16 health checks were waiting for their first message, half the limit "
        "(max_health_checks): the oldest is ended to admit a new one",
    ) in ended, details
    # The health port takes 8 streams per connection, the crowd's 8 there are
    # renewed as each ends, and gRPC's core counts an ended stream until it is
    # done with it: a renewal may come first and be refused by the transport
    # itself (REFUSED_STREAM: in 3 of 6 runs beside a busy loop, once in CI).
    refused_stream = "Stream removed (RST_STREAM (Received RST_STREAM with error code 7))"
    assert {
        (code, detail)
        for code, detail in ended
        if code not in ("RESOURCE_EXHAUSTED", "DEADLINE_EXCEEDED")
    } <= {("UNAVAILABLE", refused_stream)}, details


async def test_one_identity_cannot_take_every_engine_slot(tmp_path: Path) -> None:
    """Item 6: one token subscribes as engine after engine; past
    max_engines_per_identity it is refused, while another identity's new
    engine is admitted (the server-wide max_engines is far from reached)."""
    tokens = tmp_path / "tokens"
    tokens.write_text(f"{GOOD}\nhoarder {ATTACKER} engine engines=hoarded-*\n")
    flags = ("--token-file", str(tokens), "--max-engines-per-identity", "5", *UNPACED)
    async with (
        asyncio.timeout(TIMEOUT_S),
        serving(tmp_path, *flags) as served,
        grpc.aio.insecure_channel(served.target) as good,
        grpc.aio.insecure_channel(served.target) as bad,
        alongside(good, bearer(TOKEN)) as client,
    ):
        await client.completed_at_least(MIN_COMPLETED)
        stub: Stub = pb_grpc.HandoffCoordinatorStub(bad)
        held = []
        for number in range(5):
            stream = stub.StreamActions(
                pb.StreamActionsRequest(engine_id=f"hoarded-{number}"), metadata=bearer(ATTACKER)
            )
            await stream.initial_metadata()
            held.append(stream)
        refused = stub.StreamActions(
            pb.StreamActionsRequest(engine_id="hoarded-5"), metadata=bearer(ATTACKER)
        )
        assert await refused.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert await refused.details() == (
            "engine hoarded-5: token hoarder has 5 engines with a live stream, the limit "
            "per identity (max_engines_per_identity)"
        )
        newcomer = pb_grpc.HandoffCoordinatorStub(good).StreamActions(
            pb.StreamActionsRequest(engine_id="good-newcomer"), metadata=bearer(TOKEN)
        )
        await newcomer.initial_metadata()
        await client.completed_at_least(client.completed + MIN_COMPLETED)
        for stream in (*held, newcomer):
            stream.cancel()
        assert_unharmed(client, served)


async def test_an_incarnation_dated_in_the_future_fences_nobody_out(served: Served) -> None:
    """Item 5 (the incarnation): a stream naming the well-behaved client's
    engine with incarnation 9999999999999-zzzz (year 2286) would have fenced
    the real engine out until a restart; it is refused, and the real engine,
    resubscribing with its own incarnation, is not fenced. The forger holds
    the engine's own token (a buggy or stolen sidecar): another identity's
    stream is refused before its incarnation is looked at (the next test)."""
    real = f"{time.time_ns() // 1_000_000:013d}-real"
    async with (
        asyncio.timeout(TIMEOUT_S),
        grpc.aio.insecure_channel(served.target) as good,
        grpc.aio.insecure_channel(served.target) as bad,
        alongside(good, bearer(TOKEN)) as client,
    ):
        await client.completed_at_least(MIN_COMPLETED)
        good_stub: Stub = pb_grpc.HandoffCoordinatorStub(good)
        engine = pb.StreamActionsRequest(engine_id="fenced-victim", incarnation=real)
        first = good_stub.StreamActions(engine, metadata=bearer(TOKEN))
        await first.initial_metadata()
        forged = pb_grpc.HandoffCoordinatorStub(bad).StreamActions(
            pb.StreamActionsRequest(engine_id="fenced-victim", incarnation="9999999999999-zzzz"),
            metadata=bearer(TOKEN),
        )
        assert await forged.code() == grpc.StatusCode.INVALID_ARGUMENT
        details = await forged.details() or ""
        assert "incarnation 9999999999999-zzzz starts" in details, details
        assert "ahead of the coordinator's clock, more than 300 s" in details
        again = good_stub.StreamActions(engine, metadata=bearer(TOKEN))
        await again.initial_metadata()  # the same incarnation: a reconnect, not fenced
        again.cancel()
        first.cancel()
        await client.completed_at_least(client.completed + MIN_COMPLETED)
        assert_unharmed(client, served)


@pytest.fixture
def volume(tmp_path: Path) -> Iterator[Path]:
    """A real 64 MiB file system (tmpfs) for a state dir to fill: the
    smallest reserve (32 MiB) and the journal beside it."""
    with small_volume(tmp_path / "volume", 64) as mounted:
        yield mounted


async def test_a_filling_volume_refuses_new_handoffs_and_lets_the_others_end(
    tmp_path: Path, volume: Path
) -> None:
    """Item 3: the state dir's volume fills to below --journal-reserve-mib
    with 20 handoffs in flight. A new start is refused (RESOURCE_EXHAUSTED,
    naming the handoff, --state-dir and the fix) while the 20 are still
    reported to their end; once the space is back, the well-behaved client
    completes handoffs again; no CRITICAL exit. Then, on a volume full to the
    last byte, `handoff serve` exits 2 with one line, not a traceback.
    (The client's own starts are refused meanwhile, as anyone's: that is the
    refusal, so it runs before and after, not during.)"""
    state = volume / "state"
    flags = ("--state-dir", str(state), "--journal-reserve-mib", "32")
    async with (
        asyncio.timeout(TIMEOUT_S),
        serving(tmp_path, *flags) as served,
        grpc.aio.insecure_channel(served.target) as good,
    ):
        async with alongside(good) as client:
            await client.completed_at_least(MIN_COMPLETED)
        stub: Stub = pb_grpc.HandoffCoordinatorStub(good)
        async with engine_streams(stub, ("fill-src", "fill-dst")):
            in_flight = [
                (await stub.StartHandoff(start_request("fill-src", "fill-dst"))).handoff.handoff_id
                for _ in range(20)
            ]
            filler = fill(volume, leave_bytes=4 * 2**20)
            request = start_request("fill-src", "fill-dst")
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await stub.StartHandoff(request)
            assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            details = refused.value.details() or ""
            assert details.startswith(
                f"handoff {request.handoff_id}: the journal's volume (--state-dir {state}) has "
            ), details
            assert details.endswith(
                " MiB left for the journal, less than the 32 MiB reserve (journal_reserve_mib): "
                "new handoffs are refused so the ones in flight can still be journaled to their "
                "end; free space on that volume or grow it (handoffs that end and leave "
                "retention free room in the journal too)"
            ), details
            ended = await asyncio.gather(*(finish(stub, handoff) for handoff in in_flight))
            assert {handoff.completion for handoff in ended} == {pb.COMPLETION_SUCCESS}
            filler.unlink()
        async with alongside(good) as client:
            await client.completed_at_least(MIN_COMPLETED)
        assert_unharmed(client, served)
        assert "CRITICAL" not in served.log_text()
    assert served.process.returncode == 0
    fill(volume)
    code, output = await serve_exit(state)
    assert code == 2, output
    (line,) = output.strip().splitlines()
    assert (
        f"cannot start: --state-dir {state}: its volume is full (0.0 MiB free of 64.0 MiB), "
        "so the journal cannot be written: free space on that volume or grow it, then start "
        "again (the journal is kept as it is, and its handoffs are recovered then)"
    ) in line


async def test_a_journal_held_by_another_process_drains_the_server_without_a_stall(
    tmp_path: Path,
) -> None:
    """Item 10 (the writer): another process opens a write transaction on the
    journal and keeps it. Health keeps answering at once (the issue's loop
    stalled 5 s); after --journal-busy-timeout-s the server says who holds
    the journal, naming --state-dir, drains and exits 1, with no CRITICAL and
    no traceback; restarted once the holder is gone, it recovers every
    handoff the well-behaved client completed."""
    state = tmp_path / "state"
    flags = ("--state-dir", str(state), "--journal-busy-timeout-s", "1")
    done = asyncio.Event()
    latencies: list[float] = []
    async with (
        asyncio.timeout(TIMEOUT_S),
        serving(tmp_path, *flags) as served,
        grpc.aio.insecure_channel(served.target) as good,
        alongside(good) as client,
    ):
        probes = asyncio.create_task(
            probe_latencies(f"127.0.0.1:{served.health_port}", done, latencies)
        )
        await client.completed_at_least(MIN_COMPLETED)
        async with holding(state / "journal.sqlite3") as holder:
            completed, probed = client.completed, len(latencies)
            code = await served.process.wait()
        done.set()
        await asyncio.gather(probes, return_exceptions=True)  # ends as the server does
    assert code == 1
    during = latencies[probed:]
    assert during, latencies
    assert max(during) < 0.5, during
    log = served.log_text()
    assert f"journal commits wait: pid {holder.pid} (" in log, log[-4000:]
    assert f") holds a write transaction on {state / 'journal.sqlite3'}" in log
    assert f"the journal in --state-dir {state} is held by pid {holder.pid} (" in log
    assert "draining the server: stop that process" in log
    assert "draining: " in log
    assert "Traceback" not in log, log[-4000:]
    assert "CRITICAL" not in log, log[-4000:]
    async with asyncio.timeout(TIMEOUT_S), serving(tmp_path, *flags) as again:
        assert await metric(again, "handoff_recovered_handoffs") >= completed
        assert "torn" not in again.log_text()


def incarnation(tag: str, ahead_s: float = 0.0) -> str:
    """An incarnation in the SDK's format: its start in unix milliseconds, then a tag."""
    return f"{round((time.time() + ahead_s) * 1000):013d}-{tag}"


async def hold_open(first: pb.ConnectRequest) -> AsyncIterator[pb.ConnectRequest]:
    yield first
    await asyncio.Event().wait()  # until the call ends


async def refusal(call: grpc.aio.Call) -> tuple[grpc.StatusCode, str]:
    return await call.code(), await call.details() or ""


def victim_start() -> pb.StartHandoffRequest:
    """A handoff from the engine the attacks name to the well-behaved decode."""
    return start_request("fenced-victim", "good-decode")


BARE = "bare-old-format-token-0123"  # a token alone on its line: the older format


@pytest.fixture
async def intruded(tmp_path: Path) -> AsyncIterator[Served]:
    """The well-behaved client's token, the intruder's (bound to intruder-0)
    and a bare one, in the token file ``tmp_path / "tokens"``."""
    tokens = tmp_path / "tokens"
    tokens.write_text(f"{GOOD}\nintruder {ATTACKER} engine,report engines=intruder-0\n{BARE}\n")
    async with serving(tmp_path, "--token-file", str(tokens)) as served:
        yield served


def real_engine() -> pb.StreamActionsRequest:
    """The real engine the attacks name: the well-behaved token's, with its incarnation."""
    return pb.StreamActionsRequest(
        engine_id="fenced-victim", incarnation=incarnation("real"), session_id="real-session"
    )


async def test_a_stream_as_another_engine_is_refused_and_fences_nobody(
    intruded: Served, tmp_path: Path
) -> None:
    """Item 5 (the binding): another identity's StreamActions naming the real
    engine with the issue's incarnation 9999999999999-zzzz, or with a newer
    and plausible one, and its Connect hello, are PERMISSION_DENIED naming
    the token, the engine and the line to change; a bare token (the older
    format, all the shipped default had) acts for no engine, and the server
    said so at start. The real engine is never fenced: its reconnect under
    its own incarnation is admitted and its new handoff reaches it."""
    line = f"on its line of token_file {tmp_path / 'tokens'}"
    real, served = real_engine(), intruded
    async with (
        asyncio.timeout(TIMEOUT_S),
        grpc.aio.insecure_channel(served.target) as good,
        grpc.aio.insecure_channel(served.target) as bad,
        alongside(good, bearer(TOKEN)) as client,
    ):
        await client.completed_at_least(MIN_COMPLETED)
        good_stub: Stub = pb_grpc.HandoffCoordinatorStub(good)
        first = good_stub.StreamActions(real, metadata=bearer(TOKEN))
        await first.initial_metadata()
        stub: Stub = pb_grpc.HandoffCoordinatorStub(bad)
        for forged in ("9999999999999-zzzz", incarnation("newer", ahead_s=1.0)):
            for token, name, its in (
                (ATTACKER, "intruder", "intruder-0"),
                (BARE, "token-3", "none"),
            ):
                request = pb.StreamActionsRequest(engine_id="fenced-victim", incarnation=forged)
                assert await refusal(stub.StreamActions(request, metadata=bearer(token))) == (
                    grpc.StatusCode.PERMISSION_DENIED,
                    f"stream: token {name} may not act for engine fenced-victim (its engines: "
                    f"{its}): add fenced-victim to engines= {line}",
                ), (forged, name)
        hello = pb.ConnectHello(engine_id="fenced-victim", incarnation=incarnation("newer", 1.0))
        connect = stub.Connect(hold_open(pb.ConnectRequest(hello=hello)), metadata=bearer(ATTACKER))
        assert await refusal(connect) == (
            grpc.StatusCode.PERMISSION_DENIED,
            "connect: token intruder may not act for engine fenced-victim (its engines: "
            f"intruder-0): add fenced-victim to engines= {line}",
        )
        again = good_stub.StreamActions(real, metadata=bearer(TOKEN))  # a reconnect
        await again.initial_metadata()
        started = await good_stub.StartHandoff(victim_start(), metadata=bearer(TOKEN))
        submit = await again.read()
        assert isinstance(submit, pb.Action)
        assert (submit.handoff_id, submit.kind) == (
            started.handoff.handoff_id,
            pb.ACTION_KIND_SUBMIT_PREFILL,
        )
        for stream in (first, again):
            stream.cancel()
        await client.completed_at_least(client.completed + MIN_COMPLETED)
        assert_unharmed(client, served)
        assert (
            "token token-3 may call StreamActions, Connect and Reconcile (scope engine) but "
            "names no engine, so each is refused: add engines=ID,... to its line of token_file"
        ) in served.log_text()


async def test_a_reconcile_as_another_engine_or_without_a_stream_frees_nothing(
    intruded: Served, tmp_path: Path
) -> None:
    """Item 5 (Reconcile): another identity's Reconcile naming the real
    engine, its freed list holding the real engine's handoff, is
    PERMISSION_DENIED (it applied EngineLost before); as its own engine but
    with no live stream, FAILED_PRECONDITION. The handoff goes on untouched,
    and the real engine's own reconcile, from its live stream, keeps it."""
    tokens = tmp_path / "tokens"
    real, served = real_engine(), intruded
    async with (
        asyncio.timeout(TIMEOUT_S),
        grpc.aio.insecure_channel(served.target) as good,
        grpc.aio.insecure_channel(served.target) as bad,
        alongside(good, bearer(TOKEN)) as client,
    ):
        await client.completed_at_least(MIN_COMPLETED)
        good_stub: Stub = pb_grpc.HandoffCoordinatorStub(good)
        engine = good_stub.StreamActions(real, metadata=bearer(TOKEN))
        await engine.initial_metadata()
        handoff_id = (
            await good_stub.StartHandoff(victim_start(), metadata=bearer(TOKEN))
        ).handoff.handoff_id
        submit = await engine.read()
        assert isinstance(submit, pb.Action)
        held = pb.ReportOutcomeRequest(
            handoff_id=handoff_id, action_id=submit.id, outcome=SUBMITTED
        )
        before = (await good_stub.ReportOutcome(held, metadata=bearer(TOKEN))).handoff
        freed = [pb.HeldSide(handoff_id=handoff_id, role=pb.ROLE_SOURCE)]
        stub: Stub = pb_grpc.HandoffCoordinatorStub(bad)
        as_victim = pb.ReconcileRequest(
            engine_id="fenced-victim",
            incarnation=real.incarnation,
            session_id=real.session_id,
            freed=freed,
        )
        with pytest.raises(grpc.aio.AioRpcError) as denied:
            await stub.Reconcile(as_victim, metadata=bearer(ATTACKER))
        assert (denied.value.code(), denied.value.details()) == (
            grpc.StatusCode.PERMISSION_DENIED,
            "Reconcile: token intruder may not act for engine fenced-victim (its engines: "
            f"intruder-0): add fenced-victim to engines= on its line of token_file {tokens}",
        )
        own = pb.ReconcileRequest(engine_id="intruder-0", freed=freed)
        with pytest.raises(grpc.aio.AioRpcError) as streamless:
            await stub.Reconcile(own, metadata=bearer(ATTACKER))
        assert (streamless.value.code(), streamless.value.details()) == (
            grpc.StatusCode.FAILED_PRECONDITION,
            "Reconcile: engine intruder-0 has no live stream: Reconcile comes from the sidecar "
            "holding its StreamActions or Connect stream, after that subscription",
        )
        lookup = pb.GetHandoffRequest(handoff_id=handoff_id)
        after = (await good_stub.GetHandoff(lookup, metadata=bearer(TOKEN))).handoff
        assert after == before
        assert (after.phase, list(after.end_reasons)) == (pb.PHASE_ACTIVE, [])
        as_itself = pb.ReconcileRequest(
            engine_id="fenced-victim",
            incarnation=real.incarnation,
            session_id=real.session_id,
            held=freed,
        )
        answer = await good_stub.Reconcile(as_itself, metadata=bearer(TOKEN))
        assert (list(answer.releases), answer.lost_applied) == ([], 0)
        engine.cancel()
        await client.completed_at_least(client.completed + MIN_COMPLETED)
        assert_unharmed(client, served)


async def test_a_fenced_incarnation_s_reconcile_is_refused_under_mutual_tls(
    tmp_path: Path,
) -> None:
    """Item 5 (mTLS): the prefill certificate's old incarnation, fenced out by
    its new one, has its stream refused and now its Reconcile too
    (FAILED_PRECONDITION naming the engine and both incarnations): the
    handoff of the new incarnation it lists as freed goes on, and the new
    incarnation's own reconcile is answered."""
    pki = make_pki(tmp_path)
    identities = tmp_path / "engines.json"
    frontend_san = ["DNS:router.frontend"]  # the well-behaved client acts as both its engines
    identities.write_text(
        json.dumps(
            {
                "prefill-0": ["DNS:prefill-0.engines"],
                "good-prefill": frontend_san,
                "good-decode": frontend_san,
            }
        )
    )
    flags = (
        *("--tls-cert", str(pki.server.cert_path), "--tls-key", str(pki.server.key_path)),
        *("--tls-client-ca", str(pki.ca.cert_path), "--engine-identity-file", str(identities)),
    )
    old, new = incarnation("old", ahead_s=-1.0), incarnation("new")
    async with (
        asyncio.timeout(TIMEOUT_S),
        serving(tmp_path, *flags) as served,
        secure_channel(served.port, pki.ca.cert, pki.client) as good,
        secure_channel(served.port, pki.ca.cert, pki.prefill) as prefill,
        alongside(good) as client,
    ):
        await client.completed_at_least(MIN_COMPLETED)
        engine: Stub = pb_grpc.HandoffCoordinatorStub(prefill)
        streams = {
            name: pb.StreamActionsRequest(
                engine_id="prefill-0", incarnation=value, session_id=f"{name}-session"
            )
            for name, value in (("old", old), ("new", new))
        }
        first = engine.StreamActions(streams["old"])
        await first.initial_metadata()
        second = engine.StreamActions(streams["new"])
        await second.initial_metadata()  # the old incarnation is fenced out
        code, details = await refusal(engine.StreamActions(streams["old"]))
        assert code == grpc.StatusCode.FAILED_PRECONDITION
        assert f"incarnation {old} is older than {new}" in details
        handoff_id = (
            await pb_grpc.HandoffCoordinatorStub(good).StartHandoff(
                start_request("prefill-0", "good-decode")
            )
        ).handoff.handoff_id
        submit = await second.read()
        assert isinstance(submit, pb.Action)
        held = pb.ReportOutcomeRequest(
            handoff_id=handoff_id, action_id=submit.id, outcome=SUBMITTED
        )
        before = (await engine.ReportOutcome(held)).handoff
        sides = [pb.HeldSide(handoff_id=handoff_id, role=pb.ROLE_SOURCE)]
        fenced = pb.ReconcileRequest(
            engine_id="prefill-0", incarnation=old, session_id="old-session", freed=sides
        )
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await engine.Reconcile(fenced)
        assert (refused.value.code(), refused.value.details()) == (
            grpc.StatusCode.FAILED_PRECONDITION,
            f"Reconcile: engine prefill-0: Reconcile from incarnation {old} (an older one, "
            f"fenced out), but its live stream is incarnation {new}: only the engine's "
            "current subscription reconciles",
        )
        lookup = pb.GetHandoffRequest(handoff_id=handoff_id)
        assert (await engine.GetHandoff(lookup)).handoff == before
        current = pb.ReconcileRequest(
            engine_id="prefill-0", incarnation=new, session_id="new-session", held=sides
        )
        answer = await engine.Reconcile(current)
        assert (list(answer.releases), answer.lost_applied) == ([], 0)
        for stream in (first, second):
            stream.cancel()
        await client.completed_at_least(client.completed + MIN_COMPLETED)
        assert_unharmed(client, served)


# --- item 11: fair shares -------------------------------------------------------

ZERO_ID = "00000000-0000-4000-8000-000000000000"


async def paced_calls(target: str, rpc: str, per_s: float, seconds: float) -> Counter[str]:
    """``rpc`` calls of the flooding token at ``per_s`` a second for ``seconds``,
    each sent on time whatever the answers before it (run :func:`attacker`)."""
    codes: Counter[str] = Counter()
    loop = asyncio.get_running_loop()
    async with grpc.aio.insecure_channel(target) as channel:
        stub: Stub = pb_grpc.HandoffCoordinatorStub(channel)
        await channel.channel_ready()

        async def one() -> None:
            try:
                if rpc == "StartHandoff":
                    await stub.StartHandoff(
                        start_request("flood-src", "flood-dst"), metadata=bearer(ATTACKER)
                    )
                else:
                    await stub.GetShardMap(pb.GetShardMapRequest(), metadata=bearer(ATTACKER))
                codes["OK"] += 1
            except grpc.aio.AioRpcError as error:
                codes[f"{error.code().name}: {error.details()}"] += 1

        began, sent, calls = loop.time(), 0, []
        while loop.time() < began + seconds:
            await asyncio.sleep(max(0.0, began + sent / per_s - loop.time()))  # the pace
            calls.append(asyncio.create_task(one()))
            sent += 1
        await asyncio.gather(*calls)
    return codes


async def paced_reports(target: str, per_s: float, seconds: float) -> int:
    """One Connect stream of the flooding token sending messages of 128
    duplicate reports, ``per_s`` reports a second for ``seconds``, reading its
    acks; how many acks it read (run :func:`attacker`)."""
    loop = asyncio.get_running_loop()
    report = pb.ConnectReport(
        fact=pb.ReportFactRequest(handoff_id=ZERO_ID, fact=pb.Fact(timed_out=pb.TimedOut()))
    )
    message = pb.ConnectRequest()
    for _ in range(MAX_REPORTS_PER_MESSAGE):
        message.reports.add().CopyFrom(report)
    hello = pb.ConnectHello(engine_id="flood-engine", batch=True, lean_acks=True)
    began = loop.time()

    async def requests() -> AsyncIterator[pb.ConnectRequest]:
        yield pb.ConnectRequest(hello=hello)
        sent = 0
        while loop.time() < began + seconds:
            await asyncio.sleep(max(0.0, began + sent / per_s - loop.time()))  # the pace
            yield message
            sent += MAX_REPORTS_PER_MESSAGE

    acks = 0
    async with grpc.aio.insecure_channel(target) as channel:
        stub: Stub = pb_grpc.HandoffCoordinatorStub(channel)
        async for response in stub.Connect(requests(), metadata=bearer(ATTACKER)):
            acks += len(response.acks)
    return acks


async def retry_storm(target: str, workers: int, seconds: float) -> Counter[str]:
    """``workers`` loops of the flooding token calling GetShardMap for
    ``seconds``, each trying again as soon as it has an answer, whatever it
    is: a client that retries without a backoff (run :func:`attacker`)."""
    codes: Counter[str] = Counter()
    loop = asyncio.get_running_loop()
    async with grpc.aio.insecure_channel(target) as channel:
        stub: Stub = pb_grpc.HandoffCoordinatorStub(channel)
        await channel.channel_ready()
        until = loop.time() + seconds

        async def worker() -> None:
            while loop.time() < until:
                try:
                    await stub.GetShardMap(pb.GetShardMapRequest(), metadata=bearer(ATTACKER))
                    codes["OK"] += 1
                except grpc.aio.AioRpcError as error:
                    codes[f"{error.code().name}: {error.details()}"] += 1

        await asyncio.gather(*(worker() for _ in range(workers)))
    return codes


async def test_floods_within_quota_leave_another_identity_its_rate(tmp_path: Path) -> None:
    """Item 11: one token floods at its per-identity rates (a quarter of the
    defaults, see below), one kind after another: StartHandoff, GetShardMap
    calls, Connect messages of 128 duplicate reports. A frontend with 20
    handoffs a second of work under another token keeps at least 90 % of the
    rate it had just before each flood; past its quota the flooding token is
    refused, naming itself, the RPC and the setting, and its reports are read
    more slowly.

    Measured on the 2-core machine, before the per-identity rates of every
    RPC: 0.91 of the rate with GetShardMap at 250 a second, 0.82 at 500 (a
    frontend as fast as the server answers); with them, at the defaults, the
    frontend kept 0.98 to 1.00 against each flood at its quota on an idle
    machine. (A token retrying far past its quota: the test below.)"""
    tokens = tmp_path / "tokens"
    tokens.write_text(f"{GOOD}\nflood {ATTACKER} start,engine,report,read engines=flood-*\n")
    seconds = 3.0
    # A quarter of the default rates: the property is the quota's, and it
    # needs a server with CPU for both callers. At the defaults (sized for a
    # core of its own) a CPU-bound process beside the suite left the frontend
    # 0.70 to 0.78 of its rate: the machine's limit, not fairness.
    starts, calls, reports = 50, 250, 500
    quotas = (
        *("--max-starts-per-s-per-identity", str(starts)),
        *("--max-calls-per-s-per-identity", str(calls)),
        *("--max-reports-per-s-per-identity", str(reports)),
    )
    async with (
        asyncio.timeout(TIMEOUT_S * 2),
        serving(tmp_path, "--token-file", str(tokens), *quotas) as served,
        contextlib.AsyncExitStack() as stack,
        grpc.aio.insecure_channel(served.target) as good,
        alongside(good, bearer(TOKEN), per_s=20.0) as client,
    ):
        attack = await stack.enter_async_context(attacker())
        await client.completed_at_least(MIN_COMPLETED)
        floods: dict[str, Callable[[], Awaitable[Any]]] = {
            "StartHandoff": lambda: attack(
                paced_calls, served.target, "StartHandoff", starts, seconds
            ),
            "GetShardMap": lambda: attack(
                paced_calls, served.target, "GetShardMap", calls, seconds
            ),
            "Connect": lambda: attack(paced_reports, served.target, reports, seconds),
        }
        kept: dict[str, float] = {}
        for rpc, flood in floods.items():
            outcome, kept[rpc] = await rate_kept(client, flood())
            if rpc == "Connect":
                assert outcome >= 0.9 * reports * seconds, outcome  # at its quota, never refused
            else:
                assert set(outcome) == {"OK"}, outcome  # within its quota: never refused
        assert min(kept.values()) >= 0.9, kept
        # Past its quota: four times the rate for a second. Its burst and its
        # rate are served, a second's worth more waits its turn (rate_wait_s),
        # and the rest is refused.
        burst = await attack(paced_calls, served.target, "GetShardMap", calls * 4, 1.0)
        assert burst["OK"] >= calls * 2, burst
        assert set(burst) == {
            "OK",
            f"RESOURCE_EXHAUSTED: token flood makes more than {calls} calls per second "
            "(GetShardMap refused), the limit per identity (max_calls_per_s_per_identity); "
            "its turn was more than 1 s away (rate_wait_s)",
        }, burst
        assert await metric(served, "handoff_calls_paced_total") > 0
        acks = await attack(paced_reports, served.target, reports * 4, 0.5)
        assert acks >= reports * 1.5, acks  # every report acknowledged, later
        assert await metric(served, "handoff_reports_paced_total") > 0
        assert_unharmed(client, served)


async def reset_flood(
    port: int, seconds: float, rpc: str = "GetShardMap", per_s: float | None = None
) -> int:
    """Without a token, on one connection: ``rpc`` streams opened and reset at
    once, 50 per write, for ``seconds``, as fast as the connection takes them
    or ``per_s`` a second; how many (run :func:`attacker`)."""
    loop = asyncio.get_running_loop()
    block = rawh2.grpc_headers(f"/handoff.v1.HandoffCoordinator/{rpc}")
    cancel = rawh2.CANCEL.to_bytes(4, "big")
    opened = 0
    async with rawh2.connection("127.0.0.1", port) as connection:
        began = loop.time()
        while loop.time() < began + seconds:
            burst = bytearray()
            for _ in range(50):
                stream = connection.stream_id()
                burst += rawh2.frame(rawh2.HEADERS, rawh2.END_HEADERS, stream, block)
                burst += rawh2.frame(rawh2.RST_STREAM, 0, stream, cancel)
            try:
                await connection.send(bytes(burst))
            except ConnectionError:
                break  # the server closed the connection: the flood is over
            opened += 50
            # The attacker's own pace, not a wait for an event.
            pause = 0.0 if per_s is None else began + opened / per_s - loop.time()
            await asyncio.sleep(max(0.0, pause))
    return opened


async def junk_headers(port: int, token: str) -> None:
    """Calls whose headers carry 26 KB of attacker bytes, split over
    CONTINUATION frames (in a header value, the token, a trace header), then
    a header block that never ends (run :func:`attacker`)."""
    junk = bytes(range(256)) * 100 + b"\n" * 100
    path = "/handoff.v1.HandoffCoordinator/GetShardMap"
    auth = ("authorization", f"Bearer {token}")
    variants: list[list[tuple[str, str | bytes]]] = [
        [auth, ("x-junk", junk)],
        [("authorization", b"Bearer " + junk)],
        [auth, ("traceparent", junk)],
        [auth, ("x-junk" + "\xff" * 3, "v" * 26000)],
    ]
    for headers in variants:
        block = rawh2.grpc_headers(path, *headers)
        async with rawh2.connection("127.0.0.1", port) as connection:
            stream = connection.stream_id()
            chunks = [block[at : at + 4096] for at in range(0, len(block), 4096)]
            frames = rawh2.frame(rawh2.HEADERS, 0, stream, chunks[0])
            for number, chunk in enumerate(chunks[1:], 2):
                last = rawh2.END_HEADERS if number == len(chunks) else 0
                frames += rawh2.frame(rawh2.CONTINUATION, last, stream, chunk)
            with contextlib.suppress(ConnectionError):
                await connection.send(frames + rawh2.frame(0x0, rawh2.END_STREAM, stream, bytes(5)))
                await asyncio.sleep(0.2)  # the server's answer, if any
    async with rawh2.connection("127.0.0.1", port) as connection:
        stream = connection.stream_id()
        with contextlib.suppress(ConnectionError):
            await connection.send(rawh2.frame(rawh2.HEADERS, 0, stream, rawh2.grpc_headers(path)))
            for _ in range(400):  # 6.4 MB of header block, never ended
                await connection.send(rawh2.frame(rawh2.CONTINUATION, 0, stream, junk[:16000]))


async def test_reset_and_continuation_floods_leave_the_log_bounded(served: Served) -> None:
    """Item 11, the transport: HTTP/2 rapid reset without a token (one
    connection opening and resetting streams for 2 s), then CONTINUATION
    floods and 26 KB of attacker bytes in headers. The server serves the
    well-behaved client again within a few seconds, its memory stays
    bounded, nothing is logged at ERROR or with a traceback, and no line of
    its log is longer than a bounded record (the core's lines too).

    Not asserted: the well-behaved client's rate during this flood, at the
    attacker's full speed (about 500,000 streams a second from one process):
    the attacker, gRPC's transport threads and the client share the
    machine's two cores, and the client kept 0.20 to 0.24 of its rate. The
    test below floods at a rate that leaves them CPU, and asserts that the
    other RPCs keep theirs (docs/limits.md, "HTTP/2")."""
    async with (
        asyncio.timeout(TIMEOUT_S),
        contextlib.AsyncExitStack() as stack,
        grpc.aio.insecure_channel(served.target) as good,
        alongside(good, bearer(TOKEN)) as client,
    ):
        attack = await stack.enter_async_context(attacker())
        await client.completed_at_least(MIN_COMPLETED)
        opened = await attack(reset_flood, served.port, 2.0)
        assert opened >= 10_000, opened
        async with asyncio.timeout(10.0):
            await client.completed_at_least(client.completed + MIN_COMPLETED)
        await attack(junk_headers, served.port, TOKEN)
        async with asyncio.timeout(10.0):
            await client.completed_at_least(client.completed + MIN_COMPLETED)
        assert_unharmed(client, served)
    lines = served.log_text().splitlines()
    longest = max(lines, key=len)
    # A record's message and each field at most 1 KiB escaped, plus its time,
    # level, logger and field names.
    assert len(longest) < 2 * 1024 + 200, longest[:300]
    assert all(line.isprintable() for line in lines)


async def test_a_reset_flood_of_one_rpc_delays_no_other_rpc(served: Served) -> None:
    """Item 11, HTTP/2 rapid reset without a token, aimed at one RPC: one
    connection opens and resets `GetShardMap` streams at 8,750 a second (the
    light flood docs/limits.md measures) for 3 s. gRPC's core keeps the calls
    the Python server has not taken yet in one queue per registered method
    (service/methods.py), so the flood waits behind itself: the well-behaved
    client, a frontend with 40 handoffs a second of work (StartHandoff,
    ReportFact, ReportOutcome, its engine streams), keeps at least 90 % of its
    rate and a health Check on the service port answers at once.

    Measured on the 2-core machine: the client kept 0.999 of its rate (0.997
    beside a CPU burner), Checks took 19 ms at most; with every RPC behind
    generic handlers (one queue, as before) 0.017, Checks up to 217 ms."""
    loop = asyncio.get_running_loop()
    async with (
        asyncio.timeout(TIMEOUT_S),
        contextlib.AsyncExitStack() as stack,
        grpc.aio.insecure_channel(served.target) as good,
        alongside(good, bearer(TOKEN), per_s=40.0) as client,
    ):
        attack = await stack.enter_async_context(attacker())
        await client.completed_at_least(MIN_COMPLETED)
        health = health_pb2_grpc.HealthStub(good)
        waits: list[float] = []

        async def probe() -> None:
            while True:
                asked = loop.time()
                await health.Check(health_pb2.HealthCheckRequest(), timeout=5.0)
                waits.append(loop.time() - asked)
                await asyncio.sleep(0.05)  # a probe's own period, not a wait for an event

        probing = asyncio.create_task(probe())
        flood = attack(reset_flood, served.port, 3.0, "GetShardMap", 8750.0)
        opened, kept = await rate_kept(client, flood)
        probing.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await probing
        assert opened >= 8750 * 3 // 2, opened
        assert kept >= 0.9, kept
        assert len(waits) >= 20, waits
        assert max(waits) < 0.1, sorted(waits)[-5:]
        assert_unharmed(client, served)


async def test_a_retry_storm_far_past_its_rate_is_slowed_to_it(tmp_path: Path) -> None:
    """Item 11, past the quota: 128 loops of one token call GetShardMap and
    try again the moment they have an answer, for 3 s. Its calls past its
    rate wait for their turn (rate_wait_s) instead of being refused at once,
    so it is slowed to its rate, its waiting calls sit in the server rather
    than in the transport's queue ahead of the other token's, and a frontend
    with 20 handoffs a second of work keeps at least 90 % of its rate.

    Measured on the 2-core machine at the default rates: with the calls
    refused at once (--rate-wait-s 0) the storm made 2,100 to 2,400 calls a
    second, 40 to 48 % of them refused, and the frontend kept 0.10 to 0.11
    of its rate; with the wait, 1.00, and the storm got its 1,000 a second,
    none refused. Here at a quarter of the default rate, as in the test
    above (with --rate-wait-s 0 this test fails: 0.11)."""
    tokens = tmp_path / "tokens"
    tokens.write_text(f"{GOOD}\nflood {ATTACKER} read engines=flood-*\n")
    calls, seconds = 250, 3.0
    async with (
        asyncio.timeout(TIMEOUT_S),
        serving(
            tmp_path, "--token-file", str(tokens), "--max-calls-per-s-per-identity", str(calls)
        ) as served,
        contextlib.AsyncExitStack() as stack,
        grpc.aio.insecure_channel(served.target) as good,
        alongside(good, bearer(TOKEN), per_s=20.0) as client,
    ):
        attack = await stack.enter_async_context(attacker())
        await client.completed_at_least(MIN_COMPLETED)
        codes, kept = await rate_kept(client, attack(retry_storm, served.target, 128, seconds))
        assert kept >= 0.9, (kept, codes)
        assert set(codes) == {"OK"}, codes  # each waited for its turn
        # Slowed to its rate: a second's burst, then the rate, for the storm
        # and the last turns (at most rate_wait_s) it waited for.
        assert codes["OK"] <= calls * (1 + seconds + 1) * 1.05, codes
        assert await metric(served, "handoff_calls_paced_total") > 0
        assert_unharmed(client, served)
