"""Benchmark the running service over real gRPC on loopback, against its floor.

In one run: completed handoffs/s on the streaming path (Connect, batched as
the SDK uses it, and one item per message as a plain client would) and the
unary path (ReportFact/ReportOutcome + StreamActions), each against the
service and against the empty-handler floor (bench/floor.py); handoff and fact-to-action
latency at half the maximum rate; server CPU per handoff; RSS per live and per
retained handoff; and a soak whose RSS must come back once retention expires.

``--shards N`` compares one shard with N (``handoff serve --shard-count N``,
one process per shard) instead, in interleaved rounds on the batched
streaming path: one load process per shard starts only the ids its shard
wins, and each shard's CPU is divided by the handoffs it served. The figure
that must hold: server CPU per handoff per shard within 10% of the single
shard's (sharding adds no hidden per-handoff cost).

Run: make bench   (or: .venv/bin/python -m bench.service --quick for a smoke run;
.venv/bin/python -m bench.service --shards 2 for the shard comparison)
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import platform
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from multiprocessing.pool import Pool

from bench import memory
from bench.load import LoadResult, LoadSpec, run_in_process
from bench.procs import ServerProcess

PHASES = ("throughput", "latency", "memory", "soak")
SHARD_PREFIX = "handoff"  # not the machine's hostname
CPU_PER_SHARD_TOLERANCE = 0.10


@dataclass(frozen=True)
class Plan:
    duration_s: float  # each measured window, but see stream_duration_s
    stream_duration_s: float  # the streaming path against the service: the sustained run
    warmup_s: float
    concurrency: int
    pairs: int
    live: int  # handoffs kept mid-flight for RSS per live handoff
    retained: int  # completed handoffs kept for RSS per retained handoff
    memory_warmup: int
    quiet_s: float  # idle time before reading RSS
    soak_s: float
    soak_warmup_s: float
    retention_s: float  # the soak server's retention: expiry must happen within the run
    shard_rounds: int  # --shards: interleaved rounds of 1 shard and N shards


# Retained handoffs each cost a full success path to make, so fewer are made
# than live ones (which cost one StartHandoff); the figure is per handoff.
FULL = Plan(20.0, 60.0, 3.0, 128, 4, 100_000, 30_000, 2_000, 2.0, 600.0, 20.0, 30.0, 5)
QUICK = Plan(0.8, 0.8, 0.2, 32, 2, 300, 300, 50, 0.2, 1.5, 0.5, 0.3, 1)


@dataclass
class Measured:
    path: str
    server: str
    mode: str
    result: LoadResult
    server_cpu_s: float
    wall_s: float

    @property
    def rate(self) -> float:
        return self.result.completed / self.result.window_s if self.result.window_s else 0.0

    @property
    def cpu_per_handoff_us(self) -> float:
        done = self.result.total_completed
        return self.server_cpu_s / done * 1e6 if done else float("nan")

    @property
    def messages(self) -> str:
        """gRPC messages per handoff, to the server / from it, as the load counted them."""
        done = self.result.total_completed
        if not done:
            return "-"
        return f"{self.result.sent / done:.1f} / {self.result.received / done:.1f}"

    @property
    def utilisation(self) -> float:
        return self.server_cpu_s / self.wall_s if self.wall_s else 0.0


def percentile(samples: Sequence[float], q: float) -> float:
    if not samples:
        return float("nan")
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def merge(results: Sequence[LoadResult]) -> LoadResult:
    merged = LoadResult(window_s=max(r.window_s for r in results))
    for r in results:
        merged.started += r.started
        merged.completed += r.completed
        merged.total_completed += r.total_completed
        merged.rejected += r.rejected
        merged.unfinished += r.unfinished
        merged.skipped += r.skipped
        merged.client_cpu_s += r.client_cpu_s
        merged.sent += r.sent
        merged.received += r.received
        merged.handoff_s += r.handoff_s
        merged.fact_to_action_s += r.fact_to_action_s
        for hop, samples in r.hops.items():
            merged.hops.setdefault(hop, []).extend(samples)
    return merged


def label(spec: LoadSpec) -> str:
    if spec.path != "stream":
        return spec.path
    return "stream (batched)" if spec.batch else "stream (one per message)"


def drive(pool: Pool, clients: int, server: ServerProcess, spec: LoadSpec, mode: str) -> Measured:
    """Run ``spec`` split over ``clients`` load processes; the server's CPU over the run."""
    shards = [
        replace(
            spec,
            target=server.target,
            shard=index,
            concurrency=max(1, spec.concurrency // clients),
            rate=spec.rate / clients if spec.rate else None,
        )
        for index in range(clients)
    ]
    cpu, began = server.cpu_s(), time.monotonic()
    result = merge(pool.map(run_in_process, shards))
    return Measured(
        label(spec), server.name, mode, result, server.cpu_s() - cpu, time.monotonic() - began
    )


def ms(seconds: float) -> str:
    return f"{seconds * 1e3:.2f}"


def mib(size: float) -> str:
    return f"{size / 2**20:.1f} MiB"


def row(m: Measured) -> str:
    r = m.result
    return (
        f"| {m.path} | {m.server} | {m.mode} | {m.rate:,.0f} | {m.cpu_per_handoff_us:,.0f} | "
        f"{m.utilisation:.0%} | {ms(percentile(r.handoff_s, 0.5))} | "
        f"{ms(percentile(r.handoff_s, 0.99))} | {ms(percentile(r.fact_to_action_s, 0.99))} | "
        f"{m.messages} | {r.rejected + r.unfinished} |"
    )


def load_average() -> str:
    one, five, fifteen = os.getloadavg()
    return f"{one:.2f} {five:.2f} {fifteen:.2f}"


def say(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def parse(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a tiny smoke run (< 20 s)")
    parser.add_argument(
        "--only",
        help=f"phases, comma-separated (default: all of {','.join(PHASES)}, or none with --shards)",
    )
    parser.add_argument(
        "--shards", type=int, default=0, help="compare 1 shard with this many (2 or more)"
    )
    parser.add_argument(
        "--rounds",
        type=int,
        help="interleaved rounds: of the service and the floor (throughput, default 1), "
        "or of 1 shard and N (--shards)",
    )
    parser.add_argument(
        "--shard-rate",
        type=float,
        default=100.0,
        help="--shards: the paced load per shard, handoffs/s (both deployments get it)",
    )
    parser.add_argument("--clients", type=int, default=1, help="load processes (shards)")
    parser.add_argument("--duration-s", type=float, help="each measured window")
    parser.add_argument("--stream-duration-s", type=float, help="streaming service window")
    parser.add_argument("--concurrency", type=int, help="handoffs in flight at max rate")
    parser.add_argument("--pairs", type=int, help="source/destination engine pairs")
    parser.add_argument("--live", type=int, help="handoffs kept live for memory")
    parser.add_argument("--retained", type=int, help="handoffs kept retained for memory")
    parser.add_argument("--soak-s", type=float, help="soak duration (default 600)")
    parser.add_argument("--retention-s", type=float, help="the soak server's retention")
    parser.add_argument(
        "--event-loop", default="asyncio", choices=("asyncio", "uvloop"), help="servers' loop"
    )
    parser.add_argument("--stream-rate", type=float, help="max streaming rate, if not measured")
    parser.add_argument("--unary-rate", type=float, help="max unary rate, if not measured")
    return parser.parse_args(argv)


def plan_of(args: argparse.Namespace) -> Plan:
    plan = QUICK if args.quick else FULL
    overrides = {
        "duration_s": args.duration_s,
        "stream_duration_s": args.stream_duration_s,
        "concurrency": args.concurrency,
        "pairs": args.pairs,
        "live": args.live,
        "retained": args.retained,
        "soak_s": args.soak_s,
        "retention_s": args.retention_s,
        "shard_rounds": args.rounds,
    }
    return replace(plan, **{k: v for k, v in overrides.items() if v is not None})


def main(argv: Sequence[str] | None = None) -> int:
    args = parse(argv)
    plan = plan_of(args)
    default = "" if args.shards else ",".join(PHASES)
    phases = set(filter(None, (args.only if args.only is not None else default).split(",")))
    if unknown := phases - set(PHASES):
        print(f"unknown phases: {', '.join(sorted(unknown))}", file=sys.stderr)
        return 2
    if args.shards == 1 or args.shards < 0:
        print("--shards compares one shard with N: give 2 or more", file=sys.stderr)
        return 2
    load_before = load_average()
    began = time.monotonic()
    # Every server starts at once (they idle until their phase), so the
    # start-up costs are paid in parallel.
    servers: dict[str, ServerProcess] = {}
    loop = ("--event-loop", args.event_loop)
    if phases & {"throughput", "latency"}:
        servers["service"] = ServerProcess.service(*loop)
    if "throughput" in phases:
        servers["floor"] = ServerProcess.floor(*loop)
    if "memory" in phases:
        servers["live"] = memory.memory_server(86400, "live", *loop)
        servers["retained"] = memory.memory_server(86400, "retained", *loop)
    if "soak" in phases:
        servers["soak"] = memory.memory_server(plan.retention_s, "soak", *loop)
    lines: list[str] = []
    try:
        processes = max(args.clients, args.shards)
        with multiprocessing.get_context("spawn").Pool(processes) as pool:
            lines = run_phases(pool, args, plan, phases, servers)
            if args.shards:
                lines += compare_shards(pool, plan, args.shards, args.shard_rate, loop)
    finally:
        for server in servers.values():
            server.stop()
    print(f"## Service benchmark ({'quick' if args.quick else 'full'} run)")
    print()
    print(
        f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
        f"Python {platform.python_version()}; load average {load_before} before, "
        f"{load_average()} after; {time.monotonic() - began:.0f} s; "
        f"{args.clients} load process(es)"
        + (f" (shards: one per shard, {plan.concurrency} in flight each)" if args.shards else "")
        + f", {plan.pairs} engine pairs each; servers on the {args.event_loop} event loop."
    )
    print()
    print("\n".join(lines))
    return 0


def run_phases(
    pool: Pool,
    args: argparse.Namespace,
    plan: Plan,
    phases: set[str],
    servers: dict[str, ServerProcess],
) -> list[str]:
    lines: list[str] = []
    max_rate = {"stream": args.stream_rate or 0.0, "unary": args.unary_rate or 0.0}
    measured: list[Measured] = []
    base = LoadSpec(
        target="",
        path="stream",
        pairs=plan.pairs,
        concurrency=plan.concurrency,
        duration_s=plan.duration_s,
        warmup_s=plan.warmup_s,
    )
    rounds: list[list[Measured]] = []
    if "throughput" in phases:
        for round_ in range(args.rounds or 1):
            rounds.append([])
            for path, batch in (("stream", True), ("stream", False), ("unary", False)):
                # Alternate which goes first, so a noisy machine weighs on both alike.
                for name in ("service", "floor")[:: 1 if round_ % 2 == 0 else -1]:
                    sustained = (path, batch, name) == ("stream", True, "service")
                    window = plan.stream_duration_s if sustained else plan.duration_s
                    spec = replace(base, path=path, batch=batch, duration_s=window)
                    say(f"round {round_} max rate: {label(spec)} path, {name}, {window} s")
                    mode = f"max ({plan.concurrency} in flight)"
                    rounds[-1].append(drive(pool, args.clients, servers[name], spec, mode))
        medians = {
            key: median_round(rounds, key)
            for key in dict.fromkeys((m.path, m.server) for m in rounds[0])
        }
        measured += medians.values()
        # Each path's max rate as the SDK uses it: batched on the stream.
        for path, batch in (("stream", True), ("unary", False)):
            max_rate[path] = medians[label(replace(base, path=path, batch=batch)), "service"].rate
    if "latency" in phases:
        for path in ("stream", "unary"):
            rate = max_rate[path] / 2
            if rate <= 0:
                raise SystemExit(f"latency needs the {path} max rate: run throughput or pass it")
            spec = replace(base, path=path, rate=rate)
            say(f"half rate: {label(spec)} path, {rate:,.0f} handoffs/s")
            measured.append(
                drive(pool, args.clients, servers["service"], spec, f"half rate ({rate:,.0f}/s)")
            )
    if measured:
        lines += throughput_table(measured)
    if len(rounds) > 1:
        lines += rounds_table(rounds)
    if "memory" in phases:
        started = replace(base, concurrency=max(plan.concurrency, 256), frontend_only=True)
        say(f"memory: {plan.live:,} live handoffs")
        live = memory.per_handoff(
            pool, servers["live"], started, plan.live, plan.memory_warmup, plan.quiet_s
        )
        say(f"memory: {plan.retained:,} retained handoffs")
        retained = memory.per_handoff(
            pool,
            servers["retained"],
            replace(base, concurrency=max(plan.concurrency, 256)),
            plan.retained,
            plan.memory_warmup,
            plan.quiet_s,
        )
        lines += memory_table(live, retained)
    if "soak" in phases:
        rate = max_rate["stream"] / 2
        if rate <= 0:
            raise SystemExit("the soak needs the stream max rate: run throughput or pass it")
        say(f"soak: {rate:,.0f} handoffs/s for {plan.soak_s} s, retention {plan.retention_s} s")
        spec = replace(base, rate=rate, duration_s=plan.soak_s, warmup_s=0.0)
        outcome = memory.soak(
            pool,
            servers["soak"],
            spec,
            plan.soak_warmup_s,
            max(0.2, plan.soak_s / 60),
            plan.quiet_s,
            say,
        )
        lines += soak_table(outcome)
    return lines


@dataclass
class ShardRun:
    """One shard's share of one window: its handoffs and its server's CPU."""

    shards: int  # in the deployment
    name: str
    result: LoadResult
    server_cpu_s: float
    wall_s: float

    @property
    def cpu_per_handoff_us(self) -> float:
        done = self.result.total_completed
        return self.server_cpu_s / done * 1e6 if done else float("nan")


def shard_servers(count: int, loop: Sequence[str]) -> list[ServerProcess]:
    """``count`` shard processes (one: an unsharded coordinator, the default)."""
    if count == 1:
        return [ServerProcess.service(*loop, name="shard x1")]
    return [
        ServerProcess.service(
            *loop,
            *("--shard-count", str(count), "--shard-ordinal", str(ordinal)),
            *("--shard-name-prefix", SHARD_PREFIX),
            name=f"{SHARD_PREFIX}-{ordinal}",
        )
        for ordinal in range(count)
    ]


def drive_shards(pool: Pool, servers: Sequence[ServerProcess], spec: LoadSpec) -> list[ShardRun]:
    """One load process per shard, all at once, each starting only the ids its shard wins."""
    names = tuple(f"{SHARD_PREFIX}-{k}" for k in range(len(servers))) if len(servers) > 1 else ()
    specs = [
        replace(
            spec,
            target=server.target,
            shard=index,
            shard_names=names,
            shard_name=names[index] if names else "",
        )
        for index, server in enumerate(servers)
    ]
    cpu, began = [server.cpu_s() for server in servers], time.monotonic()
    results = pool.map(run_in_process, specs)
    wall = time.monotonic() - began
    return [
        ShardRun(len(servers), server.name, result, server.cpu_s() - before, wall)
        for server, result, before in zip(servers, results, cpu, strict=True)
    ]


def compare_shards(
    pool: Pool, plan: Plan, count: int, shard_rate: float, loop: Sequence[str]
) -> list[str]:
    """1 shard against ``count``, in interleaved rounds on the batched stream path.

    Each round runs both deployments (the order alternates) twice: at the
    maximum rate (each shard's load process keeps ``concurrency`` in
    flight), for the throughput as measured; and paced at ``shard_rate``
    handoffs/s per shard, for CPU per handoff at the same load per shard.
    The paced figure is the one compared: a server's CPU per handoff falls
    as its load rises (more reports share a message), and on two shared
    cores N shards at their maximum each get a fraction of the single
    shard's load, so the maximum-rate windows would measure batching and
    the machine, not sharding.
    """
    single, sharded = shard_servers(1, loop), shard_servers(count, loop)
    base = LoadSpec(
        target="",
        path="stream",
        pairs=plan.pairs,
        concurrency=plan.concurrency,
        duration_s=plan.duration_s,
        warmup_s=plan.warmup_s,
    )
    windows: list[tuple[int, str, list[ShardRun]]] = []
    try:
        for round_ in range(1, plan.shard_rounds + 1):
            order = (single, sharded) if round_ % 2 else (sharded, single)
            for mode, spec in (
                ("max", base),
                (f"{shard_rate:g}/s", replace(base, rate=shard_rate)),
            ):
                for servers in order:
                    say(f"shards: round {round_}, {len(servers)} shard(s), {mode}")
                    windows.append((round_, mode, drive_shards(pool, servers, spec)))
    finally:
        for server in (*single, *sharded):
            server.stop()
    return shard_table(windows, count, shard_rate)


def shard_table(
    windows: list[tuple[int, str, list[ShardRun]]], count: int, shard_rate: float
) -> list[str]:
    lines = [
        "",
        "| round | load per shard | shards | shard | handoffs/s | server CPU µs/handoff | "
        "server CPU use | errors |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for round_, mode, runs in windows:
        for run in runs:
            r = run.result
            achieved = r.completed / r.window_s if r.window_s else 0.0
            lines.append(
                f"| {round_} | {mode} | {run.shards} | {run.name} | {achieved:,.0f} | "
                f"{run.cpu_per_handoff_us:,.0f} | {run.server_cpu_s / run.wall_s:.0%} | "
                f"{r.rejected + r.unfinished} |"
            )

    def chosen(shards: int, mode: str) -> list[ShardRun]:
        return [run for _, m, runs in windows if m == mode for run in runs if run.shards == shards]

    def per_handoff_us(runs: list[ShardRun]) -> float:
        done = sum(run.result.total_completed for run in runs)
        return sum(run.server_cpu_s for run in runs) / done * 1e6 if done else float("nan")

    rounds = max((round_ for round_, _, _ in windows), default=1)

    def aggregate(runs: list[ShardRun]) -> float:
        """Handoffs/s of every shard together, averaged over the rounds."""
        return (
            sum(r.result.completed / r.result.window_s for r in runs if r.result.window_s) / rounds
        )

    paced = f"{shard_rate:g}/s"
    one_us, many_us = per_handoff_us(chosen(1, paced)), per_handoff_us(chosen(count, paced))

    # Each round's two deployments ran back to back: their ratio is paired,
    # and the median over rounds shrugs off a round another process disturbed.
    def paced_in(round_: int, shards: int) -> list[ShardRun]:
        return [
            run
            for r, mode, runs in windows
            if (r, mode) == (round_, paced)
            for run in runs
            if run.shards == shards
        ]

    ratios = sorted(
        per_handoff_us(paced_in(r, count)) / per_handoff_us(paced_in(r, 1))
        for r in range(1, rounds + 1)
    )
    ratio = statistics.median(ratios) if ratios else float("nan")
    holds = abs(ratio - 1) <= CPU_PER_SHARD_TOLERANCE
    max_one, max_many = per_handoff_us(chosen(1, "max")), per_handoff_us(chosen(count, "max"))
    errors = sum(r.result.rejected + r.result.unfinished for _, _, runs in windows for r in runs)
    per_core = 1e6 / max_one if max_one else 0.0
    return [
        *lines,
        "",
        f"- server CPU per handoff at {paced} per shard: 1 shard {one_us:,.0f} µs, {count} "
        f"shards {many_us:,.0f} µs per shard (all rounds pooled: {many_us / one_us:.2f}x); "
        f"{count} shards against 1, round by round: "
        + ", ".join(f"{r:.2f}x" for r in ratios)
        + f"; median {ratio:.2f}x: {'HOLDS' if holds else 'FAILS'} "
        f"(within {CPU_PER_SHARD_TOLERANCE:.0%}); errors {errors}",
        f"- at the maximum rate: 1 shard {max_one:,.0f} µs, {count} shards {max_many:,.0f} µs "
        "per handoff per shard (each of N shards gets 1/N of the cores the single one had)",
        f"- aggregate throughput as measured at the maximum rate: 1 shard "
        f"{aggregate(chosen(1, 'max')):,.0f} handoffs/s, {count} shards "
        f"{aggregate(chosen(count, 'max')):,.0f} handoffs/s (mean per round; the load "
        "processes share the machine's cores with the servers)",
        f"- capacity model: {per_core:,.0f} handoffs/s per core (the single shard's CPU per "
        f"handoff at its maximum) x shards: {per_core * count:,.0f} handoffs/s for {count} "
        "shards, each with a core of its own and the load elsewhere",
    ]


def throughput_table(measured: list[Measured]) -> list[str]:
    lines = [
        "| path | server | load | handoffs/s | server CPU µs/handoff | server CPU use | "
        "handoff p50 ms | handoff p99 ms | fact→action p99 ms | messages/handoff (in / out) "
        "| errors |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    lines += [row(m) for m in measured]
    floors = {m.path: m for m in measured if m.server == "floor"}
    ratios = []
    for m in measured:
        floor = floors.get(m.path)
        if m.server == "service" and m.mode.startswith("max") and floor and floor.rate:
            ratios.append(
                f"- {m.path} path: service/floor throughput {m.rate / floor.rate:.2f}, "
                f"server CPU per handoff {m.cpu_per_handoff_us / floor.cpu_per_handoff_us:.2f}x"
            )
    lines += ["", *ratios]
    lines += [
        "",
        "Latencies are client-side (one clock in the load process): handoff = StartHandoff "
        "sent to the last Complete received; fact→action = fact sent to the action it caused "
        "received by its engine. Server CPU = utime+stime of the server process (all threads) "
        "over the run, warm-up and drain included, divided by the handoffs completed in it. "
        "Messages: the gRPC messages the load wrote (in) and read (out), stream messages and "
        "unary calls alike, over the same handoffs.",
    ]
    return lines


def median_round(rounds: Sequence[Sequence[Measured]], key: tuple[str, str]) -> Measured:
    """Of ``key``'s windows over the rounds, the one of median server CPU per handoff."""
    windows = sorted(
        (m for r in rounds for m in r if (m.path, m.server) == key),
        key=lambda m: m.cpu_per_handoff_us,
    )
    return windows[(len(windows) - 1) // 2]


def rounds_table(rounds: Sequence[Sequence[Measured]]) -> list[str]:
    """Per path, each round's service/floor ratios, and their medians: the figures
    to compare (a ratio taken within one round shares that round's load)."""
    lines = [
        "",
        f"Interleaved rounds ({len(rounds)}; the table above shows each row's window of "
        "median server CPU per handoff):",
        "",
        "| path | service/floor throughput, per round | median | service/floor server CPU "
        "per handoff, per round | median |",
        "|---|---|---|---|---|",
    ]
    for path in dict.fromkeys(m.path for m in rounds[0]):
        pace, cpu = [], []
        for r in rounds:
            found = {m.server: m for m in r if m.path == path}
            service, floor = found["service"], found["floor"]
            if floor.rate and floor.cpu_per_handoff_us:
                pace.append(service.rate / floor.rate)
                cpu.append(service.cpu_per_handoff_us / floor.cpu_per_handoff_us)
        lines.append(
            f"| {path} | {' / '.join(f'{x:.2f}' for x in pace)} | "
            f"{statistics.median(pace):.2f} | {' / '.join(f'{x:.2f}' for x in cpu)} | "
            f"{statistics.median(cpu):.2f}x |"
        )
    return lines


def memory_table(live: memory.PerHandoff, retained: memory.PerHandoff) -> list[str]:
    return [
        "",
        "| memory | handoffs | RSS before | RSS after | per handoff |",
        "|---|---|---|---|---|",
        f"| live (started, first action queued) | {live.count:,} | {mib(live.baseline_rss)} | "
        f"{mib(live.rss)} | {live.bytes_each:,.0f} bytes |",
        f"| retained (completed) | {retained.count:,} | {mib(retained.baseline_rss)} | "
        f"{mib(retained.rss)} | {retained.bytes_each:,.0f} bytes |",
    ]


def soak_table(s: memory.Soak) -> list[str]:
    r = s.result
    achieved = r.completed / r.window_s if r.window_s else 0.0
    return [
        "",
        f"Soak: {s.rate:,.0f} handoffs/s asked, {achieved:,.0f}/s completed "
        f"({r.skipped:,} starts skipped while a second's worth was in flight), for "
        f"{s.duration_s:.0f} s on the streaming path; retention {s.retention_s:g} s. "
        f"RSS fresh {mib(s.fresh_rss)}, baseline {mib(s.baseline_rss)} (after a warm-up at "
        f"the same rate, its retention expired), peak {mib(s.peak_rss)}, final "
        f"{mib(s.final_rss)} after retention expired "
        f"({(s.final_rss / s.baseline_rss - 1) if s.baseline_rss else 0:+.1%}); "
        f"fact→action p99 {ms(percentile(r.fact_to_action_s, 0.99))} ms; "
        f"errors {r.rejected + r.unfinished}: {'HOLDS' if s.holds else 'FAILS'} "
        "(final within 10% of baseline, no errors).",
    ]


if __name__ == "__main__":
    sys.exit(main())
