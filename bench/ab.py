"""Server CPU per handoff, this tree against another checkout, side by side in one run.

Both servers run at once; the rounds alternate which goes first, so a shared,
noisy machine weighs on both alike. The load (bench/load.py, as bench/service.py
drives it) is this tree's. Make the other checkout with, for example:

    git worktree add /tmp/before main    (or: git archive REV | tar -x -C /tmp/before)

Run: .venv/bin/python -m bench.ab /tmp/before --rounds 8 --duration-s 6
"""

from __future__ import annotations

import argparse
import multiprocessing
import statistics
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

from bench.load import LoadSpec
from bench.procs import SERVICE, SERVICE_FLAGS, ServerProcess
from bench.service import drive, label, load_average, say

# The server of another checkout: its packages first on the path, then its CLI
# (handoff_server.cli before the packages moved into layers).
BASELINE = (
    "import runpy, sys; sys.path[:0] = sys.argv[1:3]; cli = sys.argv[3]; del sys.argv[1:4]; "
    "runpy.run_module(cli, run_name='__main__', alter_sys=True)"
)


def cli_module(tree: Path) -> str:
    layered = (tree / "server" / "handoff_server" / "commands" / "cli.py").exists()
    return "handoff_server.commands.cli" if layered else "handoff_server.cli"


def baseline_server(tree: Path, *flags: str) -> ServerProcess:
    paths = [str(tree / "server"), str(tree / "client"), cli_module(tree)]
    return ServerProcess(["-c", BASELINE, *paths, *SERVICE[2:], *SERVICE_FLAGS, *flags], "before")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("before", type=Path, help="the other checkout (its root)")
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--duration-s", type=float, default=6.0, help="each measured window")
    parser.add_argument("--concurrency", type=int, default=128, help="handoffs in flight")
    args = parser.parse_args(argv)
    servers = {
        "before": baseline_server(args.before.resolve()),
        "after": ServerProcess.service(name="after"),
    }
    base = LoadSpec(
        target="", path="stream", concurrency=args.concurrency, duration_s=args.duration_s
    )
    specs = [replace(base, batch=True), replace(base, path="unary", batch=False)]
    cpu: dict[tuple[str, str], list[float]] = {}
    load_before = load_average()
    try:
        with multiprocessing.get_context("spawn").Pool(1) as pool:
            for round_ in range(args.rounds):
                order = ("before", "after") if round_ % 2 == 0 else ("after", "before")
                for spec in specs:
                    for name in order:
                        measured = drive(pool, 1, servers[name], spec, "max")
                        us = measured.cpu_per_handoff_us
                        cpu.setdefault((label(spec), name), []).append(us)
                        say(f"round {round_} {label(spec)} {name}: {us:,.0f} µs per handoff")
    finally:
        for server in servers.values():
            server.stop()
    print(f"load average {load_before} before, {load_average()} after")
    print()
    print("| path | before, µs/handoff | after, µs/handoff | after vs before (means) |")
    print("|---|---|---|---|")
    for spec in specs:
        before, after = cpu[(label(spec), "before")], cpu[(label(spec), "after")]
        change = statistics.mean(after) / statistics.mean(before) - 1
        print(f"| {label(spec)} | {_runs(before)} | {_runs(after)} | {change:+.1%} |")
    return 0


def _runs(samples: list[float]) -> str:
    shown = " / ".join(f"{s:,.0f}" for s in samples)
    return (
        f"{shown} (mean {statistics.mean(samples):,.0f}, median {statistics.median(samples):,.0f})"
    )


if __name__ == "__main__":
    raise SystemExit(main())
