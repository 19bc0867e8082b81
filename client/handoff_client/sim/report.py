"""The end-of-run summary: what the simulation saw, and what the server counted."""

from __future__ import annotations

import math
from collections.abc import Sequence

from handoff_client.model import Completion
from handoff_client.sim.faults import CoordinatorCrash
from handoff_client.sim.run import SimResult
from handoff_client.sim.scrape import ServerMetrics

KEY_WIDTH = 20
SHOWN_PROBLEMS = 5
LOST_CAUSES = ("restarted", "unreachable")  # handoff_engines_lost_total{cause}


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile of ``values`` (not empty), ``q`` in (0, 100]."""
    ordered = sorted(values)
    return ordered[max(math.ceil(q / 100.0 * len(ordered)) - 1, 0)]


def duration(seconds: float) -> str:
    return f"{seconds * 1000:.0f} ms" if seconds < 1 else f"{seconds:.2f} s"


def render(result: SimResult, metrics: ServerMetrics | Sequence[ServerMetrics] | str) -> str:
    """The summary table; ``metrics`` is the server's scrape (one per shard), or why it failed."""
    if isinstance(metrics, ServerMetrics):
        metrics = (metrics,)
    rows: list[tuple[str, str]] = []
    c = result.counters
    journeys = result.journeys
    canceled = [j for j in journeys if j.final and j.final.completion is Completion.CANCELED]
    in_decode = sum(1 for j in canceled if j.canceled_in_decode)
    by_client = sum(1 for j in canceled if j.canceled_in_flight and not j.canceled_in_decode)
    leaks = result.leaks
    rows += [
        (
            "handoffs",
            f"{c.started} started in {result.load_s:.1f} s "
            f"({c.started / max(result.load_s, 1e-9):.1f}/s), {result.total_s:.1f} s with settling",
        ),
        ("success", f"{c.success} (as the frontend last saw each handoff)"),
        (
            "canceled",
            f"{c.canceled} (by the client {by_client}, during decode {in_decode}, "
            f"after a fault {len(canceled) - by_client - in_decode})",
        ),
        (
            "abandoned",
            f"{leaks.abandoned_with_dead_engine + leaks.abandoned_with_stuck_handler} "
            f"(cleanup owed by a dead engine {leaks.abandoned_with_dead_engine}, "
            f"waiting for a stuck handler {leaks.abandoned_with_stuck_handler}; "
            "cleanup given up, not KV leaked: the verdict checks every live pool)",
        ),
        ("refused", f"{c.refused} (StartHandoff refused)"),
        ("stuck", str(len(leaks.stuck) + len(leaks.lost))),
        ("leaked", f"{leaks.leaked_blocks} blocks ({leaks.pools_checked} live engines checked)"),
    ]
    latencies = [
        j.latency_s for j in journeys if j.final and j.final.completion is Completion.SUCCESS
    ]
    success_latencies = [s for s in latencies if s is not None]
    if success_latencies:
        rows.append(
            (
                "latency p50/p95/p99",
                " / ".join(duration(percentile(success_latencies, q)) for q in (50, 95, 99))
                + " (start to success)",
            )
        )
    rows.append(("throughput", f"{c.finished / max(result.total_s, 1e-9):.1f} handoffs/s finished"))
    s = result.sidecars
    rows += [
        (
            "faults",
            f"{result.injected_failures} failed actions, {result.stream_drops} connection "
            f"drops, killed: {', '.join(result.killed) or 'none'}, "
            f"slow: {', '.join(result.slow) or 'none'}, "
            f"restarted: {', '.join(result.restarted) or 'none'}, "
            f"stuck handlers: {result.stuck_handlers}"
            + (f" on {result.stuck_engine}" if result.stuck_handlers else ""),
        ),
    ]
    if result.handoffs_by_shard:
        rows.append(("shards", _shards(result)))
    if result.coordinator_crashes:
        rows.append(("coordinator", _crashes(result.coordinator_crashes)))
    rows += [
        (
            "sidecars",
            f"{s.handlers_run} handlers run, {s.answered_from_cache} redeliveries answered "
            f"from cache, {s.ignored_while_running} while running, {s.reconnects} reconnects, "
            f"{s.report_retries} report retries",
        ),
        (
            "sidecar cleanup",
            f"{s.answered_closed} actions for a canceled side answered unrun, "
            f"{s.freed_on_complete} freed on a COMPLETE notice, "
            f"{s.unknown_actions} unknown actions skipped",
        ),
    ]
    lines = ["", "summary"] + [f"{key:>{KEY_WIDTH}}: {value}" for key, value in rows]
    lines += ["", _server_heading(metrics, result.coordinator_crashes), *_server_rows(metrics)]
    lines += ["", _verdict(result)]
    return "\n".join(lines)


