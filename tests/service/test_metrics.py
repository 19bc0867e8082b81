"""Exact metric values after a scripted scenario, read over HTTP; and a real Prometheus scrape."""

from __future__ import annotations

import asyncio
import json
import subprocess
import urllib.parse
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from handoff_proto.v1 import coordinator_pb2 as pb
from handoff_proto.v1 import coordinator_pb2_grpc as pb_grpc
from handoff_server.service.app import Server
from tests.support.fakes import free_port
from tests.support.processes import debian_binary
from tests.support.rpc import (
    CANCELED,
    DESTINATION,
    HELD,
    SOURCE,
    SUBMITTED,
    fact,
    outcome,
    start_request,
    succeed,
)


def scrape(port: int) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        text = response.read().decode()
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


async def scripted_scenario(server: Server) -> None:
    """One success, one cancel mid-flight, one rejected report."""
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        stub = pb_grpc.HandoffCoordinatorStub(channel)
        ok = str(uuid.uuid4())
        await stub.StartHandoff(start_request(ok))
        await succeed(stub, ok)
        canceled = str(uuid.uuid4())
        await stub.StartHandoff(start_request(canceled))
        await stub.ReportFact(pb.ReportFactRequest(handoff_id=canceled, fact=CANCELED))
        await stub.ReportOutcome(
            pb.ReportOutcomeRequest(
                handoff_id=canceled, action_id=1, outcome=pb.Outcome(kind=pb.OUTCOME_KIND_NOOP)
            )
        )
        with pytest.raises(grpc.aio.AioRpcError):
            await stub.ReportOutcome(
                pb.ReportOutcomeRequest(
                    handoff_id=canceled,
                    action_id=99,
                    outcome=pb.Outcome(kind=pb.OUTCOME_KIND_FAILED),  # no reason
                )
            )


def labels(**values: str) -> frozenset[tuple[str, str]]:
    return frozenset(values.items())


async def test_exact_metric_values_after_a_scripted_scenario(server: Server) -> None:
    await scripted_scenario(server)
    samples = await asyncio.to_thread(scrape, server.metrics_port)
    expected = {
        ("handoff_started_total", labels()): 2,
        ("handoff_completed_total", labels(result="success")): 1,
        ("handoff_completed_total", labels(result="canceled")): 1,
        ("handoff_reopened_total", labels()): 0,
        ("handoff_timed_out_total", labels()): 0,
        ("handoff_abandoned_total", labels()): 0,
        ("handoff_facts_total", labels(kind="source_held", origin="engine")): 1,
        ("handoff_facts_total", labels(kind="destination_reserved", origin="engine")): 1,
        ("handoff_facts_total", labels(kind="transfer_completed", origin="engine")): 1,
        ("handoff_facts_total", labels(kind="canceled", origin="engine")): 1,
        ("handoff_facts_total", labels(kind="failed", origin="server")): 0,
        ("handoff_actions_total", labels(kind="submit_prefill")): 2,
        ("handoff_actions_total", labels(kind="reserve_destination")): 1,
        ("handoff_actions_total", labels(kind="start_transfer")): 1,
        ("handoff_actions_total", labels(kind="activate_destination")): 1,
        ("handoff_actions_total", labels(kind="release_source")): 1,
        ("handoff_actions_total", labels(kind="cancel_source")): 1,
        ("handoff_actions_total", labels(kind="cancel_destination")): 0,
        ("handoff_actions_total", labels(kind="complete")): 2,
        ("handoff_outcomes_total", labels(kind="submitted")): 1,
        ("handoff_outcomes_total", labels(kind="accepted")): 1,
        ("handoff_outcomes_total", labels(kind="scheduled")): 1,
        ("handoff_outcomes_total", labels(kind="applied")): 2,
        ("handoff_outcomes_total", labels(kind="noop")): 1,
        ("handoff_rejections_total", labels(rpc="ReportOutcome", code="INVALID_ARGUMENT")): 1,
        ("handoff_rejections_total", labels(rpc="ReportFact", code="INVALID_ARGUMENT")): 0,
        ("handoff_handoffs", labels(phase="active")): 0,
        ("handoff_handoffs", labels(phase="cleaning_up")): 0,
        ("handoff_handoffs", labels(phase="complete")): 2,
        ("handoff_engine_streams", labels()): 0,
        ("handoff_duration_seconds_count", labels(result="success")): 1,
        ("handoff_duration_seconds_count", labels(result="canceled")): 1,
        ("handoff_action_latency_seconds_count", labels(kind="submit_prefill")): 1,
        ("handoff_action_latency_seconds_count", labels(kind="cancel_source")): 1,
        ("handoff_source_hold_seconds_count", labels()): 1,
    }
    assert {key: samples.get(key) for key in expected} == expected
    assert not any("handoff_id" in dict(key[1]) for key in samples), "ids are never labels"


