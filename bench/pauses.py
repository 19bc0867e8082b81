"""The cyclic garbage collector's pause with the registry full of retained handoffs.

A full collection walks every object the collector tracks and holds the
event loop meanwhile, so every handoff in flight waits it out. A server at
its default retention keeps up to max_retained completed handoffs for
retention_s: this measures what one full collection costs with ``--retained``
of them in a registry driven in-process (no gRPC), after the rest of the
process is frozen as `handoff serve` freezes it at startup.

Run: .venv/bin/python -m bench.pauses [--retained 100000]
"""

from __future__ import annotations

import argparse
import gc
import time

from bench.core import ACCEPTED, APPLIED, HELD, RESERVED, SCHEDULED, SUBMITTED, TRANSFERRED
from handoff_server.domain.entries import StartRequest
from handoff_server.domain.model import Order
from handoff_server.domain.registry import Registry
from handoff_server.ops.config import Settings
from handoff_server.ops.metrics import Metrics

SOURCE, DESTINATION = "prefill-0", "decode-0"
# A source-first success path, as the engines report it: (action id, outcome) or a fact.
STEPS = (
    (0, SUBMITTED),
    HELD,
    (1, ACCEPTED),
    RESERVED,
    (2, SCHEDULED),
    TRANSFERRED,
    (3, APPLIED),
    (4, APPLIED),
)


def filled(retained: int) -> Registry:
    """A registry that completed ``retained`` handoffs and keeps them all."""
    now = [0.0]
    registry = Registry(
        Settings(retention_s=86_400.0, max_retained=retained), Metrics(), lambda: now[0]
    )
    subscriptions = [registry.subscribe(engine, lambda: None) for engine in (SOURCE, DESTINATION)]
    for number in range(retained):
        handoff_id = f"handoff-{number:09d}"
        registry.start(StartRequest(handoff_id, Order.SOURCE_FIRST, SOURCE, DESTINATION, 1.0))
        for step in STEPS:
            if isinstance(step, tuple):
                registry.report_outcome(handoff_id, *step)
            else:
                registry.report_fact(handoff_id, step)
        for subscription in subscriptions:
            registry.take(subscription, 64)  # as the streams write them
        now[0] += 0.001
    return registry


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--retained", type=int, default=100_000, help="completed handoffs kept")
    parser.add_argument("--rounds", type=int, default=5, help="full collections timed")
    parser.add_argument(
        "--freeze",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="freeze what is loaded first, as `handoff serve` does",
    )
    args = parser.parse_args()
    import handoff_server.service.app  # noqa: F401  (what a server loads, to freeze or not)

    if args.freeze:
        gc.freeze()  # as `handoff serve` does once it has loaded
    registry = filled(args.retained)
    assert registry.retention.count == args.retained
    gc.collect()  # the first one also stops tracking what needs no tracking
    times = []
    for _ in range(args.rounds):
        began = time.perf_counter()
        gc.collect()
        times.append(time.perf_counter() - began)
    times.sort()
    frozen = "frozen" if args.freeze else "not frozen"
    print(
        f"{args.retained:,} retained handoffs, {frozen}: "
        f"{len(gc.get_objects()):,} objects tracked; "
        f"a full collection {times[len(times) // 2] * 1000:.1f} ms (median of "
        f"{args.rounds}; {times[0] * 1000:.1f} to {times[-1] * 1000:.1f})"
    )


if __name__ == "__main__":
    main()
