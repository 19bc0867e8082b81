"""deploy/grafana/handoff.json: a well-formed dashboard with the panels the issue asks for.

Its queries are parsed by promtool (tests/deploy/test_deploy_prometheus.py) and their
metric names checked against a real server (tests/deploy/test_deploy_metrics.py).
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from tests.support.deploy import DASHBOARD, dashboard, dashboard_queries, panels

# What an operator must be able to see, and a metric that shows it.
REQUIRED = {
    "throughput": "handoff_started_total",
    "completions by result": "handoff_completed_total",
    "handoff duration p50 and p99": "handoff_duration_seconds_bucket",
    "active handoffs by phase": "handoff_handoffs",
    "source hold time": "handoff_source_hold_seconds_bucket",
    "action latency by kind": "handoff_action_latency_seconds_bucket",
    # issue 26: what the coordinator adds to each hop of the critical path
    "coordinator's share of each hop": "handoff_dispatch_latency_seconds_bucket",
    "engine streams": "handoff_engine_streams",
    "rejections": "handoff_rejections_total",
    # per shard (issue 13): where the load goes, what a shard being removed still holds,
    # which shard is down, unreached by the sidecars, or refusing misrouted starts
    "handoffs started by shard": "handoff_started_total",
    "active handoffs by shard": "handoff_handoffs",
    "shards up": "up",
    "engine streams by shard": "handoff_engine_streams",
    "misrouted starts by shard": "handoff_misrouted_starts_total",
    "journal replay time by shard": "handoff_recovery_seconds",
}


def graph_panels() -> list[dict[str, Any]]:
    return [p for p in panels(dashboard()) if p["type"] != "row"]


def test_is_json_with_a_stable_identity() -> None:
    document = json.loads(DASHBOARD.read_text())
    assert document["uid"] == "handoff-coordinator"
    assert document["title"]
    assert isinstance(document["schemaVersion"], int)
    names = [v["name"] for v in document["templating"]["list"]]
    assert names == ["datasource", "namespace", "job", "shard"]


def test_panels_have_unique_ids_and_do_not_overlap() -> None:
    every = panels(dashboard())
    ids = [p["id"] for p in every]
    assert len(ids) == len(set(ids))
    taken: set[tuple[int, int]] = set()
    for panel in every:
        grid = panel["gridPos"]
        assert 0 <= grid["x"] < grid["x"] + grid["w"] <= 24, panel["title"]
        cells = {
            (x, y)
            for x in range(grid["x"], grid["x"] + grid["w"])
            for y in range(grid["y"], grid["y"] + grid["h"])
        }
        assert not cells & taken, f"{panel['title']} overlaps another panel"
        taken |= cells


def test_every_query_uses_the_selected_datasource_and_scope() -> None:
    for panel in graph_panels():
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
        assert panel["targets"], panel["title"]
        ref_ids = [t["refId"] for t in panel["targets"]]
        assert len(ref_ids) == len(set(ref_ids)), panel["title"]
        for target in panel["targets"]:
            assert target["datasource"] == panel["datasource"]
            scope = 'namespace=~"$namespace", job=~"$job", shard=~"$shard"'
            assert scope in target["expr"], panel["title"]
    assert len(dashboard_queries(dashboard())) > len(graph_panels())


@pytest.mark.parametrize(("topic", "metric"), REQUIRED.items())
def test_shows(topic: str, metric: str) -> None:
    words = topic.replace(" and ", " ").split()
    matching = [
        panel
        for panel in graph_panels()
        if all(w in (panel["title"] + " " + panel["description"]).lower() for w in words)
    ]
    assert matching, f"no panel titled for {topic!r}"
    exprs = " ".join(t["expr"] for panel in matching for t in panel["targets"])
    assert metric in exprs, f"the {topic!r} panel does not query {metric}"
