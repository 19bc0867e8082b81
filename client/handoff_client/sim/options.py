"""Command-line flags shared by `handoff sim` and `handoff demo`, and the config they make."""

from __future__ import annotations

import argparse
import logging
import tempfile
from dataclasses import replace
from pathlib import Path

from handoff_client.sim.config import FaultProfile, SimConfig
from handoff_client.transport import TRANSPORT_KINDS


def add_arguments(
    parser: argparse.ArgumentParser, defaults: SimConfig, *, own_coordinator: bool = False
) -> None:
    """The flags; ``own_coordinator`` adds the faults only a command that runs it can inject."""
    load, faults = defaults.load, defaults.faults
    group = parser.add_argument_group("load")
    group.add_argument(
        "--duration", type=float, default=load.duration_s, help="seconds of load (0: no limit)"
    )
    group.add_argument(
        "--handoffs", type=int, default=load.max_handoffs, help="handoffs to start (0: no limit)"
    )
    group.add_argument(
        "--rate", type=float, default=load.rate, help="handoffs per second (0: closed loop)"
    )
    group.add_argument(
        "--concurrency", type=int, default=load.concurrency, help="handoffs in flight at most"
    )
    group.add_argument(
        "--prompt-median",
        type=int,
        default=load.prompt_median_tokens,
        help="median prompt tokens (log-normal)",
    )
    group.add_argument(
        "--cancel-fraction",
        type=float,
        default=load.cancel_fraction,
        help="fraction the client cancels mid-flight",
    )
    group.add_argument(
        "--cancel-after-success-fraction",
        type=float,
        default=load.cancel_after_success_fraction,
        help="fraction the client cancels during decode (reopens the handoff)",
    )
    group.add_argument(
        "--handoff-timeout",
        type=float,
        default=load.handoff_timeout_s,
        help="each handoff's deadline, in seconds",
    )
    group.add_argument(
        "--prefill-engines",
        type=int,
        default=defaults.prefill_engines,
        help="prefill engines per stack (vllm, sglang, trtllm)",
    )
    group.add_argument(
        "--decode-engines",
        type=int,
        default=defaults.decode_engines,
        help="decode engines per stack",
    )
    group.add_argument(
        "--time-scale",
        type=float,
        default=defaults.time_scale,
        help="multiplies every simulated duration (prefill, transfer, decode)",
    )
    group.add_argument(
        "--settle-timeout",
        type=float,
        default=defaults.settle_timeout_s,
        help="seconds handoffs may take to finish after the load",
    )
    group.add_argument("--seed", type=int, default=defaults.seed, help="random seed")
    group = parser.add_argument_group("faults")
    group.add_argument(
        "--fail-rate",
        type=float,
        default=faults.action_failure_rate,
        help="probability that an engine answers an action FAILED",
    )
    group.add_argument(
        "--drop-every",
        type=float,
        default=faults.stream_drop_every_s,
        help="mean seconds between connection drops, per engine (0: none)",
    )
    group.add_argument(
        "--dead-engines",
        type=int,
        default=faults.dead_engines,
        help="engines that die mid-run and never return",
    )
    group.add_argument(
        "--slow-engines", type=int, default=faults.slow_engines, help="engines that are slower"
    )
    group.add_argument(
        "--slow-factor",
        type=float,
        default=faults.slow_factor,
        help="how much slower the slow engines are",
    )
    group.add_argument(
        "--restarted-engines",
        type=int,
        default=faults.restarted_engines,
        help="engines whose process restarts mid-run under the same id (empty memory, "
        "new incarnation)",
    )
    group.add_argument(
        "--stuck-handlers",
        type=int,
        default=faults.stuck_handlers,
        help="prefill or reserve handlers of one engine that hang until the run is over",
    )
    if own_coordinator:
        group.add_argument(
            "--coordinator-crashes",
            type=int,
            default=faults.coordinator_crashes,
            help="times the coordinator process is killed with SIGKILL mid-run and restarted "
            "on the same port and state dir (0: never); the engines and the frontend ride "
            "through, and the restarted coordinator recovers the handoffs from its journal",
        )
    group.add_argument(
        "--no-faults", action="store_true", help="turn every fault off, whatever else is given"
    )
    parser.add_argument(
        "--transport",
        choices=TRANSPORT_KINDS,
        default=defaults.transport,
        help="how the sidecars talk to the coordinator: one Connect stream per engine, "
        "or StreamActions plus a unary call per report",
    )
    parser.add_argument(
        "--log-file",
        type=Path,
        default=None,
        help="where warnings go; without it, a new file in the temp directory, named at the end",
    )


