"""Fuzzing a running server: every RPC, streams included, interleaved with valid traffic.

The server never crashes, never answers INTERNAL or UNKNOWN, never changes a
handoff on a refused call, and keeps memory bounded. Undecodable bytes, in a
gRPC frame or straight on the socket, leave it healthy.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import os
import tracemalloc
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc
import pytest
from google.protobuf.message import DecodeError, Message
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from handoff_proto.v1 import coordinator_pb2 as pb
from handoff_proto.v1 import coordinator_pb2_grpc as pb_grpc
from handoff_server.service.app import Server
from tests.support.fuzz import (
    METHODS,
    REFUSALS,
    Caller,
    DrawSource,
    Fuzzer,
    Known,
    RandomSource,
    Tally,
    drive_valid_handoff,
    fuzz_step,
    snapshot,
)
from tests.support.security import Pki, Stub, make_pki
from tests.support.servers import StartServer, streams_until

EXAMPLE_TIMEOUT_S = 30.0
BURST = 1200  # fuzzed calls measured by the memory test
VALID = frozenset({"ok-src", "ok-dst"})  # engines of the valid traffic, never fuzzed
FUZZ_SETTINGS = settings(
    max_examples=150,
    deadline=None,  # a loaded CI machine is slow; each example is bounded by a timeout
    suppress_health_check=[
        HealthCheck.function_scoped_fixture,  # one server for all examples, on purpose
        HealthCheck.too_slow,
        HealthCheck.data_too_large,
    ],
)


@dataclass
class Target:
    server: Server
    channel: grpc.aio.Channel
    stub: Stub
    known: Known
    tally: Tally
    valid_handoffs: int = 0

    @property
    def caller(self) -> Caller:
        return Caller(self.channel, self.server, self.tally)

    async def healthy(self) -> None:
        health = health_pb2_grpc.HealthStub(self.channel)
        answer = await health.Check(health_pb2.HealthCheckRequest())
        assert answer.status == health_pb2.HealthCheckResponse.SERVING
        await drive_valid_handoff(self.stub, "ok-src", "ok-dst")
        self.valid_handoffs += 1

    def check_bounded(self) -> None:
        """Nothing is removed during a test (no retention, cleanup or delivery
        timer can run out), so besides the valid traffic's handoffs the
        registry holds exactly those the fuzzer saw accepted, no more."""
        handoffs = self.server.registry.handoffs
        fuzzed = {h for h, e in handoffs.items() if e.source_engine_id not in VALID}
        assert fuzzed == {*self.known.handoff_ids, *self.known.started}


@pytest.fixture
async def target(start_server: StartServer) -> AsyncIterator[Target]:
    """A server whose timers cannot fire during a test, and handoffs for the
    fuzzer to aim at, in every phase."""
    hour = 3600.0
    server = await start_server(
        default_timeout_s=hour, delivery_timeout_s=hour, cleanup_timeout_s=hour
    )
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        stub: Stub = pb_grpc.HandoffCoordinatorStub(channel)
        known = Known()
        for order in (pb.ENGINE_TYPE_VLLM, pb.ENGINE_TYPE_SGLANG):
            fresh = pb.StartHandoffRequest(
                handoff_id=str(uuid.uuid4()),
                engine_type=order,
                source_engine_id="fz-src",
                destination_engine_id="fz-dst",
                fallback_transfer_delay_ms=2.0,
            )
            known.handoff_ids.append((await stub.StartHandoff(fresh)).handoff.handoff_id)
        canceled = pb.StartHandoffRequest()
        canceled.CopyFrom(fresh)
        canceled.handoff_id = str(uuid.uuid4())
        await stub.StartHandoff(canceled)
        await stub.ReportFact(
            pb.ReportFactRequest(
                handoff_id=canceled.handoff_id, fact=pb.Fact(canceled=pb.Canceled())
            )
        )
        known.handoff_ids.append(canceled.handoff_id)
        known.handoff_ids.append(
            await drive_valid_handoff(stub, "fz-src", "fz-dst")  # complete, retained
        )
        yield Target(server, channel, stub, known, Tally())


@FUZZ_SETTINGS
@given(data=st.data())
async def test_fuzzed_calls_are_refused_cleanly_while_valid_traffic_succeeds(
    target: Target, caplog: pytest.LogCaptureFixture, data: st.DataObject
) -> None:
    fuzzer = Fuzzer(DrawSource(data), target.known)
    calls = data.draw(st.integers(1, 6), label="calls")
    async with asyncio.timeout(EXAMPLE_TIMEOUT_S):
        valid = asyncio.create_task(drive_valid_handoff(target.stub, "ok-src", "ok-dst"))
        for _ in range(calls):
            await fuzz_step(fuzzer, target.caller, VALID)
        await valid
        target.valid_handoffs += 1
        await streams_until(target.server, lambda live: not live)
    target.check_bounded()
    no_errors_logged(caplog)


async def test_memory_stays_bounded_over_a_long_burst(
    target: Target, caplog: pytest.LogCaptureFixture
) -> None:
    fuzzer = Fuzzer(RandomSource(seed=20261129), target.known)
    caller = target.caller

    async def burst(calls: int) -> None:
        for _ in range(calls):
            # The snapshots are the property test's job; here they would
            # only slow the burst down (they are O(handoffs) per call).
            await fuzz_step(fuzzer, caller, VALID, check_unchanged=False)
        await streams_until(target.server, lambda live: not live)

    async with asyncio.timeout(60):
        # Warm-up: lazily built metric children, gRPC call objects, caches.
        await burst(300)
        gc.collect()
        handoffs_before = len(target.server.registry.handoffs)
        rss_before = resident_bytes()
        tracemalloc.start()
        try:
            traced_before = tracemalloc.get_traced_memory()[0]
            await burst(BURST)
            gc.collect()
            traced_growth = tracemalloc.get_traced_memory()[0] - traced_before
        finally:
            tracemalloc.stop()
        rss_growth = resident_bytes() - rss_before
    target.check_bounded()
    new_handoffs = len(target.server.registry.handoffs) - handoffs_before
    # What may legitimately stay: accepted handoffs (a few KiB each, up to
    # the configured limits), and for every engine that subscribed and left,
    # a remembered channel and its timers, kept for max(retention_s,
    # delivery_timeout_s) so that new work for a dead engine fails at once
    # (bounded by time, not by count). A real leak of even one call object
    # or one handoff per call exceeds this.
    allowance = 256 * 1024 + BURST * 512 + new_handoffs * 16 * 1024
    assert traced_growth < allowance, (traced_growth, new_handoffs, target.tally)
    assert rss_growth < 64 * 1024 * 1024 + allowance, rss_growth
    assert target.tally.calls == 300 + BURST
    no_errors_logged(caplog)


def no_errors_logged(caplog: pytest.LogCaptureFixture) -> None:
    """The server's side of "never INTERNAL": an unexpected exception in a
    handler is logged at ERROR (by the servicer, or by grpc for UNKNOWN), even
    when a client cannot see the status (grpc/grpc#36066)."""
    errors = [r for r in caplog.get_records("call") if r.levelno >= logging.ERROR]
    assert not errors, [r.getMessage() for r in errors]


def resident_bytes() -> int:
    with open(f"/proc/{os.getpid()}/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@settings(FUZZ_SETTINGS, max_examples=60)
@given(method=st.sampled_from(sorted(METHODS)), payload=st.binary(min_size=1, max_size=200))
async def test_undecodable_requests_are_invalid_argument_and_change_nothing(
    target: Target, caplog: pytest.LogCaptureFixture, method: str, payload: bytes
) -> None:
    request_class: type[Message] = {
        "StartHandoff": pb.StartHandoffRequest,
        "ReportFact": pb.ReportFactRequest,
        "ReportOutcome": pb.ReportOutcomeRequest,
        "GetHandoff": pb.GetHandoffRequest,
        "GetShardMap": pb.GetShardMapRequest,
        "Reconcile": pb.ReconcileRequest,
        "StreamActions": pb.StreamActionsRequest,
        "Connect": pb.ConnectRequest,
    }[method]
    try:
        request_class.FromString(payload)
        decodes = True
    except DecodeError:
        decodes = False
    before = snapshot(target.server, VALID)
    path = f"/{pb.DESCRIPTOR.services_by_name['HandoffCoordinator'].full_name}/{method}"
    async with asyncio.timeout(EXAMPLE_TIMEOUT_S):
        if method == "Connect":
            connect = target.channel.stream_stream(path, None, None)(iter([payload]), timeout=10)
            with contextlib.suppress(grpc.aio.AioRpcError):
                async for _ in connect:
                    pass
            code, details = await connect.code(), await connect.details()
        elif method == "StreamActions":
            stream = target.channel.unary_stream(path, None, None)(payload, timeout=10)
            await stream.initial_metadata()
            stream.cancel()  # if it was a valid subscription
            code, details = await stream.code(), await stream.details()
        else:
            try:
                # GetShardMap's request has no fields, and a Reconcile that
                # parses names no known handoff: either may be answered.
                await target.channel.unary_unary(path, None, None)(payload, timeout=10)
                code, details = grpc.StatusCode.OK, ""
            except grpc.aio.AioRpcError as refused:
                code, details = refused.code(), refused.details() or ""
        if not decodes:
            assert code is grpc.StatusCode.INVALID_ARGUMENT, (code, details)
            assert f"is not a valid {request_class.DESCRIPTOR.full_name}" in details
        else:
            # Bytes that happen to parse are an ordinary (fuzzed) request.
            assert code in REFUSALS | {grpc.StatusCode.CANCELLED, grpc.StatusCode.OK}, code
        await streams_until(target.server, lambda live: not live)
    assert snapshot(target.server, VALID) == before
    no_errors_logged(caplog)


async def test_garbage_on_the_connection_leaves_the_server_healthy(
    target: Target, tmp_path_factory: pytest.TempPathFactory, start_server: StartServer
) -> None:
    preface = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
    garbage = [
        b"",
        b"GET / HTTP/1.1\r\nHost: x\r\n\r\n",
        os.urandom(4096),
        preface + os.urandom(512),
        # A frame header announcing a 16 MiB DATA frame on stream 1, then nothing.
        preface + b"\xff\xff\xff\x00\x00\x00\x00\x00\x01",
        # A valid empty SETTINGS frame, then HEADERS with an undecodable HPACK block.
        preface
        + b"\x00\x00\x00\x04\x00\x00\x00\x00\x00"
        + b"\x00\x00\x08\x01\x05\x00\x00\x00\x01"
        + os.urandom(8),
        b"\x16\x03\x01\x02\x00" + os.urandom(512),  # a TLS record to a plaintext port
    ]
    pki: Pki = make_pki(tmp_path_factory.mktemp("pki"))
    tls_server = await start_server(**pki.tls_settings(mutual=True))
    before = snapshot(target.server, VALID)
    async with asyncio.timeout(EXAMPLE_TIMEOUT_S):
        for port in (target.server.port, tls_server.port):
            for data in garbage:
                reader, writer = await asyncio.open_connection("127.0.0.1", port)
                writer.write(data)
                await writer.drain()
                writer.write_eof()
                await reader.read()  # until the server hangs up
                writer.close()
                await writer.wait_closed()
        await target.healthy()
    assert snapshot(target.server, VALID) == before
    target.check_bounded()


async def test_an_absurd_timeout_is_refused_not_internal(target: Target) -> None:
    request = pb.StartHandoffRequest(
        handoff_id=str(uuid.uuid4()),
        engine_type=pb.ENGINE_TYPE_VLLM,
        source_engine_id="fz-src",
        destination_engine_id="fz-dst",
        timeout_s=1e12,
    )
    before = len(target.server.registry.handoffs)
    async with asyncio.timeout(EXAMPLE_TIMEOUT_S):
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await target.stub.StartHandoff(request)
    assert refused.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert len(target.server.registry.handoffs) == before
