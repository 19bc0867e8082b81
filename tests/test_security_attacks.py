"""Issue 17's attacks, each against a real `handoff serve` with a well-behaved client alongside.

Each test attacks for a bounded number of calls and seconds, on loopback
only, then checks that the well-behaved client's handoffs kept completing
without errors, and that the server's memory stayed bounded.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest

from handoff.v1 import coordinator_pb2 as pb
from handoff.v1 import coordinator_pb2_grpc as pb_grpc
from handoff_server.servicer import MAX_REPORTS_PER_MESSAGE
from tests.attack_support import Served, WellBehaved, alongside, bearer, serving
from tests.security_support import Stub

TOKEN = "attack-test-token-0123456789"
ATTACKER = "attacker-token-0123456789ab"
TIMEOUT_S = 60.0
# Generous: the server idles at ~50 MiB; the attacks took it past 1.6 GiB.
RSS_CEILING_MIB = 300.0
# What the well-behaved client must manage while under attack, at the least.
MIN_COMPLETED = 3


@pytest.fixture
async def served(tmp_path: Path) -> AsyncIterator[Served]:
    tokens = tmp_path / "tokens"
    tokens.write_text(f"{TOKEN}\n{ATTACKER}\n")
    async with serving(tmp_path, "--token-file", str(tokens)) as served:
        yield served


def assert_unharmed(client: WellBehaved, served: Served) -> None:
    assert not client.errors, f"the well-behaved client failed: {dict(client.errors)}"
    assert client.completed >= MIN_COMPLETED, f"only {client.completed} handoffs completed"
    assert served.rss_mib() < RSS_CEILING_MIB


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
