"""Prometheus metrics. Labels are bounded enums; a handoff id is never a label.

Each server owns its own CollectorRegistry, so tests can run several servers
in one process and read exact values.

The series are plain numbers, updated on the event loop, and one collector
hands them to the registry, which prometheus_client renders as before
(``_created`` samples and exemplars included). prometheus_client's own series
take a lock on every update, and every handoff makes a score of them
(bench/RESULTS.md, "Issue 26: own metric series"). A scrape renders on
another thread: it copies each family's children first, so a label value
added meanwhile cannot break it, and it may read a histogram's sum one
observation apart from its count, as prometheus_client's may.
"""

from __future__ import annotations

import functools
import os
import time
from bisect import bisect_left
from collections.abc import Callable, Iterable, Iterator
from typing import Generic, TypeVar

from prometheus_client import CollectorRegistry
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector
from prometheus_client.samples import Exemplar, Sample
from prometheus_client.utils import floatToGoString

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

# prometheus_client's switch for the ``_created`` samples, read as it reads it.
CREATED = os.environ.get("PROMETHEUS_DISABLE_CREATED_SERIES", "False").lower() not in (
    "true",
    "1",
    "t",
)

Labels = dict[str, str]


class Counter:
    """One counter series."""

    __slots__ = ("value", "created")

    def __init__(self) -> None:
        self.value: float = 0
        self.created = time.time()

    def inc(self, amount: float = 1) -> None:
        self.value += amount

    def samples(self, name: str, labels: Labels) -> Iterator[Sample]:
        yield Sample(name + "_total", labels, self.value)
        if CREATED:
            yield Sample(name + "_created", labels, self.created)


class Gauge:
    """One gauge series."""

    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value: float = 0

    def inc(self, amount: float = 1) -> None:
        self.value += amount

    def dec(self, amount: float = 1) -> None:
        self.value -= amount

    def set(self, value: float) -> None:
        self.value = value

    def samples(self, name: str, labels: Labels) -> Iterator[Sample]:
        yield Sample(name, labels, self.value)


class Histogram:
    """One histogram series: a count per bucket (not cumulative until a
    scrape adds them up) and, per bucket, the latest observation's exemplar."""

    __slots__ = ("bounds", "les", "counts", "sum", "exemplars", "created")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = (*bounds, float("inf"))
        self.les = tuple(floatToGoString(bound) for bound in self.bounds)  # type: ignore[no-untyped-call]
        self.counts = [0] * len(self.bounds)
        self.sum = 0.0
        self.exemplars: list[Exemplar | None] = [None] * len(self.bounds)
        self.created = time.time()

    def observe(self, amount: float, exemplar: Labels | None = None) -> None:
        bucket = bisect_left(self.bounds, amount)  # the first bound >= amount
        self.counts[bucket] += 1
        self.sum += amount
        if exemplar:
            self.exemplars[bucket] = Exemplar(exemplar, amount, time.time())

    def samples(self, name: str, labels: Labels) -> Iterator[Sample]:
        total = 0
        for le, count, exemplar in zip(
            self.les, list(self.counts), list(self.exemplars), strict=True
        ):
            total += count
            yield Sample(name + "_bucket", {**labels, "le": le}, total, None, exemplar)
        yield Sample(name + "_count", labels, total)
        yield Sample(name + "_sum", labels, self.sum)
        if CREATED:
            yield Sample(name + "_created", labels, self.created)


S = TypeVar("S", Counter, Gauge, Histogram)


class Family(Generic[S]):
    """A metric: its name, help, type and one series per set of label values."""

    def __init__(
        self,
        kind: str,
        name: str,
        documentation: str,
        labelnames: Iterable[str],
        make: Callable[[], S],
    ) -> None:
        self.kind = kind
        self.name = name
        self.documentation = documentation
        self.labelnames = tuple(labelnames)
        self.make: Callable[[], S] = make
        self.children: dict[tuple[str, ...], S] = {}

    def labels(self, *values: str) -> S:
        child = self.children.get(values)
        if child is None:
            if len(values) != len(self.labelnames):
                raise ValueError(f"{self.name} is labelled {self.labelnames}, not {values}")
            child = self.children[values] = self.make()
        return child

    def metric(self) -> Metric:
        metric = Metric(self.name, self.documentation, self.kind)
        for values, child in self.children.copy().items():  # a copy is atomic; see above
            labels = dict(zip(self.labelnames, values, strict=True))
            metric.samples.extend(child.samples(self.name, labels))
        return metric


