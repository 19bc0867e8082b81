"""Instructions per handoff, this tree against another checkout, under callgrind.

CPU seconds on a shared 2-core machine spread by ±20 % from round to round
(bench/ab.py), which hides a 5 % change; the instructions a server executes
for the same handoffs do not depend on what else the machine runs. Each
server runs under ``valgrind --tool=callgrind`` (about 50 times slower), is
warmed up, has its counters zeroed, serves a number of full success paths
from bench/load.py's engines at a low concurrency, and dumps: the dump's
total over the handoffs is the figure. gRPC's threads are counted with the
event loop's. Needs valgrind (Debian's package).

Run: .venv/bin/python -m bench.instructions /tmp/before --rounds 2   (--after: another tree
than this one; both run on this tree's load and Python)
"""

from __future__ import annotations

import argparse
import asyncio
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

from bench.ab import BASELINE, cli_module
from bench.load import LoadSpec, run
from bench.procs import ROOT, SERVICE_FLAGS, SERVING
from bench.service import say

WARMUP = 40  # handoffs before the counters are zeroed: imports, first streams
CONCURRENCY = 8  # low, so the slowed server never lets a delivery time out
CALLGRIND = ["valgrind", "--tool=callgrind"]
LABELS = {"stream": "stream (batched)", "unary": "unary"}
SUMMARY = re.compile(r"^summary: (\d+)$", re.MULTILINE)


def instructions_per_handoff(tree: Path, path: str, handoffs: int, out: Path) -> float:
    """One server of ``tree`` under callgrind: instructions per handoff on ``path``."""
    server = ["-c", BASELINE, str(tree / "server"), str(tree / "client"), cli_module(tree)]
    serve = ["serve", "--host", "127.0.0.1", "--port", "0", *SERVICE_FLAGS]
    process = subprocess.Popen(
        [*CALLGRIND, f"--callgrind-out-file={out}", sys.executable, *server, *serve],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        port = _port(process)
        spec = LoadSpec(
            target=f"127.0.0.1:{port}",
            path=path,
            batch=path == "stream",
            pairs=2,
            concurrency=CONCURRENCY,
            count=WARMUP,
        )
        asyncio.run(run(spec))
        _control("--zero", process.pid)
        result = asyncio.run(run(replace(spec, count=handoffs)))
        _control("--dump", process.pid)
    finally:
        process.terminate()
        process.wait(120)
    if result.total_completed != handoffs or result.rejected:
        raise SystemExit(f"{tree}: {result.total_completed} of {handoffs} handoffs completed")
    dump = Path(f"{out}.1").read_text()
    match = SUMMARY.search(dump)
    if match is None:
        raise SystemExit(f"no summary in {out}.1")
    return int(match.group(1)) / handoffs


def _port(process: subprocess.Popen[str]) -> int:
    assert process.stdout is not None
    seen = []
    for line in process.stdout:
        seen.append(line)
        if match := SERVING.search(line):
            threading.Thread(target=process.stdout.read, daemon=True).start()  # keep it drained
            return int(match.group(1))
    raise SystemExit("the server under callgrind did not start:\n" + "".join(seen[-20:]))


def _control(option: str, pid: int) -> None:
    subprocess.run(["callgrind_control", option, str(pid)], check=True, capture_output=True)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("before", type=Path, help="the other checkout (its root)")
    parser.add_argument("--after", type=Path, default=ROOT, help="the checkout to compare")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--unary-handoffs", type=int, default=200)
    parser.add_argument("--stream-handoffs", type=int, default=300)
    args = parser.parse_args(argv)
    if shutil.which("valgrind") is None or shutil.which("callgrind_control") is None:
        print("bench.instructions needs valgrind: apt-get install valgrind", file=sys.stderr)
        return 2
    trees = {"before": args.before.resolve(), "after": args.after.resolve()}
    counts: dict[tuple[str, str], list[float]] = {}
    with tempfile.TemporaryDirectory(prefix="bench-instructions-") as scratch:
        sizes = {"stream": args.stream_handoffs, "unary": args.unary_handoffs}
        for round_ in range(args.rounds):
            for path, handoffs in sizes.items():
                for name, tree in trees.items():
                    out = Path(scratch) / f"{name}-{path}-{round_}.out"
                    figure = instructions_per_handoff(tree, path, handoffs, out)
                    counts.setdefault((path, name), []).append(figure)
                    say(f"round {round_} {path} {name}: {figure:,.0f} instructions per handoff")
    print("| path | before, instructions/handoff | after | after vs before (means) |")
    print("|---|---|---|---|")
    for path in ("stream", "unary"):
        before, after = counts[(path, "before")], counts[(path, "after")]
        change = statistics.mean(after) / statistics.mean(before) - 1
        shown = [" / ".join(f"{c:,.0f}" for c in side) for side in (before, after)]
        print(f"| {LABELS[path]} | {shown[0]} | {shown[1]} | {change:+.1%} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
