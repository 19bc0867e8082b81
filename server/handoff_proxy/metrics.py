"""The proxy's metrics, ``handoff_proxy_*``, on /metrics in Prometheus' text format.

A registry per proxy (not prometheus_client's global one), so that tests and
a process embedding two proxies keep them apart. Labels are bounded: the
endpoint, the HTTP status, the leg, the why of a failure (a fixed set), and
the engine ids given on the command line.
"""

from __future__ import annotations

from collections.abc import Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

# Seconds; a prefill of a long prompt on a CPU takes seconds, a decode leg longer.
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class ProxyMetrics:
    def __init__(self, engines: Sequence[tuple[str, str]]) -> None:
        """``engines``: (role, engine id) of every engine, so their series exist from the start."""
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "handoff_proxy_requests_total",
            "Client requests answered, by endpoint and HTTP status",
            ["endpoint", "code"],
            registry=self.registry,
        )
        self.in_flight = Gauge(
            "handoff_proxy_requests_in_flight",
            "Client requests being served now",
            registry=self.registry,
        )
        self.engine_in_flight = Gauge(
            "handoff_proxy_engine_requests_in_flight",
            "Requests in flight per engine, as the pair selection counts them",
            ["role", "engine"],
            registry=self.registry,
        )
        self.failures = Counter(
            "handoff_proxy_failures_total",
            "Requests that ended in an error, by the leg open then and why",
            ["leg", "why"],
            registry=self.registry,
        )
        self.disconnects = Counter(
            "handoff_proxy_client_disconnects_total",
            "Clients gone before their answer was complete, by the leg open then",
            ["leg"],
            registry=self.registry,
        )
        self.duration = Histogram(
            "handoff_proxy_request_duration_seconds",
            "From the request's arrival to the end of its answer",
            ["endpoint"],
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.first_byte = Histogram(
            "handoff_proxy_time_to_first_byte_seconds",
            "From the request's arrival to the decode's first byte (the first token)",
            ["endpoint"],
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.leg_duration = Histogram(
            "handoff_proxy_leg_duration_seconds",
            "How long each leg took: start (StartHandoff), prefill, decode (to its end)",
            ["leg"],
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.coordinator_errors = Counter(
            "handoff_proxy_coordinator_errors_total",
            "Coordinator calls that failed, by call",
            ["call"],
            registry=self.registry,
        )
        self.polls = Counter(
            "handoff_proxy_polls_total",
            "GetHandoff calls made to watch open legs",
            registry=self.registry,
        )
        for role, engine_id in engines:
            self.engine_in_flight.labels(role, engine_id).set(0)
        for endpoint in ("completions", "chat_completions"):
            self.duration.labels(endpoint)
            self.first_byte.labels(endpoint)
        for leg in ("start", "prefill", "decode"):
            self.leg_duration.labels(leg)
        for call in ("start", "get", "cancel", "fail"):
            self.coordinator_errors.labels(call)
