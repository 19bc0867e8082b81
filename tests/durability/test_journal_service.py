"""The journal in a running server, over real gRPC on loopback: nothing leaves
before its commit, subscriptions say which coordinator they reached, a
restart recovers, the trace context is kept, and recovery is exported."""

from __future__ import annotations

import asyncio
import json
import logging
import sqlite3
import threading
import time
import uuid
from collections.abc import AsyncIterator, Awaitable
from pathlib import Path
from typing import Any

import grpc
import pytest

from handoff_proto.v1 import coordinator_pb2 as pb
from handoff_proto.v1 import coordinator_pb2_grpc as pb_grpc
from handoff_server.durability.journal import DATABASE, Journal
from handoff_server.service import convert
from handoff_server.service.app import Server
from tests.support.lease import until
from tests.support.rpc import SOURCE, ConnectEngine, StreamRecorder, start_request
from tests.support.servers import StartServer

SUBMITTED = pb.Outcome(kind=pb.OUTCOME_KIND_SUBMITTED)
CANCELED = pb.Fact(canceled=pb.Canceled())
HELD = pb.Fact(
    source_held=pb.SourceHeld(
        transfer_timing=pb.TransferTiming(
            mode=pb.TRANSFER_TIMING_MODE_FULL_PROMPT, full_prompt_tokens=10
        )
    )
)


def committed(state_dir: Path) -> list[tuple[str, list[Any]]]:
    """The records another process sees: only committed ones."""
    with sqlite3.connect(state_dir / DATABASE) as db:
        return [
            (handoff_id, json.loads(body))
            for handoff_id, body in db.execute("SELECT handoff_id, body FROM records ORDER BY seq")
        ]


