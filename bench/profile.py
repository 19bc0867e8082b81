"""Where the server's CPU goes under the streaming max-rate load: py-spy, grouped.

Starts ``handoff serve`` as bench.service does, drives it with bench/load.py
(closed loop, 128 in flight, batched Connect unless ``--path unary``), and
samples the server with py-spy (``pip install py-spy``; it needs ptrace, so
root or CAP_SYS_PTRACE) for the window. Each sample is charged to the
innermost frame that names a known place (our packages, gRPC, protobuf,
asyncio, ...), so the table is self time by area. Shares, not speeds: they
hold on a loaded machine better than rates do, but still say the load.

Run: .venv/bin/python -m bench.profile [--duration-s 12] [--path stream|unary]
"""

from __future__ import annotations

import argparse
import multiprocessing
import re
import shutil
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

from bench.load import LoadSpec, run_in_process
from bench.procs import ServerProcess
from bench.service import load_average

# The innermost frame's file decides; the first pattern that matches wins.
AREAS: tuple[tuple[str, str], ...] = (
    ("handoff_server/domain/core", "core (state machine)"),
    ("handoff_server/domain/", "registry, delivery, timers"),
    ("handoff_server/service/convert", "protobuf building (convert)"),
    ("handoff_server/service/servicer", "servicer (streams, acks)"),
    ("handoff_server/service/", "guard, quotas, security"),
    ("handoff_server/durability/", "journal"),
    ("handoff_server/ops/", "metrics, logs, tracing hooks"),
    ("prometheus_client", "metrics, logs, tracing hooks"),
    ("logging/", "metrics, logs, tracing hooks"),
    ("google/protobuf", "protobuf runtime"),
    ("grpc/_cython", "gRPC core (Cython) + its callbacks"),
    ("grpc/", "gRPC Python"),
    # gRPC's Cython callbacks have no Python frame: their time lands on the
    # loop's frame that called them.
    ("asyncio/", "asyncio loop + gRPC's Cython callbacks"),
    ("uvloop", "asyncio loop + gRPC's Cython callbacks"),
)
FRAME = re.compile(r"\((?P<file>[^():]+)(?::\d+)?\)$")


def area(stack: str) -> str:
    for frame in reversed(stack.split(";")):
        match = FRAME.search(frame.strip())
        if match is None:
            continue
        path = match["file"]
        for pattern, name in AREAS:
            if pattern in path:
                return name
    return "gRPC's own threads, other native frames"


def profile(path: str, duration_s: float, rate: int) -> Counter[str]:
    spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    server = ServerProcess.service()
    try:
        spec = LoadSpec(target=server.target, path=path, duration_s=duration_s + 2, warmup_s=2)
        with tempfile.TemporaryDirectory() as tmp:
            raw = Path(tmp) / "raw.txt"
            context = multiprocessing.get_context("spawn")
            with context.Pool(1) as pool:
                load = pool.apply_async(run_in_process, (spec,))
                pid, seconds = str(server.process.pid), str(int(duration_s))
                record = ["record", "-p", pid, "-r", str(rate), "-d", seconds, "-f", "raw"]
                subprocess.run(
                    [spy, *record, "-o", str(raw), "--nonblocking"],
                    check=True,
                    capture_output=True,
                )
                result = load.get()
            if result.rejected:
                raise RuntimeError(f"the load went wrong: {result}")
            samples: Counter[str] = Counter()
            for line in raw.read_text().splitlines():
                stack, _, count = line.rpartition(" ")
                if stack:
                    samples[area(stack)] += int(count)
            return samples
    finally:
        server.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--path", choices=("stream", "unary"), default="stream")
    parser.add_argument("--duration-s", type=float, default=12.0)
    parser.add_argument("--rate", type=int, default=200, help="py-spy samples per second")
    args = parser.parse_args()
    before = load_average()
    samples = profile(args.path, args.duration_s, args.rate)
    total = sum(samples.values())
    print(f"py-spy, {args.path} max rate, {args.duration_s:g} s, {total} samples,")
    print(f"load average {before} before, {load_average()} after")
    print("| where the server's time goes (self time) | share |")
    print("|---|---|")
    for name, count in samples.most_common():
        print(f"| {name} | {100 * count / total:.1f}% |")


if __name__ == "__main__":
    main()