def _shards(result: SimResult) -> str:
    """Handoffs per shard (the shard that answered each start), and which were killed."""
    killed = {crash.shard for crash in result.coordinator_crashes}
    return (
        ", ".join(
            f"{name} {count}" + (" (killed and restarted)" if name in killed else "")
            for name, count in result.handoffs_by_shard
        )
        + " handoffs started"
    )


def _crashes(crashes: Sequence[CoordinatorCrash]) -> str:
    def each(values: list[str]) -> str:
        return " / ".join(values)

    killed = ", ".join(str(c.killed_pid) for c in crashes)
    shards = sorted({c.shard for c in crashes if c.shard})
    return (
        (f"shard {', '.join(shards)} " if shards else "")
        + f"killed {len(crashes)}x with {each([str(c.in_flight) for c in crashes])} handoffs "
        "in flight, restarted in "
        f"{each([duration(c.restarted_in_s) for c in crashes])}, recovered "
        f"{each([str(c.recovered) for c in crashes])} handoffs in "
        f"{each([duration(c.recovery_s) for c in crashes])} (kill -9 of pid"
        f"{'s' if len(crashes) > 1 else ''} {killed}; now pid {crashes[-1].pid})"
    )


def _server_heading(
    metrics: Sequence[ServerMetrics] | str, crashes: Sequence[CoordinatorCrash]
) -> str:
    if isinstance(metrics, str):
        return "server /metrics"
    processes = sum(shard.processes for shard in metrics)
    shards = f"{len(metrics)} shards, " if len(metrics) > 1 else ""
    if processes == len(metrics):
        return f"server /metrics ({shards}counters summed)" if shards else "server /metrics"
    gap = max((c.scraped_before_s for c in crashes), default=0.0)
    gauges = "the running ones'" if shards else "the running one's"
    return (
        f"server /metrics ({shards}counters summed over {processes} coordinator processes; "
        f"a killed one's were scraped at most {duration(gap)} before its SIGKILL, and what it "
        f"counted in between is in neither; gauges are {gauges})"
    )


