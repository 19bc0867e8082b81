"""The service benchmark's smoke run completes and prints its table (no speed is asserted)."""

from __future__ import annotations

import subprocess
import sys

from tests.support import ROOT


def test_quick_bench_prints_its_table() -> None:
    run = subprocess.run(
        [sys.executable, "-m", "bench.service", "--quick"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=110,
        check=False,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    for heading in ("| path | server | load | handoffs/s", "| memory | handoffs", "Soak:"):
        assert heading in run.stdout, run.stdout
    for path in ("stream (batched)", "stream (one per message)", "unary"):
        for server in ("service", "floor"):
            assert f"| {path} | {server} | max" in run.stdout, run.stdout
