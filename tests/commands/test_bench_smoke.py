"""The service benchmark's smoke run completes and prints its table (no speed is asserted)."""

from __future__ import annotations

import pytest

from tests.support.processes import ROOT, bench_output


def test_quick_bench_prints_its_table() -> None:
    out = bench_output("bench.service", "--quick")
    for heading in ("| path | server | load | handoffs/s", "| memory | handoffs", "Soak:"):
        assert heading in out, out
    for path in ("stream (batched)", "stream (one per message)", "unary"):
        for server in ("service", "floor"):
            assert f"| {path} | {server} | max" in out, out


def test_quick_shard_comparison_prints_its_figures() -> None:
    out = bench_output("bench.service", "--quick", "--shards", "2")
    assert "| round | load per shard | shards | shard | handoffs/s" in out, out
    for mode in ("max", "100/s"):
        assert f"| 1 | {mode} | 1 | shard x1 |" in out, out
        for shard in ("handoff-0", "handoff-1"):
            assert f"| 1 | {mode} | 2 | {shard} |" in out, out
    # Only the shard comparison runs: no other phase was asked for.
    assert "| path | server |" not in out
    assert "Soak:" not in out
    # Every start went to the shard that wins its id: no refusal, nothing unfinished.
    assert "; errors 0" in out, out
    assert "- server CPU per handoff at 100/s per shard: 1 shard" in out
    assert "- capacity model:" in out


def test_quick_critical_path_prints_a_row_for_each_setup_and_named_hops() -> None:
    out = bench_output("bench.critical", "--quick")
    assert "| path | journal | load | handoffs/s | hop | samples | p50 ms | p99 ms |" in out, out
    rows = out.splitlines()
    # Every setup measured at both fractions of its own max rate: each path,
    # journal off and on (a loaded machine may leave a setup without samples).
    for path in ("stream (batched)", "unary"):
        for journal in ("off", "on"):
            for fraction in ("50%", "80%"):
                row = f"| {path} | {journal} | {fraction} of "
                assert any(line.startswith(row) for line in rows), (row, out)
    # The hops carry their names: fact, then the action it caused.
    hop_table = out.split("| hop | samples |", 1)[1].split("\n\n", 1)[0].splitlines()
    hops = {line.split(" | ")[4] for line in hop_table if line.startswith(("| stream", "| unary"))}
    assert hops <= {
        "SourceHeld → ReserveDestination",
        "DestinationReserved → StartTransfer",
        "SourceHeld → StartTransfer",
        "TransferCompleted → ActivateDestination",
        "DestinationReserved → SubmitPrefill",
        "no samples",
    }, hops
    # Each paced window beside the floor at the same rate (a loaded machine
    # may leave a window without samples, so at least one row).
    assert "| service p50 / p99 ms | floor p50 / p99 ms | added p50 / p99 ms |" in out, out
    beside = out.split("added p50 / p99 ms |", 1)[1].splitlines()
    assert any(line.startswith(("| stream", "| unary")) for line in beside), out


@pytest.mark.parametrize("journal", ["on", "off"])
def test_quick_critical_path_against_another_tree_prints_both_servers(journal: str) -> None:
    # This checkout stands in for the other one: both servers run its code.
    out = bench_output(
        "bench.critical",
        *("--quick", "--against", str(ROOT), "--journal", journal),
        *("--rounds", "1", "--rates", "40,20"),
    )
    assert f"## Fact→action, journal {journal}: " in out, out
    assert "| path | rate | server | p50 ms per round | p99 ms per round |" in out, out
    assert "| in the server, p99 ms per round | in the server, median p50 / p99 |" in out, out
    for path, rate in (("stream (batched)", "40/s"), ("unary", "20/s")):
        for server in ("before", "after"):
            row = next(
                line for line in out.splitlines() if f"| {path} | {rate} | {server} | " in line
            )
            # Both trees serve the server's histogram: its figures, not "-".
            assert not row.endswith("| - | - |"), row


def test_the_commit_benchmark_prints_both_ways_of_committing() -> None:
    out = bench_output("bench.commits", "--rows", "20", "--repeats", "3")
    assert "| commit of 20 records | on the caller | on a thread |" in out, out
    for way in ("one INSERT per record", "one per ROWS_PER_STATEMENT"):
        assert f"| {way} | " in out, out
