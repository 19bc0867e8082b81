"""The journal benchmark's smoke run completes and prints its tables (no speed is asserted)."""

from __future__ import annotations

import pytest

from tests.support.processes import bench_output


@pytest.mark.timeout(150)
def test_quick_journal_bench_prints_its_tables() -> None:
    out = bench_output("bench.journal", "--quick", timeout_s=140.0)
    for path in ("stream", "unary"):
        for mode in ("off", "normal", "full"):
            assert f"| {path} | {mode} |" in out, out
    assert "Soak with the journal on" in out
    assert "Recovery of 500 live + 500 retained handoffs" in out
    for journal in ("history (format 1)", "snapshots (format 2)"):
        assert f"| {journal} | 1 |" in out, out
        assert "| 1,000 | 0 |" in out, out  # handoffs back, records skipped
