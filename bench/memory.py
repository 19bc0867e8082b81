"""Server memory: RSS per live handoff, per retained handoff, and a soak.

Each measurement has a server process of its own, so earlier load leaves no
garbage behind in it. RSS is what the kernel charges the process, allocator
slack included: that is what a memory limit sees.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from multiprocessing.pool import Pool

from bench.load import LoadResult, LoadSpec, run_in_process
from bench.procs import ServerProcess

# Room for every handoff the measurement keeps, deadlines that never fire, and
# engines that may go away (the live handoffs must not fail when they do).
ROOMY = [
    "--delivery-timeout-s",
    "86400",
    "--max-active-handoffs",
    "1000000",
    "--max-retained",
    "1000000",
    "--max-queued-actions-per-engine",
    "1000000",
    "--default-timeout-s",
    "86400",
]


def memory_server(retention_s: float, name: str, *flags: str) -> ServerProcess:
    return ServerProcess.service(*ROOMY, "--retention-s", str(retention_s), *flags, name=name)


@dataclass
class PerHandoff:
    count: int
    baseline_rss: int
    rss: int
    result: LoadResult

    @property
    def bytes_each(self) -> float:
        return (self.rss - self.baseline_rss) / self.count


def per_handoff(
    pool: Pool, server: ServerProcess, spec: LoadSpec, count: int, warmup: int, quiet_s: float
) -> PerHandoff:
    """RSS growth per handoff over ``count`` handoffs, after ``warmup`` of the same kind.

    The warm-up pays for what the first handoffs allocate once (streams,
    caches, metric children, allocator arenas), so it is not billed per handoff.
    """
    pool.apply(run_in_process, (replace(spec, target=server.target, count=warmup),))
    baseline = server.settled_rss(quiet_s)
    result = pool.apply(run_in_process, (replace(spec, target=server.target, count=count),))
    return PerHandoff(count, baseline, server.settled_rss(quiet_s), result)


@dataclass
class Soak:
    rate: float
    duration_s: float
    retention_s: float
    fresh_rss: int = 0  # before any load
    baseline_rss: int = 0  # after a warm-up at the soak rate, once its retention expired
    peak_rss: int = 0
    final_rss: int = 0  # after the soak, once its retention expired
    result: LoadResult = field(default_factory=LoadResult)
    samples: list[tuple[float, int]] = field(default_factory=list)  # (s into the soak, RSS)

    @property
    def holds(self) -> bool:
        return self.final_rss <= 1.10 * self.baseline_rss and self.result.rejected == 0


def soak(
    pool: Pool,
    server: ServerProcess,
    spec: LoadSpec,
    warmup_s: float,
    sample_every_s: float,
    quiet_s: float,
    log: Callable[[str], None],
) -> Soak:
    """Open-loop load at ``spec.rate`` for ``spec.duration_s``; RSS must come back after.

    The baseline is taken after a warm-up at the same rate whose retention has
    expired: it includes what serving once costs for good (arenas, stream
    buffers), so what the soak is judged on is growth that outlives retention.
    """
    assert spec.rate is not None
    retention_s = float(spec_retention(server))
    target = server.target  # waits until it serves, so "fresh" is a started server
    outcome = Soak(spec.rate, spec.duration_s, retention_s, fresh_rss=server.rss_bytes())
    pool.apply(
        run_in_process,
        (replace(spec, target=target, duration_s=warmup_s, warmup_s=0.0),),
    )
    outcome.baseline_rss = server.settled_rss(retention_s + quiet_s)
    log(f"soak: baseline RSS {outcome.baseline_rss / 2**20:.1f} MiB; load for {spec.duration_s} s")
    running = pool.apply_async(run_in_process, (replace(spec, target=target),))
    began = time.monotonic()
    next_log = began + 60.0
    while not running.ready():
        running.wait(sample_every_s)
        rss = server.rss_bytes()
        outcome.samples.append((time.monotonic() - began, rss))
        outcome.peak_rss = max(outcome.peak_rss, rss)
        if time.monotonic() >= next_log:
            log(f"soak: {time.monotonic() - began:.0f} s, RSS {rss / 2**20:.1f} MiB")
            next_log += 60.0
    outcome.result = running.get()
    # Expiry runs on the server's own timer: wait out retention, then read.
    outcome.final_rss = server.settled_rss(retention_s + quiet_s)
    return outcome


def spec_retention(server: ServerProcess) -> str:
    """The --retention-s the server was started with."""
    return server.args[server.args.index("--retention-s") + 1]
