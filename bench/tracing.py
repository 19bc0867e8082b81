"""Server CPU per handoff with tracing off, on (every handoff sampled), and before it existed.

Each measurement is a fresh process running full success paths (both orders
alternating) through the registry and the answers the servicer builds
(convert.handoff, convert.action): the part of the server the tracing hooks
live in, without gRPC's own cost, which tracing does not touch. So the
overhead shown is the share of that part, an upper bound of the whole
server's. Modes run interleaved, round after round; the table gives the
median CPU time (time.process_time: all threads, so the span processor's
too) per handoff.

"before" runs the same driver on the source of another commit (default: the
one before tracing) unpacked with `git archive` into a temporary directory.
"on" ends spans into a batch processor whose exporter drops them: span
creation and processing are counted, OTLP encoding and sending are not.

Run: .venv/bin/python -m bench.tracing [--rounds 7] [--handoffs 5000] [--before REV]
"""

from __future__ import annotations

import argparse
import io
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
import uuid
from collections.abc import Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MODES = ("before", "off", "on")


def run_handoffs(count: int, mode: str) -> float:
    """CPU seconds for ``count`` success paths through a registry in ``mode``."""
    from handoff_server.domain.delivery import Dispatch
    from handoff_server.domain.entries import StartRequest
    from handoff_server.domain.model import (
        ActionKind,
        DestinationReserved,
        Fact,
        Order,
        Outcome,
        OutcomeKind,
        SourceHeld,
        TimingMode,
        TransferCompleted,
        TransferTiming,
    )
    from handoff_server.domain.registry import CallResult, Registry
    from handoff_server.ops.config import Settings
    from handoff_server.ops.metrics import Metrics
    from handoff_server.service import convert

    expected = {
        ActionKind.SUBMIT_PREFILL: Outcome(OutcomeKind.SUBMITTED),
        ActionKind.RESERVE_DESTINATION: Outcome(OutcomeKind.ACCEPTED),
        ActionKind.START_TRANSFER: Outcome(OutcomeKind.SCHEDULED),
        ActionKind.ACTIVATE_DESTINATION: Outcome(OutcomeKind.APPLIED),
        ActionKind.RELEASE_SOURCE: Outcome(OutcomeKind.APPLIED),
    }
    held = SourceHeld(TransferTiming(TimingMode.FULL_PROMPT, 2048, 131072, 50.0))
    facts: dict[Order, tuple[Fact, ...]] = {
        Order.SOURCE_FIRST: (held, DestinationReserved(2048), TransferCompleted()),
        Order.DESTINATION_FIRST: (DestinationReserved(2048), held, TransferCompleted()),
    }
    # No engine subscribes here: they must not count as unreachable however long it takes.
    settings = Settings(max_retained=count + 1, delivery_timeout_s=1e9)
    if mode == "on":
        from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
        from opentelemetry.sdk.trace.export import (
            BatchSpanProcessor,
            SpanExporter,
            SpanExportResult,
        )

        from handoff_server.ops.tracing import Tracing

        class Dropped(SpanExporter):
            def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
                return SpanExportResult.SUCCESS

        provider = TracerProvider()
        provider.add_span_processor(BatchSpanProcessor(Dropped()))
        registry = Registry(settings, Metrics(), time.time, tracer=Tracing(provider))
    else:
        registry = Registry(settings, Metrics(), time.time)

    def answer(result: CallResult) -> list[Dispatch]:
        convert.handoff(result.entry)
        for dispatch in result.actions:
            convert.action(dispatch)
        return [d for d in result.actions if d.action.kind is not ActionKind.COMPLETE]

    caller = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
    ids = [str(uuid.uuid4()) for _ in range(count)]
    started = time.process_time()
    for index, handoff_id in enumerate(ids):
        order = Order.SOURCE_FIRST if index % 2 else Order.DESTINATION_FIRST
        trace = (("traceparent", caller),) if mode == "on" else ()
        request = StartRequest(handoff_id, order, "prefill-0", "decode-0", 5.0, trace_context=trace)
        pending = answer(registry.start(request))
        for fact in facts[order]:
            while pending:
                dispatch = pending.pop()
                outcome = expected[dispatch.action.kind]
                result = registry.report_outcome(handoff_id, dispatch.action.id, outcome)
                pending += answer(result)
            pending += answer(registry.report_fact(handoff_id, fact))
        while pending:
            dispatch = pending.pop()
            outcome = expected[dispatch.action.kind]
            pending += answer(registry.report_outcome(handoff_id, dispatch.action.id, outcome))
    elapsed = time.process_time() - started
    if mode == "on":
        provider.shutdown()
    return elapsed


def measure(mode: str, count: int, before: Path) -> float:
    """CPU microseconds per handoff, from a fresh process."""
    env = dict(os.environ)
    if mode == "before":
        env["PYTHONPATH"] = os.pathsep.join(str(before / part) for part in ("client", "server"))
    run = subprocess.run(
        [sys.executable, __file__, "--child", mode, "--handoffs", str(count)],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    return float(run.stdout) / count * 1e6


def _before_tracing() -> str:
    """The commit before the one that added tracing.py (now handoff_server/ops/tracing.py)."""
    added = subprocess.run(
        [
            "git",
            "log",
            "--follow",
            "--diff-filter=A",
            "--format=%H",
            "--",
            "server/handoff_server/ops/tracing.py",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    return f"{added[-1]}^"


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--handoffs", type=int, default=5000, help="per measurement")
    parser.add_argument(
        "--before", help="the commit to compare with (default: the one before tracing.py)"
    )
    parser.add_argument("--child", choices=MODES, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(run_handoffs(args.handoffs, args.child))
        return
    before = args.before or _before_tracing()
    with tempfile.TemporaryDirectory() as tmp:
        archive = subprocess.run(
            ["git", "archive", before, "client", "server"],
            cwd=ROOT,
            capture_output=True,
            check=True,
        ).stdout
        with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
            tar.extractall(tmp, filter="data")
        samples: dict[str, list[float]] = {mode: [] for mode in MODES}
        for _ in range(args.rounds):
            for mode in MODES:
                samples[mode].append(measure(mode, args.handoffs, Path(tmp)))
    base = statistics.median(samples["before"])
    print(
        f"{args.rounds} rounds x {args.handoffs} handoffs, before = {before[:10]}, "
        f"load average {os.getloadavg()[0]:.1f}"
    )
    print("| build | CPU per handoff (median) | vs before | all runs (us) |")
    print("|---|---|---|---|")
    for mode in MODES:
        median = statistics.median(samples[mode])
        runs = " ".join(f"{s:.0f}" for s in samples[mode])
        print(f"| {mode} | {median:.0f} us | {median / base - 1:+.1%} | {runs} |")


if __name__ == "__main__":
    main()
