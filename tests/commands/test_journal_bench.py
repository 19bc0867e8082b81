"""The journal benchmark's smoke run completes and prints its tables (no speed is asserted)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.support.vectors import ROOT


@pytest.mark.timeout(150)
def test_quick_journal_bench_prints_its_tables() -> None:
    run = subprocess.run(
        [sys.executable, "-m", "bench.journal", "--quick"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=140,
        check=False,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    for path in ("stream", "unary"):
        for mode in ("off", "normal", "full"):
            assert f"| {path} | {mode} |" in run.stdout, run.stdout
    assert "Soak with the journal on" in run.stdout
    assert "Recovery of 500 live + 500 retained handoffs" in run.stdout
    for journal in ("history (format 1)", "snapshots (format 2)"):
        assert f"| {journal} | 1 |" in run.stdout, run.stdout
        assert "| 1,000 | 0 |" in run.stdout, run.stdout  # handoffs back, records skipped
