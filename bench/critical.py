"""The critical path, hop by hop: a fact's arrival to the action it causes.

Between a prefill finishing and its decode starting, the coordinator sits on
every hop (SourceHeld -> ReserveDestination or StartTransfer ->
TransferCompleted -> ActivateDestination, by order), so each hop's latency
adds to the user's time to first token. This measures each hop's p50 and p99
on both paths, at half and at 80 % of the maximum rate that configuration
sustains (measured first, in the same run), with the journal off and on.
Each paced window is followed by the gRPC floor (bench/floor.py: the same
messages, empty handlers) at the same rate: its latency is the harness's own
(the load process, gRPC, the two cores they share), and the difference is
what the coordinator adds. The server's own figure is read from its
``handoff_dispatch_latency_seconds`` (a call to its actions' first write,
the journal's commit included), from the buckets' counts before and after
the window, as Prometheus's histogram_quantile would.

Latencies are taken in the load process (bench/load.py, one clock): fact
sent to the action received by its engine, so the client's own queueing is
included and the figures bound the coordinator's share from above.

Run: .venv/bin/python -m bench.critical   (--quick: a smoke run of a few seconds)

With ``--against BEFORE`` (another checkout, as for bench/ab.py) it compares
that tree's server with this one's instead, both with the journal on (or
off, ``--journal off``), at the same paced rate on each path, rounds
alternating which goes first: each round's fact→action p50 and p99.
"""

from __future__ import annotations

import argparse
import multiprocessing
import statistics
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, replace
from multiprocessing.pool import Pool
from pathlib import Path

from bench.ab import baseline_server
from bench.load import LoadSpec
from bench.procs import ServerProcess
from bench.service import Measured, drive, label, load_average, ms, percentile, say
from handoff_client.sim.scrape import fetch, parse

FRACTIONS = (0.5, 0.8)
# The servers serve their metrics, on a free port, for their own figure.
METRICS = ("--metrics-port", "0", "--metrics-host", "127.0.0.1")
QUICK_COUNT = 64  # --quick: the max rate over this many handoffs, however slow the machine
# The path from a prefill's end to its decode's start, in both orders; the
# other hops are shown below them.
CRITICAL = (
    "SourceHeld → ReserveDestination",
    "DestinationReserved → StartTransfer",
    "SourceHeld → StartTransfer",
    "TransferCompleted → ActivateDestination",
)
# The actions of those hops, in the server's handoff_dispatch_latency_seconds
# (COMPLETE notices and cleanups are not on the way to a decode).
HOP_ACTIONS = ("submit_prefill", "reserve_destination", "start_transfer", "activate_destination")
Buckets = dict[float, float]  # a histogram's upper bound -> cumulative count


@dataclass(frozen=True)
class Paced:
    """One paced window of the service, the floor's at the same rate after
    it, and the server's own p50 / p99 over the window (None: not served)."""

    service: Measured
    floor: Measured
    inside: tuple[float, float] | None


@dataclass(frozen=True)
class Setup:
    path: str
    batch: bool
    journal: bool

    @property
    def name(self) -> str:
        path = "stream (batched)" if self.batch else self.path
        return f"{path}, journal {'on' if self.journal else 'off'}"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a smoke run of a few seconds")
    parser.add_argument("--duration-s", type=float, help="each measured window (default 10)")
    parser.add_argument("--concurrency", type=int, default=128, help="in flight at max rate")
    parser.add_argument(
        "--against", type=Path, help="another checkout: compare its server with this one's"
    )
    parser.add_argument("--rounds", type=int, default=6, help="--against: alternating rounds")
    parser.add_argument(
        "--journal", choices=("on", "off"), default="on", help="--against: both servers' journal"
    )
    parser.add_argument(
        "--rates",
        default="350,130",
        help="--against: the paced handoffs/s, batched stream then unary (about half the max)",
    )
    args = parser.parse_args(argv)
    if args.against is not None:
        return against(args)
    duration = args.duration_s or (0.6 if args.quick else 10.0)
    base = LoadSpec(
        target="",
        path="stream",
        pairs=2 if args.quick else 4,
        concurrency=args.concurrency,
        duration_s=duration,
        warmup_s=0.2 if args.quick else 2.0,
    )
    setups = [
        Setup(path, path == "stream", journal)
        for journal in (False, True)
        for path in ("stream", "unary")
    ]
    load_before = load_average()
    with tempfile.TemporaryDirectory(prefix="bench-critical-") as state:
        servers = {
            False: ServerProcess.service(*METRICS, name="journal off"),
            True: ServerProcess.service(*METRICS, "--state-dir", state, name="journal on"),
        }
        floor = ServerProcess.floor()
        try:
            with multiprocessing.get_context("spawn").Pool(1) as pool:
                # Unmeasured: the load process's imports and each server's
                # first streams would otherwise weigh on the first setup only.
                for server in (*servers.values(), floor):
                    drive(pool, 1, server, replace(base, duration_s=base.warmup_s), "warm-up")
                count = QUICK_COUNT if args.quick else None
                runs = [
                    run(pool, servers[setup.journal], floor, base, setup, count) for setup in setups
                ]
        finally:
            for server in (*servers.values(), floor):
                server.stop()
    print("## The critical path, hop by hop (bench/critical.py)")
    print()
    print(f"Load average {load_before} before, {load_average()} after; {duration} s windows.")
    print()
    print("\n".join(table([[window.service for window in paced] for paced in runs])))
    print()
    print("Every hop together, beside the floor at the same rate (its p50 / p99 are the")
    print("harness's own; the coordinator adds the difference), and the server's own")
    print("share of the same hops (handoff_dispatch_latency_seconds, bucketed):")
    print()
    print("\n".join(beside_floor(runs)))
    return 0