def config_from(args: argparse.Namespace, defaults: SimConfig) -> SimConfig:
    """The config the flags describe; raises ValueError for impossible combinations."""
    load = replace(
        defaults.load,
        duration_s=args.duration,
        max_handoffs=args.handoffs,
        rate=args.rate,
        concurrency=args.concurrency,
        prompt_median_tokens=args.prompt_median,
        cancel_fraction=args.cancel_fraction,
        cancel_after_success_fraction=args.cancel_after_success_fraction,
        handoff_timeout_s=args.handoff_timeout,
    )
    faults = FaultProfile(
        action_failure_rate=args.fail_rate,
        stream_drop_every_s=args.drop_every,
        blackout_s=defaults.faults.blackout_s,
        dead_engines=args.dead_engines,
        dead_at_fraction=defaults.faults.dead_at_fraction,
        dead_detection_s=defaults.faults.dead_detection_s,
        slow_engines=args.slow_engines,
        slow_factor=args.slow_factor,
        restarted_engines=args.restarted_engines,
        restart_at_fraction=defaults.faults.restart_at_fraction,
        stuck_handlers=args.stuck_handlers,
        stuck_at_fraction=defaults.faults.stuck_at_fraction,
        # Only `handoff demo` has the flag: `handoff sim` does not run the coordinator.
        coordinator_crashes=getattr(args, "coordinator_crashes", 0),
        coordinator_crash_at_fraction=defaults.faults.coordinator_crash_at_fraction,
    )
    return replace(
        defaults,
        prefill_engines=args.prefill_engines,
        decode_engines=args.decode_engines,
        load=load,
        faults=FaultProfile() if args.no_faults else faults,
        time_scale=args.time_scale,
        settle_timeout_s=args.settle_timeout,
        seed=args.seed,
        transport=args.transport,
    )


def sidecars_on(config: SimConfig) -> str:
    """How the run's sidecars talk to the coordinator, for the first line of output."""
    if config.transport == "connect":
        return "sidecars on Connect"
    return "sidecars on StreamActions + unary reports"


class _ContextFormatter(logging.Formatter):
    """Appends the engine, handoff and action a record is about, when it says."""

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        context = " ".join(
            f"{key}={getattr(record, key)}"
            for key in ("engine_id", "handoff_id", "action_id")
            if hasattr(record, key)
        )
        return f"{line} [{context}]" if context else line


# Log files this process made up a name for: removed at the end if left empty.
_MADE: set[Path] = set()


def log_to_file(path: Path | None) -> Path:
    """Send warnings to a file, not the terminal: the progress line owns the terminal."""
    if path is None:
        with tempfile.NamedTemporaryFile(prefix="handoff-", suffix=".log", delete=False) as f:
            path = Path(f.name)
        _MADE.add(path)
    handler = logging.FileHandler(path)
    handler.setFormatter(_ContextFormatter("%(asctime)s %(levelname)s %(name)s %(message)s"))
    logging.basicConfig(handlers=[handler], level=logging.WARNING, force=True)
    return path


def logs_line(path: Path) -> str:
    """The run's last line: where its warnings are. A temporary log nothing was
    written to is removed (every run in the test suite left one behind)."""
    for handler in logging.getLogger().handlers:
        handler.flush()
    if path in _MADE and path.exists() and path.stat().st_size == 0:
        logging.basicConfig(handlers=[logging.NullHandler()], force=True)  # closes the file
        path.unlink()
        _MADE.discard(path)
        return "logs: none (nothing was logged)"
    return f"logs: {path}"
