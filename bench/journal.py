"""What the journal costs, and how long a large one takes to recover.

In one run:

- **Overhead.** Servers with the journal off, on (``synchronous=NORMAL``) and
  on with ``--durability full``, each driven at its maximum rate on the
  streaming path (batched, as the SDK uses it) and on the unary path; the
  rounds alternate between the servers so that the shared machine's load
  falls on all alike (or, with ``--rate``, each at that pace: for the
  latency a commit delay adds below the maximum). Reported: completed handoffs/s and server CPU per
  handoff (all threads, the journal's writer included), and the journal's
  bytes per handoff it holds.
- **Soak.** The journaling server under a steady open-loop load for
  ``--soak-s`` with a short retention: its RSS and the journal's files (the
  database and its WAL) must stop growing once retention expires handoffs
  as fast as they come.
- **Recovery.** A journal holding ``--live`` handoffs mid-flight and
  ``--retained`` completed ones, written by a registry on a clock that stands
  still (so nothing expires while it is built), then opened and replayed as
  `handoff serve --state-dir` does at start: lock, quick_check, replay. Two
  such journals side by side, replayed alternately by this server: one as
  format 1 wrote it (every retained handoff its whole history) and one with
  format 2's snapshots (a retained handoff one record). With ``--against
  CHECKOUT`` (another worktree, its packages put first on the path), one snapshot
  journal instead, replayed alternately by this checkout's code and that one's,
  each replay in a fresh process; and in the overhead part, a fifth server,
  "normal" served by that checkout's code.

Run: .venv/bin/python -m bench.journal [--quick] [--live N --retained N]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import platform
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

from bench.ab import baseline_server
from bench.load import LoadSpec, run_in_process
from bench.procs import ServerProcess
from bench.service import Measured, drive, load_average, percentile, say
from handoff_server.domain.entries import StartRequest
from handoff_server.domain.model import (
    DestinationReserved,
    Order,
    Outcome,
    OutcomeKind,
    SourceHeld,
    TimingMode,
    TransferCompleted,
    TransferTiming,
)
from handoff_server.domain.registry import Registry
from handoff_server.domain.retained import Retained
from handoff_server.durability.journal import DATABASE, Journal
from handoff_server.durability.records import JournalRecorder
from handoff_server.durability.recovery import ReplayClock, recover
from handoff_server.ops.config import Settings
from handoff_server.ops.metrics import Metrics

WAYS = {"history (format 1)": False, "snapshots (format 2)": True}
MODES = {
    "off": (),
    "normal, commit delay 0": ("--durability", "normal", "--journal-commit-delay-ms", "0"),
    "normal": ("--durability", "normal"),
    "full": ("--durability", "full"),
}
TIMING = TransferTiming(TimingMode.FULL_PROMPT, 1024, 1024, 10.0)


def overhead(args: argparse.Namespace, state: Path) -> list[str]:
    servers: dict[str, ServerProcess] = {}
    for mode, flags in MODES.items():
        journal = () if mode == "off" else ("--state-dir", str(state / mode), *flags)
        servers[mode] = ServerProcess.service(
            "--event-loop", args.event_loop, *journal, name=f"journal {mode}"
        )
    if args.against is not None:
        # The same flags as "normal", served by the other checkout's code.
        mode = f"normal, {args.against.name}'s code"
        flags = ("--state-dir", str(state / mode), *MODES["normal"])
        servers[mode] = baseline_server(
            args.against.resolve(), "--event-loop", args.event_loop, *flags
        )
    base = LoadSpec(
        target="",
        path="stream",
        pairs=args.pairs,
        concurrency=args.concurrency,
        duration_s=args.duration_s,
        warmup_s=min(2.0, args.duration_s / 4),
        rate=args.rate,
    )
    pace = f"{args.rate:g}/s" if args.rate else "max"
    results: dict[tuple[str, str], list[Measured]] = {}
    try:
        with multiprocessing.get_context("spawn").Pool(args.clients) as pool:
            for round_ in range(args.rounds):
                for path, batch in (("stream", True), ("unary", False)):
                    if path not in args.paths:
                        continue
                    for mode in servers:
                        say(f"round {round_ + 1}: {path}, journal {mode}")
                        spec = replace(base, path=path, batch=batch)
                        measured = drive(pool, args.clients, servers[mode], spec, pace)
                        results.setdefault((path, mode), []).append(measured)
        held = {mode: journal_bytes(state / mode) for mode in servers if mode != "off"}
    finally:
        for server in servers.values():
            server.stop()
    lines = [
        "| path | journal | handoffs/s | server CPU µs/handoff | vs off | vs off, median of"
        " rounds | handoff p99 ms | rejected+unfinished |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for path in ("stream", "unary"):
        if path not in args.paths:
            continue
        off = cpu_per_handoff(results[(path, "off")])
        for mode in servers:
            runs = results[(path, mode)]
            cpu = cpu_per_handoff(runs)
            rate = sum(m.result.completed for m in runs) / sum(m.result.window_s for m in runs)
            bad = sum(m.result.rejected + m.result.unfinished for m in runs)
            p99 = percentile([s for m in runs for s in m.result.handoff_s], 0.99) * 1000
            # Each round against the same round's "off": a load that comes and
            # goes on the shared machine weighs on one round, not the ratio.
            rounds = statistics.median(
                cpu_per_handoff([run]) / cpu_per_handoff([against]) - 1
                for run, against in zip(runs, results[(path, "off")], strict=True)
            )
            lines.append(
                f"| {path} | {mode} | {rate:,.0f} | {cpu:,.0f} | {cpu / off - 1:+.1%} | "
                f"{rounds:+.1%} | {p99:.1f} | {bad} |"
            )
    lines.append("")
    for mode, (count, size) in held.items():
        lines.append(
            f"Journal {mode} after the run: {count:,} handoffs held (retained), "
            f"{size / max(count, 1):,.0f} bytes of database per handoff (pages, index, WAL "
            "excluded)."
        )
    return lines


def soak(args: argparse.Namespace, state: Path) -> list[str]:
    state_dir = state / "soak"
    server = ServerProcess.service(
        "--event-loop",
        args.event_loop,
        "--state-dir",
        str(state_dir),
        "--retention-s",
        str(args.soak_retention_s),
        name="journal soak",
    )
    spec = LoadSpec(
        target=server.target,
        path="stream",
        pairs=args.pairs,
        concurrency=args.concurrency,
        duration_s=args.soak_s,
        warmup_s=0.0,
        rate=args.soak_rate,
    )
    samples: list[tuple[float, int, int]] = []  # seconds, RSS, journal bytes
    try:
        with multiprocessing.get_context("spawn").Pool(1) as pool:
            say(f"soak: {args.soak_rate:g}/s for {args.soak_s:g} s")
            running = pool.apply_async(run_in_process, (spec,))
            began = time.monotonic()
            while not running.ready():
                running.wait(args.soak_s / 60)
                size = sum(p.stat().st_size for p in state_dir.glob(f"{DATABASE}*"))
                samples.append((time.monotonic() - began, server.rss_bytes(), size))
            result = running.get()
    finally:
        server.stop()
    # Steady once retention has expired the first handoffs, plus the WAL's
    # first checkpoint: judged from a third of the way in.
    steady = [s for s in samples if s[0] >= max(args.soak_s / 3, 2 * args.soak_retention_s)]
    early = steady[: len(steady) // 2] or steady
    late = steady[len(steady) // 2 :] or steady
    rss_growth = max(s[1] for s in late) / max(s[1] for s in early) - 1
    size_growth = max(s[2] for s in late) / max(s[2] for s in early) - 1
    flat = rss_growth <= 0.10 and size_growth <= 0.10
    return [
        f"Soak with the journal on: {result.completed:,} handoffs at {args.soak_rate:g}/s for "
        f"{args.soak_s:g} s, retention {args.soak_retention_s:g} s; "
        f"{result.rejected + result.unfinished} rejected or unfinished.",
        "",
        "| at | RSS | journal files (database + WAL) |",
        "|---:|---:|---:|",
        *(
            f"| {at:.0f} s | {rss / 2**20:.1f} MiB | {size / 2**20:.2f} MiB |"
            for at, rss, size in samples[:: max(1, len(samples) // 8)] + samples[-1:]
        ),
        "",
        f"Second half of the steady part against the first: RSS {rss_growth:+.1%}, journal "
        f"files {size_growth:+.1%}: {'FLAT' if flat else 'GROWS'} (limit +10%).",
    ]


def cpu_per_handoff(runs: list[Measured]) -> float:
    done = sum(m.result.total_completed for m in runs)
    return sum(m.server_cpu_s for m in runs) / done * 1e6 if done else float("nan")


def journal_bytes(state_dir: Path) -> tuple[int, int]:
    """Handoffs the journal holds, and the database's bytes in use (WAL excluded)."""
    with sqlite3.connect(state_dir / DATABASE) as db:
        count = db.execute("SELECT count(DISTINCT handoff_id) FROM records").fetchone()[0]
        pages = db.execute("PRAGMA page_count").fetchone()[0]
        free = db.execute("PRAGMA freelist_count").fetchone()[0]
        size = db.execute("PRAGMA page_size").fetchone()[0]
    return count, (pages - free) * size