def against(args: argparse.Namespace) -> int:
    """This tree's server against another checkout's, journal on, paced alike."""
    stream_rate, unary_rate = (float(rate) for rate in args.rates.split(","))
    base = LoadSpec(
        target="",
        path="stream",
        concurrency=args.concurrency,
        duration_s=args.duration_s or (0.6 if args.quick else 10.0),
        warmup_s=0.2 if args.quick else 2.0,
    )
    specs = [
        replace(base, batch=True, rate=stream_rate),
        replace(base, path="unary", batch=False, rate=unary_rate),
    ]
    samples: dict[tuple[str, str], list[tuple[float, float]]] = {}
    # The servers' own, where they serve handoff_dispatch_latency_seconds.
    inside: dict[tuple[str, str], list[tuple[float, float] | None]] = {}
    load_before = load_average()
    with (
        tempfile.TemporaryDirectory(prefix="bench-critical-") as before_state,
        tempfile.TemporaryDirectory(prefix="bench-critical-") as after_state,
    ):
        journal = args.journal == "on"
        servers = {
            "before": baseline_server(
                args.against.resolve(),
                *METRICS,
                *(("--state-dir", before_state) if journal else ()),
            ),
            "after": ServerProcess.service(
                *METRICS, *(("--state-dir", after_state) if journal else ()), name="after"
            ),
        }
        try:
            with multiprocessing.get_context("spawn").Pool(1) as pool:
                for server in servers.values():
                    drive(pool, 1, server, replace(base, duration_s=base.warmup_s), "warm-up")
                for round_ in range(args.rounds):
                    order = ("before", "after") if round_ % 2 == 0 else ("after", "before")
                    for spec in specs:
                        for name in order:
                            before = dispatch_buckets(servers[name])
                            m = drive(pool, 1, servers[name], spec, f"{spec.rate:,.0f}/s")
                            share = server_share(before, dispatch_buckets(servers[name]))
                            inside.setdefault((label(spec), name), []).append(share)
                            latency = m.result.fact_to_action_s
                            p50, p99 = percentile(latency, 0.5), percentile(latency, 0.99)
                            samples.setdefault((label(spec), name), []).append((p50, p99))
                            say(f"round {round_} {label(spec)} {name}: p50 {ms(p50)} p99 {ms(p99)}")
        finally:
            for server in servers.values():
                server.stop()
    print(
        f"## Fact→action, journal {args.journal}: {args.against} (before) against this tree (after)"
    )
    print()
    print(f"Load average {load_before} before, {load_average()} after; {base.duration_s} s each.")
    print()
    print("In the load process (client), and in the server (handoff_dispatch_latency_seconds;")
    print("'-' where a server does not serve it):")
    print()
    print(
        "| path | rate | server | p50 ms per round | p99 ms per round | median p50 / p99 | "
        "in the server, p99 ms per round | in the server, median p50 / p99 |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for spec in specs:
        for name in ("before", "after"):
            runs = samples[(label(spec), name)]
            p50s = " / ".join(ms(p50) for p50, _ in runs)
            p99s = " / ".join(ms(p99) for _, p99 in runs)
            shares = [share for share in inside[(label(spec), name)] if share is not None]
            own = " / ".join(ms(p99) for _, p99 in shares) or "-"
            print(
                f"| {label(spec)} | {spec.rate:,.0f}/s | {name} | {p50s} | {p99s} | "
                f"{medians(runs)} | {own} | {medians(shares) if shares else '-'} |"
            )
    return 0


def medians(runs: Sequence[tuple[float, float]]) -> str:
    """The median p50 and the median p99 of the rounds."""
    return (
        f"{ms(statistics.median(p for p, _ in runs))} / {ms(statistics.median(p for _, p in runs))}"
    )


def run(
    pool: Pool,
    server: ServerProcess,
    floor: ServerProcess,
    base: LoadSpec,
    setup: Setup,
    count: int | None,
) -> list[Paced]:
    """The maximum rate of ``setup`` (over ``count`` handoffs when given, so a
    loaded machine still yields a rate), then each fraction of it, paced, each
    followed by the floor at the same pace."""
    spec = replace(base, path=setup.path, batch=setup.batch)
    say(f"max rate: {setup.name}")
    top = drive(pool, 1, server, replace(spec, count=count), "max")
    if top.rate <= 0:
        raise SystemExit(f"{setup.name}: no handoff completed in the window; pass --duration-s")
    measured = []
    for fraction in FRACTIONS:
        rate = top.rate * fraction
        say(f"{fraction:.0%} of max: {setup.name}, {rate:,.0f} handoffs/s")
        paced = replace(spec, rate=rate)
        mode = f"{fraction:.0%} of {top.rate:,.0f}/s"
        before = dispatch_buckets(server)
        service = drive(pool, 1, server, paced, mode)
        inside = server_share(before, dispatch_buckets(server))
        measured.append(Paced(service, drive(pool, 1, floor, paced, mode), inside))
    return measured


def dispatch_buckets(server: ServerProcess) -> Buckets:
    """The server's handoff_dispatch_latency_seconds buckets, HOP_ACTIONS summed."""
    if server.metrics_port is None:
        return {}
    scraped = parse(fetch(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout_s=10))
    buckets: Buckets = {}
    for (name, labels), value in scraped.samples.items():
        label = dict(labels)
        if name == "handoff_dispatch_latency_seconds_bucket" and label["kind"] in HOP_ACTIONS:
            bound = float(label["le"])
            buckets[bound] = buckets.get(bound, 0.0) + value
    return buckets


def server_share(before: Buckets, after: Buckets) -> tuple[float, float] | None:
    """p50 and p99 of what was observed between two scrapes."""
    window = {bound: after[bound] - before.get(bound, 0.0) for bound in sorted(after)}
    if not window or max(window.values()) <= 0:
        return None
    return quantile(window, 0.5), quantile(window, 0.99)


def quantile(cumulative: Buckets, q: float) -> float:
    """As Prometheus's histogram_quantile: linear within the bucket holding
    rank q; the highest finite bound if it falls beyond them all."""
    bounds = list(cumulative)
    rank = q * cumulative[bounds[-1]]
    lower, below = 0.0, 0.0
    for bound in bounds:
        count = cumulative[bound]
        if count >= rank:
            if bound == float("inf"):
                return lower
            return lower + (bound - lower) * (rank - below) / (count - below)
        lower, below = bound, count
    return lower


def beside_floor(runs: list[list[Paced]]) -> list[str]:
    lines = [
        "| path | journal | load | handoffs/s | service p50 / p99 ms | "
        "floor p50 / p99 ms | added p50 / p99 ms | in the server p50 / p99 ms |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for paced in runs:
        for window in paced:
            service = window.service
            ours, theirs = service.result.fact_to_action_s, window.floor.result.fact_to_action_s
            if not ours or not theirs:  # nothing finished a hop inside a window
                continue
            p50, p99 = percentile(ours, 0.5), percentile(ours, 0.99)
            f50, f99 = percentile(theirs, 0.5), percentile(theirs, 0.99)
            inside = "-" if window.inside is None else " / ".join(map(ms, window.inside))
            lines.append(
                f"| {service.path} | {service.server.removeprefix('journal ')} | {service.mode} | "
                f"{service.rate:,.0f} | {ms(p50)} / {ms(p99)} | {ms(f50)} / {ms(f99)} | "
                f"{ms(p50 - f50)} / {ms(p99 - f99)} | {inside} |"
            )
    return lines


def table(runs: list[list[Measured]]) -> list[str]:
    lines = [
        "| path | journal | load | handoffs/s | hop | samples | p50 ms | p99 ms |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for measured in runs:
        for m in measured:
            hops = m.result.hops
            head = f"| {m.path} | {m.server.removeprefix('journal ')} | {m.mode} | {m.rate:,.0f} |"
            ordered = [h for h in CRITICAL if h in hops] + sorted(set(hops) - set(CRITICAL))
            if not ordered:  # nothing finished a hop inside the window
                lines.append(f"{head} no samples | 0 | - | - |")
            for hop in ordered:
                samples = hops[hop]
                lines.append(
                    f"{head} {hop} | {len(samples):,} | {ms(percentile(samples, 0.5))} | "
                    f"{ms(percentile(samples, 0.99))} |"
                )
    return lines


if __name__ == "__main__":
    raise SystemExit(main())