@pytest.fixture
def slow_commits(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each commit takes 200 ms: anything sent before its commit would be seen early."""
    commit = Journal._commit

    def slow(self: Journal, *batch: Any) -> None:
        time.sleep(0.2)
        commit(self, *batch)

    monkeypatch.setattr(Journal, "_commit", slow)


class Gates:
    """Every commit runs on the writer's thread and waits there until the
    test opens its gate; the test hears each commit start, with its gate."""

    def __init__(self) -> None:
        self.loop = asyncio.get_running_loop()
        self.started: asyncio.Queue[threading.Event] = asyncio.Queue()
        self.opened: list[threading.Event] = []

    def enter(self) -> None:
        """On the writer's thread, before the commit's transaction."""
        gate = threading.Event()
        self.opened.append(gate)
        self.loop.call_soon_threadsafe(self.started.put_nowait, gate)
        assert gate.wait(20), "a gated commit was never opened"

    def open_all(self) -> None:
        for gate in self.opened:
            gate.set()


@pytest.fixture
async def gated_commits(monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[Gates]:
    gates = Gates()
    commit = Journal._commit

    def gated(self: Journal, *batch: Any, **options: Any) -> None:
        gates.enter()
        commit(self, *batch, **options)

    monkeypatch.setattr(Journal, "_commit", gated)
    monkeypatch.setattr(Journal, "_may_fsync", lambda self: True)  # each commit on the thread
    try:
        yield gates
    finally:
        gates.open_all()  # nothing stays held past the test


@pytest.fixture
async def journaled(start_server: StartServer, tmp_path: Path) -> Server:
    return await start_server(state_dir=str(tmp_path))


@pytest.fixture
async def stub(journaled: Server) -> AsyncIterator[pb_grpc.HandoffCoordinatorAsyncStub]:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{journaled.port}") as channel:
        yield pb_grpc.HandoffCoordinatorStub(channel)


@pytest.mark.timeout(30)
@pytest.mark.usefixtures("slow_commits")
async def test_no_answer_ack_or_action_leaves_before_its_commit(
    stub: pb_grpc.HandoffCoordinatorAsyncStub, tmp_path: Path
) -> None:
    h = str(uuid.uuid4())
    source = StreamRecorder(stub, SOURCE)
    await source.subscribed()
    await stub.StartHandoff(start_request(h))
    assert [body[0] for _, body in committed(tmp_path)] == ["start"]
    submit = await source.wait_for(h, 0)  # written to the stream after the same commit
    assert submit.kind == pb.ACTION_KIND_SUBMIT_PREFILL
    await source.close()

    await stub.ReportOutcome(pb.ReportOutcomeRequest(handoff_id=h, action_id=0, outcome=SUBMITTED))
    assert committed(tmp_path)[-1] == (h, ["outcome", 0, "submitted", ""])

    engine = ConnectEngine(stub, SOURCE)
    await engine.subscribed()
    ack = await engine.report(pb.ReportFactRequest(handoff_id=h, fact=HELD))
    assert ack.code == 0
    assert committed(tmp_path)[-1][1][0] == "source_held"
    await engine.close()

    # A refusal tells of state too: the id in use is durable before it is refused.
    other = str(uuid.uuid4())
    await stub.StartHandoff(start_request(other))
    elsewhere = start_request(other)
    elsewhere.destination_engine_id = "decode-elsewhere"
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await stub.StartHandoff(elsewhere)
    assert refused.value.code() == grpc.StatusCode.ALREADY_EXISTS


async def absent(arrival: Awaitable[object], within_s: float = 0.5) -> None:
    """``arrival`` does not happen within ``within_s`` (it would, at once, were
    something written before its commit)."""
    with pytest.raises(TimeoutError):
        async with asyncio.timeout(within_s):
            await arrival


@pytest.mark.timeout(30)
async def test_a_connect_ack_leaves_only_after_the_commit_of_its_report(
    start_server: StartServer, tmp_path: Path, gated_commits: Gates
) -> None:
    server = await start_server(state_dir=str(tmp_path))
    h = str(uuid.uuid4())
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        stub = pb_grpc.HandoffCoordinatorStub(channel)
        engine = ConnectEngine(stub, SOURCE, batch=True)
        await engine.subscribed()
        starting = asyncio.ensure_future(stub.StartHandoff(start_request(h)))
        (await gated_commits.started.get()).set()
        await starting
        report = pb.ReportOutcomeRequest(handoff_id=h, action_id=0, outcome=SUBMITTED)
        acked = asyncio.ensure_future(engine.report(report))
        held = await gated_commits.started.get()  # the outcome's commit, held
        await absent(asyncio.shield(acked))
        held.set()
        assert (await acked).code == 0
        assert committed(tmp_path)[-1] == (h, ["outcome", 0, "submitted", ""])
        await engine.close()


@pytest.mark.timeout(30)
async def test_an_action_waits_for_the_commit_of_its_call_not_for_later_ones(
    start_server: StartServer, tmp_path: Path, gated_commits: Gates
) -> None:
    """A stream's writer waits until the journal is committed as far as it
    was when the action was queued: calls for other engines appended later
    (in the next commit) do not hold it back a whole commit more."""
    server = await start_server(state_dir=str(tmp_path))
    delivery = server.registry.delivery
    first, second, later = (str(uuid.uuid4()) for _ in range(3))
    elsewhere = {"source_engine_id": "prefill-elsewhere", "destination_engine_id": "decode-else"}
    async with (
        asyncio.timeout(20),
        grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel,
    ):
        stub = pb_grpc.HandoffCoordinatorStub(channel)
        calls: list[asyncio.Task[pb.StartHandoffResponse]] = []

        async def started(request: pb.StartHandoffRequest) -> pb.StartHandoffResponse:
            return await stub.StartHandoff(request)  # answered once its commit is done

        def start(handoff_id: str | None = None, **fields: str) -> None:
            calls.append(asyncio.create_task(started(start_request(handoff_id, **fields))))

        source = StreamRecorder(stub, SOURCE)
        await source.subscribed()
        start(**elsewhere)
        held = await gated_commits.started.get()  # commit 0, held: the next ones gather
        start(first)
        # The source's writer took the first's SubmitPrefill: it waits for commit 1.
        await until(lambda: first in server.registry.handoffs and delivery.queued(SOURCE) == 0)
        start(second)
        await until(lambda: delivery.queued(SOURCE) == 1)  # queued while the writer waits
        held.set()
        held = await gated_commits.started.get()  # commit 1: the first and the second
        await absent(source.wait_for(first, 0))  # taken, and held back with its commit
        start(later, **elsewhere)
        await until(lambda: later in server.registry.handoffs)
        held.set()
        held = await gated_commits.started.get()  # commit 2, the later start alone: held
        submit = await source.wait_for(second, 0)
        assert submit.kind == pb.ACTION_KIND_SUBMIT_PREFILL
        starts = [handoff_id for handoff_id, body in committed(tmp_path) if body[0] == "start"]
        assert second in starts
        assert later not in starts
        held.set()
        await asyncio.gather(*calls)
        await source.close()


@pytest.mark.timeout(30)
async def test_the_trace_context_is_kept_with_the_start(
    stub: pb_grpc.HandoffCoordinatorAsyncStub, tmp_path: Path
) -> None:
    h = str(uuid.uuid4())
    traceparent = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    await stub.StartHandoff(
        start_request(h), metadata=(("traceparent", traceparent), ("tracestate", "vendor=1"))
    )
    ((_, body),) = committed(tmp_path)
    assert body[-1] == [["traceparent", traceparent], ["tracestate", "vendor=1"]]


async def headers(server: Server, connect: bool) -> dict[str, str]:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        stub: pb_grpc.HandoffCoordinatorAsyncStub = pb_grpc.HandoffCoordinatorStub(channel)
        if connect:
            engine = ConnectEngine(stub, "decode-9")
            metadata = await engine._call.initial_metadata()
            await engine.close()
        else:
            recorder = StreamRecorder(stub, "decode-9")
            metadata = await recorder._call.initial_metadata()
            await recorder.close()
    return {key: str(value) for key, value in metadata}


@pytest.mark.timeout(60)
async def test_a_restart_recovers_and_subscriptions_say_so(
    start_server: StartServer, tmp_path: Path
) -> None:
    first = await start_server(state_dir=str(tmp_path), delivery_timeout_s=7.5)
    before = await headers(first, connect=True)
    assert before["handoff-recovered"] == "false"
    assert before["handoff-delivery-timeout-ms"] == "7500"
    async with grpc.aio.insecure_channel(f"127.0.0.1:{first.port}") as channel:
        stub: pb_grpc.HandoffCoordinatorAsyncStub = pb_grpc.HandoffCoordinatorStub(channel)
        ids = [str(uuid.uuid4()) for _ in range(5)]
        for h in ids:
            await stub.StartHandoff(start_request(h))
        await stub.ReportFact(pb.ReportFactRequest(handoff_id=ids[0], fact=CANCELED))
    await first.stop()  # drains: the four still active are canceled, and journaled so
    views = {h: convert.handoff(first.registry.get(h)) for h in ids}

    second = await start_server(state_dir=str(tmp_path))
    assert second.incarnation > first.incarnation
    after = await headers(second, connect=False)
    assert after["handoff-recovered"] == "true"
    assert int(after["handoff-coordinator-incarnation"]) == second.incarnation
    assert int(before["handoff-coordinator-incarnation"]) == first.incarnation
    assert second.recovery is not None
    assert second.recovery.total == 5
    assert second.metrics.registry.get_sample_value("handoff_recovered_handoffs") == 5
    assert (second.metrics.registry.get_sample_value("handoff_recovery_seconds") or 0) > 0
    async with grpc.aio.insecure_channel(f"127.0.0.1:{second.port}") as channel:
        stub = pb_grpc.HandoffCoordinatorStub(channel)
        for h in ids:
            view = (await stub.GetHandoff(pb.GetHandoffRequest(handoff_id=h))).handoff
            assert view == views[h]


@pytest.mark.timeout(30)
async def test_without_a_state_dir_the_server_says_it_keeps_nothing(
    start_server: StartServer, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO, "handoff.server"):
        server = await start_server()
    assert "no state dir: handoffs are kept in memory only" in caplog.text
    assert server.journal is None
    assert (await headers(server, connect=True))["handoff-recovered"] == "false"


@pytest.mark.timeout(30)
async def test_a_commit_that_fails_answers_nothing_and_stops_the_server(
    journaled: Server, stub: pb_grpc.HandoffCoordinatorAsyncStub, monkeypatch: pytest.MonkeyPatch
) -> None:
    def disk_full(self: Journal, *batch: Any) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(Journal, "_commit", disk_full)
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await stub.StartHandoff(start_request(str(uuid.uuid4())))
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "the journal cannot be written" in (refused.value.details() or "")
    assert "No space left on device" in (refused.value.details() or "")
    await journaled.failed.wait()  # serve.py exits 1 on it, without draining