class HistoryOnly(JournalRecorder):
    """The recorder as format 1 had it: a completed handoff keeps its history."""

    def completed(self, retained: Retained, at: float) -> None:
        pass


def build(state_dir: Path, live: int, retained: int, snapshots: bool) -> int:
    """A journal of ``live`` handoffs mid-flight and ``retained`` complete; its size.

    Without ``snapshots`` it is what format 1 wrote: every retained handoff
    kept as its whole history.
    """
    now = [time.time()]
    journal = Journal.open(state_dir)
    clock = ReplayClock(lambda: now[0])
    settings = Settings(max_active_handoffs=live + 1, max_retained=retained + 1)
    registry = Registry(settings, Metrics(), clock)
    recover(journal, registry, clock)
    registry.recorder = (JournalRecorder if snapshots else HistoryOnly)(journal)
    applied = Outcome(OutcomeKind.APPLIED)
    for i in range(retained + live):
        h = str(uuid.UUID(int=i + 1))
        registry.start(StartRequest(h, Order.SOURCE_FIRST, f"p{i % 64}", f"d{i % 64}", 1.0))
        registry.report_outcome(h, 0, Outcome(OutcomeKind.SUBMITTED))
        registry.report_fact(h, SourceHeld(TIMING))
        registry.report_outcome(h, 1, Outcome(OutcomeKind.ACCEPTED))
        if i >= retained:
            continue  # live: waiting for the destination's reservation
        registry.report_fact(h, DestinationReserved(1024))
        registry.report_outcome(h, 2, Outcome(OutcomeKind.SCHEDULED))
        registry.report_fact(h, TransferCompleted())
        registry.report_outcome(h, 3, applied)
        registry.report_outcome(h, 4, applied)
        if i % 10_000 == 0:
            journal.commit_now()
    journal.commit_now()
    journal.close_now()
    return journal.size_bytes()