class Metrics(Collector):
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        self._families: list[Family[Counter] | Family[Gauge] | Family[Histogram]] = []
        self.registry.register(self)
        self.started = self._counter("handoff_started", "Handoffs started.")
        self.completed = self._counters(
            "handoff_completed", "Handoff completions by result.", "result"
        )
        self.reopened = self._counter(
            "handoff_reopened",
            "Successful handoffs reopened by a terminal fact or a lost decode.",
        )
        self.timed_out = self._counter(
            "handoff_timed_out", "Handoffs whose deadline passed while active."
        )
        self.abandoned = self._counter(
            "handoff_abandoned",
            "Handoffs removed while still cleaning up after cleanup_timeout.",
        )
        self.trace_context_dropped = self._counters(
            "handoff_trace_context_dropped",
            "StartHandoff trace context headers dropped, by header: not one valid W3C "
            "traceparent, or a tracestate without one or over 512 bytes.",
            "header",
        )
        self.engines_lost = self._counters(
            "handoff_engines_lost",
            "Engines declared lost in their unfinished handoffs, by cause: restarted (a new "
            "incarnation subscribed), unreachable (no live stream for delivery_timeout) or "
            "reconciled (its sidecar freed the side on its own: lease, orphan).",
            "cause",
        )
        self.timer_errors = self._counter(
            "handoff_timer_errors",
            "Timers that raised while firing (logged with the handoff or engine id).",
        )
        self.redeliveries = self._counters(
            "handoff_redeliveries", "Actions re-sent to an engine, by kind.", "kind"
        )
        self.facts = self._counters(
            "handoff_facts", "Facts applied, by kind and origin.", "kind", "origin"
        )
        self.actions = self._counters("handoff_actions", "Actions issued, by kind.", "kind")
        self.outcomes = self._counters("handoff_outcomes", "Outcomes accepted, by kind.", "kind")
        self.rejections = self._counters(
            "handoff_rejections", "Rejected calls, by RPC and gRPC code.", "rpc", "code"
        )
        self.handoffs = self._gauges("handoff_handoffs", "Handoffs held, by phase.", "phase")
        self.engine_streams = self._gauge("handoff_engine_streams", "Live engine action streams.")
        self.duration = self._histograms(
            "handoff_duration_seconds",
            "Time from start to completion, by result.",
            DURATION_BUCKETS,
            "result",
        )
        self.action_latency = self._histograms(
            "handoff_action_latency_seconds",
            "Time from an action's issue to its outcome, by kind.",
            LATENCY_BUCKETS,
            "kind",
        )
        self.dispatch_latency = self._histograms(
            "handoff_dispatch_latency_seconds",
            "Time from the call that issued an action to its first write to the engine's "
            "stream, the journal's commit included: the coordinator's own share of a hop, "
            "by kind.",
            DISPATCH_BUCKETS,
            "kind",
        )
        self.source_hold = self._histograms(
            "handoff_source_hold_seconds",
            "Time the source held its KV: SourceHeld until released or canceled.",
            DURATION_BUCKETS,
        ).labels()
        self.recovered_handoffs = self._gauge(
            "handoff_recovered_handoffs",
            "Handoffs this server recovered from its journal at start (0 without one).",
        )
        self.recovery_seconds = self._gauge(
            "handoff_recovery_seconds",
            "How long this server's start spent replaying its journal.",
        )
        self.shard_info = self._gauges(
            "handoff_shard_info",
            "1, labelled with the name of the shard this process is (docs/sharding.md).",
            "shard",
        )
        self.misrouted_starts = self._counter(
            "handoff_misrouted_starts",
            "StartHandoff calls refused because another shard owns the id (a client "
            "routing on another shard map).",
        )
        self.cancellations = self._counters(
            "handoff_cancellations",
            "Handoffs completed canceled, by why they went into cleanup (the reason "
            "GetHandoff shows): frontend_canceled, deadline, engine_lost, action_failed, "
            "failed, drain.",
            "reason",
        )
        self.calls_paced = self._counter(
            "handoff_calls_paced",
            "Calls that waited for their turn because their caller identity reached its rate "
            "of calls (--max-calls-per-s-per-identity), each at most --rate-wait-s.",
        )
        self.reports_paced = self._counter(
            "handoff_reports_paced",
            "Connect messages held back because their caller identity reached its rate of "
            "reports (--max-reports-per-s-per-identity): its streams are read more slowly.",
        )
        self.unknown_engine_starts = self._counter(
            "handoff_unknown_engine_starts",
            "StartHandoff calls naming an engine that has not subscribed to this server "
            "since it started (a typo, or engines that connect later); refused with "
            "--require-known-engines.",
        )
        # Label children resolved once, so a handoff's updates skip the lookup.
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

    def collect(self) -> Iterator[Metric]:
        for family in self._families:
            yield family.metric()

    def rejected(self, rpc: str, code: str) -> None:
        self.rejections.labels(rpc, code).inc()

    def _counters(self, name: str, documentation: str, *labelnames: str) -> Family[Counter]:
        return self._family(Family("counter", name, documentation, labelnames, Counter))

    def _counter(self, name: str, documentation: str) -> Counter:
        return self._counters(name, documentation).labels()

    def _gauges(self, name: str, documentation: str, *labelnames: str) -> Family[Gauge]:
        return self._family(Family("gauge", name, documentation, labelnames, Gauge))

    def _gauge(self, name: str, documentation: str) -> Gauge:
        return self._gauges(name, documentation).labels()

    def _histograms(
        self, name: str, documentation: str, buckets: tuple[float, ...], *labelnames: str
    ) -> Family[Histogram]:
        make = functools.partial(Histogram, buckets)
        return self._family(Family("histogram", name, documentation, labelnames, make))

    def _family(self, family: Family[S]) -> Family[S]:
        self._families.append(family)
        return family


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

    def labels(self, *values: str) -> _Discarded:
        return self


def discarding() -> Metrics:
    """Metrics whose every series discards what it is told: a journal's
    replay runs every call again, and its history is not news."""
    metrics = Metrics()
    discarded = _Discarded()
    for name, value in list(vars(metrics).items()):
        if isinstance(value, dict):
            setattr(metrics, name, dict.fromkeys(value, discarded))
        elif isinstance(value, (Counter, Gauge, Histogram, Family)):
            setattr(metrics, name, discarded)
    return metrics
