"""Benchmark the pure core: success-path throughput and memory per live handoff.

Run: .venv/bin/python bench/core.py   (or `make bench-core`)
"""

from __future__ import annotations

import argparse
import gc
import time
import tracemalloc
import uuid

from handoff_server.domain.core import Handoff
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
from handoff_server.domain.packing import pack

TIMING = TransferTiming(TimingMode.FULL_PROMPT, 2048, 131072, 50.0)
SUBMITTED = Outcome(OutcomeKind.SUBMITTED)
ACCEPTED = Outcome(OutcomeKind.ACCEPTED)
SCHEDULED = Outcome(OutcomeKind.SCHEDULED)
APPLIED = Outcome(OutcomeKind.APPLIED)
RESERVED = DestinationReserved(2048)
HELD = SourceHeld(TIMING)
TRANSFERRED = TransferCompleted()


def success_path(handoff_id: str, order: Order) -> Handoff:
    """Drive one handoff from start to a SUCCESS completion: 10 core calls."""
    handoff = Handoff(handoff_id, order, 1.0)
    (first,) = handoff.start()
    if order is Order.SOURCE_FIRST:
        handoff.apply_outcome(first.id, SUBMITTED)
        (second,) = handoff.apply_fact(HELD)
        handoff.apply_outcome(second.id, ACCEPTED)
        (transfer,) = handoff.apply_fact(RESERVED)
    else:
        handoff.apply_outcome(first.id, ACCEPTED)
        (second,) = handoff.apply_fact(RESERVED)
        handoff.apply_outcome(second.id, SUBMITTED)
        (transfer,) = handoff.apply_fact(HELD)
    handoff.apply_outcome(transfer.id, SCHEDULED)
    (activate,) = handoff.apply_fact(TRANSFERRED)
    (release,) = handoff.apply_outcome(activate.id, APPLIED)
    handoff.apply_outcome(release.id, APPLIED)
    return handoff


def mid_flight(handoff_id: str) -> Handoff:
    """A handoff with the transfer scheduled: the largest state a live handoff has."""
    handoff = Handoff(handoff_id, Order.SOURCE_FIRST, 1.0)
    (first,) = handoff.start()
    handoff.apply_outcome(first.id, SUBMITTED)
    (second,) = handoff.apply_fact(HELD)
    handoff.apply_outcome(second.id, ACCEPTED)
    (transfer,) = handoff.apply_fact(RESERVED)
    handoff.apply_outcome(transfer.id, SCHEDULED)
    return handoff


def throughput(count: int) -> float:
    ids = [str(uuid.uuid4()) for _ in range(count)]
    orders = [Order.SOURCE_FIRST, Order.DESTINATION_FIRST]
    started = time.perf_counter()
    for index, handoff_id in enumerate(ids):
        success_path(handoff_id, orders[index & 1])
    return count / (time.perf_counter() - started)


def bytes_per_live_handoff(count: int) -> float:
    # The ids are the caller's, not the core's: allocate them before measuring.
    ids = [str(uuid.uuid4()) for _ in range(count)]
    gc.collect()
    tracemalloc.start()
    baseline = tracemalloc.get_traced_memory()[0]
    live = {handoff_id: mid_flight(handoff_id) for handoff_id in ids}
    used = tracemalloc.get_traced_memory()[0] - baseline
    tracemalloc.stop()
    assert len(live) == count
    return used / count


def bytes_per_packed_handoff(count: int) -> float:
    """What a retained handoff keeps of its core: a completed one, packed."""
    ids = [str(uuid.uuid4()) for _ in range(count)]
    orders = [Order.SOURCE_FIRST, Order.DESTINATION_FIRST]
    gc.collect()
    tracemalloc.start()
    baseline = tracemalloc.get_traced_memory()[0]
    packed = [pack(success_path(i, orders[n & 1])) for n, i in enumerate(ids)]
    used = tracemalloc.get_traced_memory()[0] - baseline
    tracemalloc.stop()
    assert len(packed) == count
    return used / count


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--handoffs", type=int, default=200_000, help="success paths to time")
    parser.add_argument("--live", type=int, default=100_000, help="handoffs alive for memory")
    parser.add_argument("--retained", type=int, default=100_000, help="completed, packed")
    parser.add_argument("--rounds", type=int, default=3, help="best of this many timings")
    args = parser.parse_args()
    rate = max(throughput(args.handoffs) for _ in range(args.rounds))
    per_handoff = bytes_per_live_handoff(args.live)
    per_packed = bytes_per_packed_handoff(args.retained)
    print(f"success-path handoffs/s (single thread, best of {args.rounds}): {rate:,.0f}")
    print(
        f"memory per live handoff ({args.live:,} alive mid-flight, tracemalloc): "
        f"{per_handoff:,.0f} bytes"
    )
    print(
        f"memory per completed handoff's packed core ({args.retained:,} retained, "
        f"tracemalloc): {per_packed:,.0f} bytes"
    )


if __name__ == "__main__":
    main()
