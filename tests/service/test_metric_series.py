"""The metrics' own series expose what prometheus_client's would, given the same updates.

prometheus_client's Counter, Gauge and Histogram are the reference: each
example drives both with the same updates and compares every sample but the
creation times, bucket edges and exemplars included.
"""

from __future__ import annotations

from typing import Any

import prometheus_client
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry
from prometheus_client.samples import Sample

from handoff_server.ops.metrics import DISPATCH_BUCKETS, Metrics, discarding

TRACE = {"trace_id": "0af7651916cd43dd8448eb211c80319c"}

# The bounds themselves and their neighbours, where "le" is decided.
AMOUNTS = st.one_of(
    st.sampled_from(DISPATCH_BUCKETS),
    st.sampled_from(DISPATCH_BUCKETS).map(lambda bound: bound * (1 + 1e-9)),
    st.floats(min_value=0, max_value=1e4, allow_nan=False),
)
UPDATE_METHODS = {
    "counter": ("counter", "inc"),
    "gauge+": ("gauge", "inc"),
    "gauge-": ("gauge", "dec"),
    "gauge=": ("gauge", "set"),
    "histogram": ("histogram", "observe"),
}
UPDATES = st.lists(
    st.tuples(
        st.sampled_from(sorted(UPDATE_METHODS)),
        st.sampled_from(["a", "b"]),
        AMOUNTS,
        st.booleans(),
    ),
    max_size=60,
)


def samples(registry: CollectorRegistry) -> list[Sample]:
    """Every sample of the metrics c, g and h_seconds, but creation times;
    an exemplar without its timestamp (the observation's)."""
    return [
        sample._replace(
            value=float(sample.value),
            exemplar=sample.exemplar and sample.exemplar._replace(timestamp=None),
        )
        for metric in registry.collect()
        if metric.name in {"c", "g", "h_seconds"}
        for sample in metric.samples
        if not sample.name.endswith("_created")
    ]


@settings(max_examples=200, deadline=None)
@given(UPDATES)
def test_the_same_updates_give_the_same_samples(
    updates: list[tuple[str, str, float, bool]],
) -> None:
    ours = Metrics()
    reference = CollectorRegistry()
    # Each update's series, ours and prometheus_client's, and the method it calls.
    series: dict[str, tuple[Any, Any]] = {
        "counter": (
            ours._counters("c", "a counter", "kind"),
            prometheus_client.Counter("c", "a counter", ["kind"], registry=reference),
        ),
        "gauge": (
            ours._gauges("g", "a gauge", "kind"),
            prometheus_client.Gauge("g", "a gauge", ["kind"], registry=reference),
        ),
        "histogram": (
            ours._histograms("h_seconds", "a histogram", DISPATCH_BUCKETS, "kind"),
            prometheus_client.Histogram(
                "h_seconds", "a histogram", ["kind"], buckets=DISPATCH_BUCKETS, registry=reference
            ),
        ),
    }
    for update, label, amount, traced in updates:
        kind, method = UPDATE_METHODS[update]
        for family in series[kind]:
            update_series = getattr(family.labels(label), method)
            if kind == "histogram":
                update_series(amount, TRACE if traced else None)
            else:
                update_series(amount)
    assert samples(ours.registry) == samples(reference)


def test_a_series_created_at_start_is_exposed_before_its_first_update() -> None:
    metrics = Metrics()
    names = {sample.name for metric in metrics.registry.collect() for sample in metric.samples}
    assert {"handoff_started_total", "handoff_started_created", "handoff_engine_streams"} <= names
    assert "handoff_source_hold_seconds_bucket" in names


def test_a_replay_counts_nothing() -> None:
    quiet = discarding()
    quiet.started.inc()
    quiet.source_hold.observe(1.0, TRACE)
    quiet.rejected("Connect", "UNAUTHENTICATED")
    values = {
        sample.name: sample.value
        for metric in quiet.registry.collect()
        for sample in metric.samples
        if sample.name in {"handoff_started_total", "handoff_source_hold_seconds_count"}
    }
    assert values == {"handoff_started_total": 0, "handoff_source_hold_seconds_count": 0}