# One replay as `handoff serve --state-dir` starts, in a fresh process, with
# whichever checkout's code the interpreter imports; the API both share.
# Its packages come first on the path (argv 2 and 3); modules before the
# layered packages had other paths.
REPLAY = """
import json, sys, time
from pathlib import Path
sys.path[:0] = sys.argv[2:4]
try:
    from handoff_server.ops.config import Settings
    from handoff_server.durability.journal import Journal
    from handoff_server.ops.metrics import Metrics
    from handoff_server.durability.recovery import ReplayClock, recover
    from handoff_server.domain.registry import Registry
except ImportError:
    from handoff_server.config import Settings
    from handoff_server.journal import Journal
    from handoff_server.metrics import Metrics
    from handoff_server.recovery import ReplayClock, recover
    from handoff_server.registry import Registry
wall, cpu = time.monotonic(), time.process_time()
journal = Journal.open(Path(sys.argv[1]))
opened = time.monotonic() - wall
clock = ReplayClock(time.time)
result = recover(journal, Registry(Settings(), Metrics(), clock), clock)
wall, cpu = time.monotonic() - wall, time.process_time() - cpu
print(json.dumps([result.records, result.total, result.skipped, wall, cpu, opened]))
"""


def recovery_against(args: argparse.Namespace, state: Path) -> list[str]:
    """One snapshot journal replayed by this checkout's code and by ``--against``'s,
    alternately, each replay in a fresh process (imports and all)."""
    say(f"recovery: writing {args.live:,} live + {args.retained:,} retained (snapshots)")
    size = build(state / "recovery", args.live, args.retained, True)
    here = Path(__file__).resolve().parents[1]
    codes = {here.name: here, args.against.name: args.against}
    lines = [
        f"Recovery of {args.live:,} live + {args.retained:,} retained handoffs (one format 2 "
        f"journal, {size / 2**20:,.1f} MiB), as `handoff serve --state-dir` starts (lock, "
        "quick_check, replay), by two checkouts' code alternately, each in a fresh process:",
        "",
        "| code | round | records | wall s | CPU s | opening s | handoffs back | skipped |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for round_ in range(args.recovery_rounds):
        for name, checkout in codes.items():
            say(f"recovery: replaying ({name}), round {round_ + 1}")
            paths = [str(checkout / "server"), str(checkout / "client")]
            run = subprocess.run(
                [sys.executable, "-c", REPLAY, state / "recovery", *paths],
                cwd=checkout,
                capture_output=True,
                text=True,
                check=True,
            )
            records, total, skipped, wall, cpu, opened = json.loads(run.stdout)
            lines.append(
                f"| {name} | {round_ + 1} | {records:,} | {wall:.2f} | {cpu:.2f} | "
                f"{opened:.2f} | {total:,} | {skipped} |"
            )
    return lines


def recovery(args: argparse.Namespace, state: Path) -> list[str]:
    """Both journals written, then each replayed as the server starts, alternating."""
    if args.against is not None:
        return recovery_against(args, state)
    sizes: dict[str, int] = {}
    for way, snapshots in WAYS.items():
        say(f"recovery: writing {args.live:,} live + {args.retained:,} retained ({way})")
        sizes[way] = build(state / f"recovery-{way}", args.live, args.retained, snapshots)
    lines = [
        f"Recovery of {args.live:,} live + {args.retained:,} retained handoffs, as "
        "`handoff serve --state-dir` starts (lock, quick_check, replay):",
        "",
        "| journal | round | records | on disk | wall s | CPU s | opening s | handoffs back |"
        " skipped |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for round_ in range(args.recovery_rounds):
        for way in WAYS:
            say(f"recovery: replaying ({way}), round {round_ + 1}")
            wall, cpu = time.monotonic(), time.process_time()
            journal = Journal.open(state / f"recovery-{way}")
            opened = time.monotonic() - wall
            clock = ReplayClock(time.time)
            registry = Registry(Settings(), Metrics(), clock)
            result = recover(journal, registry, clock)
            wall, cpu = time.monotonic() - wall, time.process_time() - cpu
            journal.close_now()
            lines.append(
                f"| {way} | {round_ + 1} | {result.records:,} | {sizes[way] / 2**20:,.1f} MiB | "
                f"{wall:.2f} | {cpu:.2f} | {opened:.2f} | {result.total:,} | {result.skipped} |"
            )
            del registry, journal
    return lines


def parse(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a smoke run (< 30 s)")
    parser.add_argument("--only", default="overhead,soak,recovery", help="parts, comma-separated")
    parser.add_argument("--paths", default="stream,unary", help="overhead paths, comma-separated")
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds per mode")
    parser.add_argument("--duration-s", type=float, default=15.0, help="each measured window")
    parser.add_argument("--concurrency", type=int, default=128, help="handoffs in flight")
    parser.add_argument("--pairs", type=int, default=4, help="engine pairs per load process")
    parser.add_argument("--clients", type=int, default=1, help="load processes")
    parser.add_argument(
        "--rate", type=float, help="overhead: handoffs/s started (open loop), not the maximum"
    )
    parser.add_argument("--live", type=int, default=100_000, help="live handoffs to recover")
    parser.add_argument("--retained", type=int, default=100_000, help="retained to recover")
    parser.add_argument("--recovery-rounds", type=int, default=2, help="replays of each journal")
    parser.add_argument(
        "--against",
        type=Path,
        help="recovery: replay one format 2 journal by this checkout and by this other "
        "one (its packages first on the path), alternately; overhead: also serve 'normal' "
        "by that one's code",
    )
    parser.add_argument("--soak-s", type=float, default=600.0, help="soak duration")
    parser.add_argument("--soak-rate", type=float, default=100.0, help="soak handoffs/s")
    parser.add_argument("--soak-retention-s", type=float, default=30.0, help="soak retention")
    parser.add_argument("--event-loop", default="uvloop", choices=("asyncio", "uvloop"))
    args = parser.parse_args(argv)
    if args.quick:
        args.rounds, args.duration_s, args.concurrency = 1, 1.0, 32
        args.live, args.retained, args.recovery_rounds = 500, 500, 1
        args.soak_s, args.soak_rate, args.soak_retention_s = 6.0, 50.0, 1.0
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse(argv)
    parts = set(args.only.split(","))
    load_before = load_average()
    began = time.monotonic()
    lines: list[str] = []
    with tempfile.TemporaryDirectory(prefix="handoff-journal-bench-") as tmp:
        if "overhead" in parts:
            lines += overhead(args, Path(tmp))
            lines.append("")
        if "soak" in parts:
            lines += soak(args, Path(tmp))
            lines.append("")
        if "recovery" in parts:
            lines += recovery(args, Path(tmp))
    print(f"## Journal benchmark ({'quick' if args.quick else 'full'} run)")
    print()
    print(
        f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
        f"Python {platform.python_version()}, SQLite {sqlite3.sqlite_version}; load average "
        f"{load_before} before, {load_average()} after; {time.monotonic() - began:.0f} s; "
        f"{args.rounds} alternating rounds of {args.duration_s:g} s per path and mode, "
        f"{args.concurrency} in flight"
        f"{f', {args.rate:g} handoffs/s started' if args.rate else ''}, servers on "
        f"{args.event_loop}."
    )
    print()
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
