"""Every metric the alerts and the dashboard read exists in a real server's /metrics.

A server runs a few handoffs (two successes, a client cancel, a timeout, a
rejected call); then its /metrics must hold every metric name and every label
value that deploy/prometheus/rules.yaml and deploy/grafana/handoff.json select
on, and the counters must have moved the way the alerts assume.
"""

from __future__ import annotations

import asyncio
import urllib.request
from collections.abc import Iterator

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from handoff_proto.v1 import coordinator_pb2 as pb
from handoff_proto.v1 import coordinator_pb2_grpc as pb_grpc
from tests.support.deploy import (
    Matcher,
    dashboard,
    dashboard_queries,
    matchers,
    metric_names,
    recorded_names,
    rule_groups,
)
from tests.support.rpc import DESTINATION, SOURCE, recorders
from tests.support.servers import StartServer

# Made by Prometheus itself, not by the server.
SYNTHETIC = {"up"}
# Target labels Prometheus attaches when it scrapes; the server never exposes them
# (except `shard`, which deploy/k8s/servicemonitor.yaml sets from the pod's name
# and the server puts on handoff_shard_info alone).
TARGET_LABELS = {"namespace", "job", "instance", "pod", "shard"}
# Metrics the `shards` branch adds (issue 13); until it is merged, a server does
# not expose them and the check that it does is skipped, naming them.
AWAITING_SHARDS = {"handoff_misrouted_starts_total", "handoff_shard_info"}

OUTCOME = {
    pb.ACTION_KIND_SUBMIT_PREFILL: pb.OUTCOME_KIND_SUBMITTED,
    pb.ACTION_KIND_RESERVE_DESTINATION: pb.OUTCOME_KIND_ACCEPTED,
    pb.ACTION_KIND_START_TRANSFER: pb.OUTCOME_KIND_SCHEDULED,
    pb.ACTION_KIND_ACTIVATE_DESTINATION: pb.OUTCOME_KIND_APPLIED,
    pb.ACTION_KIND_RELEASE_SOURCE: pb.OUTCOME_KIND_APPLIED,
    pb.ACTION_KIND_CANCEL_SOURCE: pb.OUTCOME_KIND_NOOP,
    pb.ACTION_KIND_CANCEL_DESTINATION: pb.OUTCOME_KIND_NOOP,
}
# The fact an engine reports once the action is done.
FACT_AFTER = {
    pb.ACTION_KIND_SUBMIT_PREFILL: pb.Fact(
        source_held=pb.SourceHeld(
            transfer_timing=pb.TransferTiming(
                mode=pb.TRANSFER_TIMING_MODE_FULL_PROMPT,
                full_prompt_tokens=512,
                kv_bytes_per_token=131072,
                bandwidth_gb_s=50.0,
            )
        )
    ),
    pb.ACTION_KIND_RESERVE_DESTINATION: pb.Fact(
        destination_reserved=pb.DestinationReserved(transferable_prompt_tokens=512)
    ),
    pb.ACTION_KIND_START_TRANSFER: pb.Fact(transfer_completed=pb.TransferCompleted()),
}


async def drive(
    stub: pb_grpc.HandoffCoordinatorAsyncStub, handoff_id: str, actions: Iterator[pb.Action]
) -> pb.Handoff:
    """Act as both engines: report each action's expected outcome and the fact that follows."""
    pending = list(actions)
    while pending:
        action = pending.pop(0)
        if action.kind == pb.ACTION_KIND_COMPLETE:
            continue
        outcome = pb.Outcome(kind=OUTCOME[action.kind])
        response = await stub.ReportOutcome(
            pb.ReportOutcomeRequest(handoff_id=handoff_id, action_id=action.id, outcome=outcome)
        )
        pending.extend(response.actions)
        if action.kind in FACT_AFTER:
            fact = FACT_AFTER[action.kind]
            reported = await stub.ReportFact(pb.ReportFactRequest(handoff_id=handoff_id, fact=fact))
            pending.extend(reported.actions)
    got = await stub.GetHandoff(pb.GetHandoffRequest(handoff_id=handoff_id))
    return got.handoff


def start(
    handoff_id: str, engine: pb.EngineType.ValueType, timeout_s: float | None = None
) -> pb.StartHandoffRequest:
    request = pb.StartHandoffRequest(
        handoff_id=handoff_id,
        engine_type=engine,
        source_engine_id=SOURCE,
        destination_engine_id=DESTINATION,
        fallback_transfer_delay_ms=1.0,
    )
    if timeout_s is not None:
        request.timeout_s = timeout_s
    return request


def scrape(port: int) -> list[Sample]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        text = response.read().decode()
    return [s for family in text_string_to_metric_families(text) for s in family.samples]


def value(samples: list[Sample], name: str, **labels: str) -> float:
    (sample,) = (s for s in samples if s.name == name and s.labels == labels)
    return sample.value


