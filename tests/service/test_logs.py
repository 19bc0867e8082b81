"""Logs carry the handoff id, as text or as one JSON object per line."""

from __future__ import annotations

import asyncio
import json
import logging
from pathlib import Path

import grpc
import pytest

from handoff_proto.v1 import coordinator_pb2 as pb
from handoff_proto.v1 import coordinator_pb2_grpc as pb_grpc
from handoff_server.ops.logs import JsonFormatter, NativeWindow, TextFormatter
from tests.support.attack import serving
from tests.support.fakes import FakeClock
from tests.support.security import make_pki


def record(**extra: str) -> logging.LogRecord:
    made = logging.LogRecord(
        "handoff.registry", logging.WARNING, __file__, 1, "deadline %s", ("passed",), None
    )
    for name, value in extra.items():
        setattr(made, name, value)
    return made


def test_json_lines_carry_the_handoff_id() -> None:
    line = JsonFormatter().format(record(handoff_id="6f1c0b9e-8c1d-4e43-9a55-0d4d8f1b2a10"))
    document = json.loads(line)
    assert document["message"] == "deadline passed"
    assert document["level"] == "warning"
    assert document["handoff_id"] == "6f1c0b9e-8c1d-4e43-9a55-0d4d8f1b2a10"


def test_text_lines_carry_the_engine_id() -> None:
    line = TextFormatter().format(record(engine_id="decode-3"))
    assert line.endswith("handoff.registry: deadline passed [engine_id=decode-3]")


def test_what_a_peer_chose_is_logged_bounded_and_escaped() -> None:
    """A 26 KB id with a newline and escape bytes: one line, cut at 1 KiB."""
    chosen = "x\n2026-12-03 00:00:00 ERROR forged\x1b[31m" + "A" * 26_000
    for formatter in (TextFormatter(), JsonFormatter()):
        line = formatter.format(record(handoff_id=chosen))
        assert "\n" not in line
        assert "\x1b" not in line
        assert len(line) < 1200
        assert "more characters not logged" in line


def test_the_core_s_lines_are_rate_limited_and_peer_errors_are_warnings(
    caplog: pytest.LogCaptureFixture,
) -> None:
    clock = FakeClock(1000.0)
    window = NativeWindow(logging.getLogger("grpc.core"), clock)
    peer = "E1203 07:01:47.741000    2162 hpack_parser.cc:1048] Error parsing ':scheme' metadata"
    with caplog.at_level(logging.INFO, "grpc.core"):
        for _ in range(50):
            window.log(peer)
        clock.now += 1.0
        window.log("E1203 07:01:48.741000    2162 server.cc:12] a real error")
    levels = [r.levelno for r in caplog.records]
    assert levels == [logging.WARNING] * 20 + [logging.WARNING, logging.ERROR]
    assert caplog.records[20].getMessage() == (
        "30 more lines of gRPC's core not logged in the second after the first 20"
    )


async def test_grpc_s_own_lines_go_through_the_same_formatter(tmp_path: Path) -> None:
    """A failed TLS handshake makes gRPC's C core write a line of its own;
    in a JSON log it is a JSON record like every other line."""
    pki = make_pki(tmp_path)
    flags = ("--tls-cert", str(pki.server.cert_path), "--tls-key", str(pki.server.key_path))
    async with asyncio.timeout(30.0), serving(tmp_path, *flags, "--log-format", "json") as served:
        async with grpc.aio.insecure_channel(served.target) as plaintext:  # to a TLS port
            stub = pb_grpc.HandoffCoordinatorStub(plaintext)
            call = stub.GetHandoff(pb.GetHandoffRequest(handoff_id="x"), timeout=1.0)
            assert await call.code() is grpc.StatusCode.UNAVAILABLE
        # The relay is a thread of the server's: wait for its line to land.
        while "Handshake failed" not in served.log_text():  # noqa: ASYNC110 (a file has no event)
            await asyncio.sleep(0.05)
    records = [json.loads(line) for line in served.log_text().splitlines()]
    handshake = [r for r in records if "Handshake failed" in r["message"]]
    assert handshake
    assert handshake[0]["logger"] == "grpc.core"
    assert "ssl_transport_security.cc" in handshake[0]["message"]
