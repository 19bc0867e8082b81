"""Prometheus metrics. Labels are bounded enums; a handoff id is never a label.

Each server owns its own CollectorRegistry, so tests can run several servers
in one process and read exact values.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.metrics import MetricWrapperBase

from handoff_server.domain.model import (
    FACT_KINDS,
    ActionKind,
    Completion,
    EndCause,
    LostCause,
    OutcomeKind,
    Phase,
)
from handoff_server.ops.tracecontext import TRACE_HEADERS

# Handoffs take milliseconds to minutes; decodes after success can run longer.
DURATION_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
# Fine below 10 ms: a hop's share is the commit delay (2 ms) and a few turns
# of the event loop, and its p99 is read from these buckets.
DISPATCH_BUCKETS = (
    *(0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.003, 0.004, 0.005, 0.0075, 0.01),
    *(0.025, 0.05, 0.1, 0.25, 1, 5),
)
LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 5, 30)

RPCS = (
    "StartHandoff",
    "ReportFact",
    "ReportOutcome",
    "StreamActions",
    "Connect",
    "GetHandoff",
    "Reconcile",
)


class Metrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self.started = Counter("handoff_started", "Handoffs started.", registry=r)
        self.completed = Counter(
            "handoff_completed", "Handoff completions by result.", ["result"], registry=r
        )
        self.reopened = Counter(
            "handoff_reopened",
            "Successful handoffs reopened by a terminal fact or a lost decode.",
            registry=r,
        )
        self.timed_out = Counter(
            "handoff_timed_out", "Handoffs whose deadline passed while active.", registry=r
        )
        self.abandoned = Counter(
            "handoff_abandoned",
            "Handoffs removed while still cleaning up after cleanup_timeout.",
            registry=r,
        )
        self.trace_context_dropped = Counter(
            "handoff_trace_context_dropped",
            "StartHandoff trace context headers dropped, by header: not one valid W3C "
            "traceparent, or a tracestate without one or over 512 bytes.",
            ["header"],
            registry=r,
        )
        self.engines_lost = Counter(
            "handoff_engines_lost",
            "Engines declared lost in their unfinished handoffs, by cause: restarted (a new "
            "incarnation subscribed), unreachable (no live stream for delivery_timeout) or "
            "reconciled (its sidecar freed the side on its own: lease, orphan).",
            ["cause"],
            registry=r,
        )
        self.timer_errors = Counter(
            "handoff_timer_errors",
            "Timers that raised while firing (logged with the handoff or engine id).",
            registry=r,
        )
        self.redeliveries = Counter(
            "handoff_redeliveries", "Actions re-sent to an engine, by kind.", ["kind"], registry=r
        )
        self.facts = Counter(
            "handoff_facts", "Facts applied, by kind and origin.", ["kind", "origin"], registry=r
        )
        self.actions = Counter("handoff_actions", "Actions issued, by kind.", ["kind"], registry=r)
        self.outcomes = Counter(
            "handoff_outcomes", "Outcomes accepted, by kind.", ["kind"], registry=r
        )
        self.rejections = Counter(
            "handoff_rejections",
            "Rejected calls, by RPC and gRPC code.",
            ["rpc", "code"],
            registry=r,
        )
        self.handoffs = Gauge("handoff_handoffs", "Handoffs held, by phase.", ["phase"], registry=r)
        self.engine_streams = Gauge(
            "handoff_engine_streams", "Live engine action streams.", registry=r
        )
        self.duration = Histogram(
            "handoff_duration_seconds",
            "Time from start to completion, by result.",
            ["result"],
            buckets=DURATION_BUCKETS,
            registry=r,
        )
        self.action_latency = Histogram(
            "handoff_action_latency_seconds",
            "Time from an action's issue to its outcome, by kind.",
            ["kind"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.dispatch_latency = Histogram(
            "handoff_dispatch_latency_seconds",
            "Time from the call that issued an action to its first write to the engine's "
            "stream, the journal's commit included: the coordinator's own share of a hop, "
            "by kind.",
            ["kind"],
            buckets=DISPATCH_BUCKETS,
            registry=r,
        )
        self.source_hold = Histogram(
            "handoff_source_hold_seconds",
            "Time the source held its KV: SourceHeld until released or canceled.",
            buckets=DURATION_BUCKETS,
            registry=r,
        )
        self.recovered_handoffs = Gauge(
            "handoff_recovered_handoffs",
            "Handoffs this server recovered from its journal at start (0 without one).",
            registry=r,
        )
        self.recovery_seconds = Gauge(
            "handoff_recovery_seconds",
            "How long this server's start spent replaying its journal.",
            registry=r,
        )
        self.shard_info = Gauge(
            "handoff_shard_info",
            "1, labelled with the name of the shard this process is (docs/sharding.md).",
            ["shard"],
            registry=r,
        )
        self.misrouted_starts = Counter(
            "handoff_misrouted_starts",
            "StartHandoff calls refused because another shard owns the id (a client "
            "routing on another shard map).",
            registry=r,
        )
        self.cancellations = Counter(
            "handoff_cancellations",
            "Handoffs completed canceled, by why they went into cleanup (the reason "
            "GetHandoff shows): frontend_canceled, deadline, engine_lost, action_failed, "
            "failed, drain.",
            ["reason"],
            registry=r,
        )
        self.calls_paced = Counter(
            "handoff_calls_paced",
            "Calls that waited for their turn because their caller identity reached its rate "
            "of calls (--max-calls-per-s-per-identity), each at most --rate-wait-s.",
            registry=r,
        )
        self.reports_paced = Counter(
            "handoff_reports_paced",
            "Connect messages held back because their caller identity reached its rate of "
            "reports (--max-reports-per-s-per-identity): its streams are read more slowly.",
            registry=r,
        )
        self.unknown_engine_starts = Counter(
            "handoff_unknown_engine_starts",
            "StartHandoff calls naming an engine that has not subscribed to this server "
            "since it started (a typo, or engines that connect later); refused with "
            "--require-known-engines.",
            registry=r,
        )
        # Label children resolved once: .labels() costs a lock and a dict
        # lookup on every call, and these run on every handoff.
        self.completed_by = {c: self.completed.labels(c.value) for c in Completion}
        self.cancellations_by: dict[EndCause, Counter] = {
            c: self.cancellations.labels(c.value) for c in EndCause if c is not EndCause.SUCCEEDED
        }
        self.duration_by = {c: self.duration.labels(c.value) for c in Completion}
        self.actions_by = {k: self.actions.labels(k.value) for k in ActionKind}
        self.redeliveries_by = {k: self.redeliveries.labels(k.value) for k in ActionKind}
        self.latency_by = {k: self.action_latency.labels(k.value) for k in ActionKind}
        self.dispatch_latency_by = {k: self.dispatch_latency.labels(k.value) for k in ActionKind}
        self.outcomes_by = {k: self.outcomes.labels(k.value) for k in OutcomeKind}
        self.facts_by = {
            (kind, origin): self.facts.labels(kind, origin)
            for kind in FACT_KINDS
            for origin in ("engine", "server")
        }
        self.handoffs_by = {p: self.handoffs.labels(p.value) for p in Phase}
        self.trace_context_dropped_by = {
            header: self.trace_context_dropped.labels(header) for header in TRACE_HEADERS
        }
        self.engines_lost_by = {cause: self.engines_lost.labels(cause.value) for cause in LostCause}
        # Zero-valued series exist from the start, so rate() and absent()
        # behave before the first event.
        for rpc in RPCS:
            for code in ("INVALID_ARGUMENT", "FAILED_PRECONDITION", "NOT_FOUND"):
                self.rejections.labels(rpc, code)

    def rejected(self, rpc: str, code: str) -> None:
        self.rejections.labels(rpc, code).inc()


class _Discarded:
    """A series that keeps nothing it is told."""

    def inc(self, amount: float = 1) -> None:
        pass

    def dec(self, amount: float = 1) -> None:
        pass

    def set(self, value: float) -> None:
        pass

    def observe(self, amount: float, exemplar: object = None) -> None:
        pass


def discarding() -> Metrics:
    """Metrics whose every series discards what it is told: a journal's
    replay runs every call again, and its history is not news (real series'
    locks and label lookups cost a replay dearly: bench/RESULTS.md)."""
    metrics = Metrics()
    discarded = _Discarded()
    for name, value in list(vars(metrics).items()):
        if isinstance(value, dict):
            setattr(metrics, name, dict.fromkeys(value, discarded))
        elif isinstance(value, MetricWrapperBase):
            setattr(metrics, name, discarded)
    return metrics