def _by_label(shards: Sequence[ServerMetrics], name: str, label: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for shard in shards:
        for key, value in shard.by_label(name, label).items():
            out[key] = out.get(key, 0.0) + value
    return out


def _total(shards: Sequence[ServerMetrics], name: str) -> float:
    return sum(shard.total(name) for shard in shards)


def _server_rows(metrics: Sequence[ServerMetrics] | str) -> list[str]:
    if isinstance(metrics, str):
        return [f"{'unavailable':>{KEY_WIDTH}}: {metrics}"]
    completed = _by_label(metrics, "handoff_completed_total", "result")
    phases = _by_label(metrics, "handoff_handoffs", "phase")
    rejections = _by_label(metrics, "handoff_rejections_total", "code")
    lines = [_started(metrics)]
    rows = [
        ("completed success", completed.get("success", 0.0)),
        ("completed canceled", completed.get("canceled", 0.0)),
        ("reopened", _total(metrics, "handoff_reopened_total")),
        ("timed out", _total(metrics, "handoff_timed_out_total")),
        ("abandoned", _total(metrics, "handoff_abandoned_total")),
        ("redeliveries", _total(metrics, "handoff_redeliveries_total")),
        ("active now", phases.get("active", 0.0)),
        ("cleaning up now", phases.get("cleaning_up", 0.0)),
        (
            "facts from server",
            _by_label(metrics, "handoff_facts_total", "origin").get("server", 0.0),
        ),
    ]
    if len(metrics) > 1:
        rows.append(("misrouted starts", _total(metrics, "handoff_misrouted_starts_total")))
    lines += [
        f"{key:>{KEY_WIDTH}}: {value:.0f}" + (f" ({SAYS[key]})" if key in SAYS else "")
        for key, value in rows
    ]
    lost = _by_label(metrics, "handoff_engines_lost_total", "cause")
    lines.append(
        f"{'engines lost':>{KEY_WIDTH}}: "
        + ", ".join(f"{cause} {lost.get(cause, 0.0):.0f}" for cause in LOST_CAUSES)
        + " (EngineLost reported by the server, by cause)"
    )
    shown = ", ".join(f"{code} {n:.0f}" for code, n in sorted(rejections.items()) if n)
    lines.append(f"{'rejections':>{KEY_WIDTH}}: {shown or '0'}")
    return lines


# What a server figure counts, where a reader compares it with the summary's.
SAYS = {
    "completed success": "every success the server completed, those later reopened too: "
    "the summary's success plus reopened",
    "abandoned": "the summary's abandoned, counted by the server",
}


def _started(shards: Sequence[ServerMetrics]) -> str:
    """Handoffs the server started; after a restart, exactly, from the running process's figures.

    A sum of counters would miss what the killed process started between its
    last scrape and the kill; the journal misses nothing it committed.
    """
    key = f"{'started':>{KEY_WIDTH}}"
    if len(shards) > 1:
        each = [_started_by(shard) for shard in shards]
        return (
            f"{key}: {sum(n for n, _ in each):.0f} (by shard: "
            + ", ".join(
                f"{_shard_name(shard)} {n:.0f}{how}"
                for shard, (n, how) in zip(shards, each, strict=True)
            )
            + ")"
        )
    started, how = _started_by(shards[0])
    return f"{key}: {started:.0f}{how}"


def _started_by(metrics: ServerMetrics) -> tuple[float, str]:
    if metrics.processes == 1:
        return metrics.total("handoff_started_total"), ""
    recovered = metrics.latest("handoff_recovered_handoffs")
    since = metrics.latest("handoff_started_total")
    return recovered + since, (
        f" ({recovered:.0f} recovered from the journal at the last restart, "
        f"{since:.0f} started since)"
    )


def _shard_name(metrics: ServerMetrics) -> str:
    """The shard's name from ``handoff_shard_info{shard}``."""
    return next(iter(metrics.latest_by_label("handoff_shard_info", "shard")), "?")


def _verdict(result: SimResult) -> str:
    leaks = result.leaks
    if result.counters.started == 0:
        return "FAIL: no handoff was started"
    if leaks.ok:
        return "PASS: every handoff finished and every live KV pool is full again"
    problems = [
        f"{leak.engine_id} holds {leak.blocks} blocks for {', '.join(leak.holders[:3])}"
        for leak in leaks.leaks
    ]
    problems += [
        f"handoff {j.handoff_id} unfinished: "
        f"{j.final.phase.name if j.final else 'unknown to the server'}"
        for j in leaks.stuck
    ]
    problems += [f"handoff {j.handoff_id} abandoned with both engines alive" for j in leaks.lost]
    shown = "\n  ".join(problems[:SHOWN_PROBLEMS])
    more = len(problems) - SHOWN_PROBLEMS
    return f"FAIL:\n  {shown}" + (f"\n  ... and {more} more" if more > 0 else "")