async def next_action(stream: grpc.aio.UnaryStreamCall[Any, Any]) -> pb.Action:
    action = await stream.read()
    assert isinstance(action, pb.Action), action  # not the stream's end
    return action


async def test_dispatch_latency_counts_first_writes_to_streams_live_at_issue(
    server: Server,
) -> None:
    """handoff_dispatch_latency_seconds: the coordinator's share of a hop. An
    action counts once, at its first write, and only if its engine had a
    stream when it was issued (else the wait was the engine's absence)."""
    async with (
        asyncio.timeout(30),
        grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel,
    ):
        stub = pb_grpc.HandoffCoordinatorStub(channel)
        source = stub.StreamActions(pb.StreamActionsRequest(engine_id=SOURCE))
        await source.initial_metadata()  # subscribed
        handoff_id = str(uuid.uuid4())
        await stub.StartHandoff(start_request(handoff_id))
        submit = await next_action(source)
        assert (submit.kind, submit.attempt) == (pb.ACTION_KIND_SUBMIT_PREFILL, 1)
        source.cancel()
        again = stub.StreamActions(pb.StreamActionsRequest(engine_id=SOURCE))
        redelivered = await next_action(again)  # unanswered, so written again: not counted again
        assert (redelivered.id, redelivered.attempt) == (submit.id, 2)
        # ReserveDestination is issued while the destination has no stream.
        await outcome(stub, handoff_id, submit.id, SUBMITTED)
        await fact(stub, handoff_id, HELD)
        destination = stub.StreamActions(pb.StreamActionsRequest(engine_id=DESTINATION))
        reserve = await next_action(destination)
        assert (reserve.kind, reserve.attempt) == (pb.ACTION_KIND_RESERVE_DESTINATION, 1)
        samples = await asyncio.to_thread(scrape, server.metrics_port)
        again.cancel()
        destination.cancel()
    count = "handoff_dispatch_latency_seconds_count"
    assert samples[(count, labels(kind="submit_prefill"))] == 1
    assert samples[(count, labels(kind="reserve_destination"))] == 0
    # Its one observation: a moment on loopback, not the test's seconds.
    assert 0 <= samples[("handoff_dispatch_latency_seconds_sum", labels(kind="submit_prefill"))] < 1


@pytest.fixture
def prometheus_binary() -> str:
    return debian_binary("prometheus", "prometheus")


@pytest.fixture
def prometheus(prometheus_binary: str, server: Server, tmp_path: Path) -> Iterator[str]:
    """A real Prometheus scraping the server's metrics port every 200 ms."""
    config = tmp_path / "prometheus.yml"
    config.write_text(
        "global:\n  scrape_interval: 200ms\n  scrape_timeout: 200ms\n"
        "scrape_configs:\n  - job_name: handoff\n    static_configs:\n"
        f"      - targets: ['127.0.0.1:{server.metrics_port}']\n"
    )
    address = f"127.0.0.1:{free_port()}"
    process = subprocess.Popen(
        [
            prometheus_binary,
            f"--config.file={config}",
            f"--storage.tsdb.path={tmp_path / 'data'}",
            f"--web.listen-address={address}",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        yield f"http://{address}"
    finally:
        process.terminate()
        process.wait(timeout=30)


def query(base: str, expression: str) -> dict[str, float]:
    url = f"{base}/api/v1/query?query={urllib.parse.quote(expression)}"
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            body = json.load(response)
    except OSError:
        return {}  # not up yet
    return {
        json.dumps(r["metric"].get("result", "")): float(r["value"][1])
        for r in body["data"]["result"]
    }


async def test_real_prometheus_scrapes_completions_and_cancellations(
    server: Server, prometheus: str
) -> None:
    await scripted_scenario(server)
    wanted = {'"success"': 1.0, '"canceled"': 1.0}
    seen: dict[str, float] = {}
    async with asyncio.timeout(60):
        # Prometheus offers no push notification of a scrape: poll its API.
        while seen != wanted:
            seen = await asyncio.to_thread(query, prometheus, "handoff_completed_total")
            if seen != wanted:
                await asyncio.sleep(0.2)
    cancels = await asyncio.to_thread(query, prometheus, 'handoff_actions_total{kind=~"cancel_.*"}')
    assert sum(cancels.values()) == 1.0