@pytest.fixture
async def samples(start_server: StartServer) -> list[Sample]:
    server = await start_server()
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        stub = pb_grpc.HandoffCoordinatorStub(channel)
        async with recorders(stub, SOURCE, DESTINATION) as (source, _):
            for number, engine in enumerate((pb.ENGINE_TYPE_VLLM, pb.ENGINE_TYPE_SGLANG)):
                handoff_id = f"00000000-0000-4000-8000-00000000000{number}"
                started = await stub.StartHandoff(start(handoff_id, engine))
                handoff = await drive(stub, handoff_id, iter(started.actions))
                assert (handoff.phase, handoff.completion) == (
                    pb.PHASE_COMPLETE,
                    pb.COMPLETION_SUCCESS,
                )

            canceled_id = "00000000-0000-4000-8000-00000000000c"
            await stub.StartHandoff(start(canceled_id, pb.ENGINE_TYPE_VLLM))
            cancel = pb.Fact(canceled=pb.Canceled(reason="client went away"))
            response = await stub.ReportFact(
                pb.ReportFactRequest(handoff_id=canceled_id, fact=cancel)
            )
            handoff = await drive(stub, canceled_id, iter(response.actions))
            assert handoff.completion == pb.COMPLETION_CANCELED

            # Nobody answers SubmitPrefill: the server times the handoff out and
            # sends the source CancelSource (action 1) on its stream.
            late_id = "00000000-0000-4000-8000-00000000000d"
            await stub.StartHandoff(start(late_id, pb.ENGINE_TYPE_VLLM, timeout_s=0.1))
            cancel_source = await asyncio.wait_for(source.wait_for(late_id, 1), 10)
            assert cancel_source.kind == pb.ACTION_KIND_CANCEL_SOURCE
            handoff = await drive(stub, late_id, iter([cancel_source]))
            assert handoff.completion == pb.COMPLETION_CANCELED

            with pytest.raises(grpc.aio.AioRpcError) as rejected:
                await stub.GetHandoff(
                    pb.GetHandoffRequest(handoff_id="00000000-0000-4000-8000-0000000000ff")
                )
            assert rejected.value.code() is grpc.StatusCode.NOT_FOUND

            return await asyncio.to_thread(scrape, server.metrics_port)


def used_queries() -> list[tuple[str, str]]:
    """(where, PromQL) for every rule expression and dashboard query."""
    queries = [
        (f"rules.yaml {rule.get('alert') or rule.get('record')}", rule["expr"])
        for group in rule_groups()
        for rule in group["rules"]
    ]
    queries += [("handoff.json", query) for query in dashboard_queries(dashboard())]
    return queries


def test_counters_moved_as_the_alerts_assume(samples: list[Sample]) -> None:
    assert value(samples, "handoff_started_total") == 4
    assert value(samples, "handoff_completed_total", result="success") == 2
    assert value(samples, "handoff_completed_total", result="canceled") == 2
    assert value(samples, "handoff_timed_out_total") == 1
    assert value(samples, "handoff_facts_total", kind="timed_out", origin="server") == 1
    assert value(samples, "handoff_facts_total", kind="canceled", origin="engine") == 1
    assert value(samples, "handoff_rejections_total", rpc="GetHandoff", code="NOT_FOUND") == 1
    assert value(samples, "handoff_duration_seconds_count", result="success") == 2
    assert value(samples, "handoff_source_hold_seconds_count") == 2  # the others never held
    assert value(samples, "handoff_handoffs", phase="complete") == 4
    assert value(samples, "handoff_handoffs", phase="active") == 0
    assert value(samples, "handoff_handoffs", phase="cleaning_up") == 0
    assert value(samples, "handoff_engine_streams") == 2
    assert value(samples, "handoff_abandoned_total") == 0


def test_every_metric_name_used_is_exposed(samples: list[Sample]) -> None:
    exposed = {s.name for s in samples}
    recorded = recorded_names()
    awaited: set[str] = set()
    for where, query in used_queries():
        for name in metric_names(query):
            if ":" in name:
                assert name in recorded, f"{where}: {name} is no recording rule in rules.yaml"
            elif name in AWAITING_SHARDS and name not in exposed:
                awaited.add(name)
            else:
                assert name in exposed | SYNTHETIC, f"{where}: {name} is not in /metrics"
    if awaited:
        pytest.skip(f"not yet in /metrics (the `shards` branch adds them): {sorted(awaited)}")


def test_every_label_value_selected_on_is_exposed(samples: list[Sample]) -> None:
    checked: set[Matcher] = set()
    for where, query in used_queries():
        for matcher in matchers(query):
            if matcher.metric in SYNTHETIC or matcher.label in TARGET_LABELS:
                continue
            series = [s.labels for s in samples if s.name == matcher.metric]
            values = {labels.get(matcher.label) for labels in series}
            assert values - {None}, f"{where}: {matcher.metric} has no label {matcher.label}"
            if matcher.op == "=":
                wanted = {matcher.value}
            elif matcher.op == "=~":
                wanted = set(matcher.value.split("|"))
                assert all(w.isidentifier() for w in wanted), f"{where}: regex too clever to check"
            else:
                continue
            assert wanted <= values, f"{where}: {matcher} matches nothing in /metrics"
            checked.add(matcher)
    assert Matcher("handoff_handoffs", "phase", "=", "cleaning_up") in checked
