"""What a simulation runs: engines, load and faults, each a frozen value with sane defaults."""

from __future__ import annotations

from dataclasses import dataclass, field

from handoff_client.model import EngineType
from handoff_client.transport import TRANSPORT_KINDS, TransportKind


@dataclass(frozen=True, slots=True)
class EngineProfile:
    """One simulated engine. Durations are real time at ``SimConfig.time_scale`` 1."""

    block_size: int = 16  # tokens per KV block
    prefill_blocks: int = 4096  # KV pool of each prefill engine
    decode_blocks: int = 8192  # KV pool of each decode engine (prompt + output)
    step_ms: float = 1.0  # what any action costs the engine before it answers
    prefill_ms_per_1k_tokens: float = 60.0
    decode_ms_per_token: float = 4.0
    kv_bytes_per_token: int = 131_072  # an 8B-class model in fp16
    bandwidth_gb_s: float = 25.0


@dataclass(frozen=True, slots=True)
class LoadProfile:
    """The frontend: how many handoffs, how fast, how large, how many canceled."""

    rate: float = 60.0  # handoffs started per second (0: as fast as concurrency allows)
    concurrency: int = 64  # handoffs in flight at most
    duration_s: float = 20.0  # stop starting handoffs after this long (0: no limit)
    max_handoffs: int = 0  # stop after this many (0: no limit)
    prompt_median_tokens: int = 1024  # log-normal prompt lengths ...
    prompt_max_tokens: int = 8192  # ... clipped to this
    output_max_tokens: int = 256  # decode lengths, uniform from 16
    cancel_fraction: float = 0.05  # canceled by the client while in flight
    cancel_after_success_fraction: float = 0.05  # canceled during decode: reopens
    handoff_timeout_s: float = 30.0  # each handoff's own deadline
    stacks: tuple[EngineType, ...] = (EngineType.VLLM, EngineType.SGLANG, EngineType.TRTLLM)


@dataclass(frozen=True, slots=True)
class FaultProfile:
    """Faults to inject; all zero means a clean run."""

    action_failure_rate: float = 0.0  # non-cleanup actions answered FAILED
    stream_drop_every_s: float = 0.0  # mean time between connection drops, per engine
    blackout_s: float = 0.3  # how long a dropped connection stays down
    dead_engines: int = 0  # engines that die mid-run and never return
    dead_at_fraction: float = 0.3  # ... at this fraction of the run
    # The router keeps routing to a dead engine until its health checks
    # notice; handoffs sent there in that window fail by delivery timeout.
    dead_detection_s: float = 1.0
    slow_engines: int = 0  # engines that are this much slower:
    slow_factor: float = 4.0
    # Engines whose process restarts under the same id: its memory (and every
    # block it held) is gone, and its sidecar comes back with a new incarnation.
    restarted_engines: int = 0
    restart_at_fraction: float = 0.5
    # Prefill or reserve handlers of one engine that hang, holding their
    # blocks, until the run is over; the cleanup of every other handoff
    # must still flow.
    stuck_handlers: int = 0
    stuck_at_fraction: float = 0.2
    # The coordinator process killed with SIGKILL and restarted on its state
    # dir (only where the simulator runs the coordinator: `handoff demo`).
    # The first crash comes at this fraction of the run, any others spread
    # evenly over the rest.
    coordinator_crashes: int = 0
    coordinator_crash_at_fraction: float = 0.6

    @classmethod
    def demo(cls) -> FaultProfile:
        """Every fault, at rates a one-minute run shows and survives."""
        return cls(
            action_failure_rate=0.02,
            stream_drop_every_s=6.0,
            dead_engines=1,
            slow_engines=1,
            restarted_engines=1,
            stuck_handlers=3,
            coordinator_crashes=1,
        )


@dataclass(frozen=True, slots=True)
class SimConfig:
    prefill_engines: int = 2  # per stack
    decode_engines: int = 2  # per stack
    engine: EngineProfile = field(default_factory=EngineProfile)
    load: LoadProfile = field(default_factory=LoadProfile)
    faults: FaultProfile = field(default_factory=FaultProfile)
    time_scale: float = 1.0  # multiplies every simulated duration
    settle_timeout_s: float = 45.0  # after the load: how long handoffs may take to finish
    seed: int | None = None
    transport: TransportKind = "connect"  # how each sidecar talks to the coordinator

    def __post_init__(self) -> None:
        load, faults = self.load, self.faults
        if self.prefill_engines < 1 or self.decode_engines < 1:
            raise ValueError("every stack needs at least one prefill and one decode engine")
        if load.duration_s <= 0 and load.max_handoffs <= 0:
            raise ValueError("give a duration or a number of handoffs, or the run never ends")
        if load.concurrency < 1 or load.rate < 0:
            raise ValueError("concurrency must be >= 1 and rate >= 0")
        if not load.stacks:
            raise ValueError("at least one stack")
        for name in ("cancel_fraction", "cancel_after_success_fraction"):
            if not 0 <= getattr(load, name) <= 1:
                raise ValueError(f"{name} must be within [0, 1]")
        if not 0 <= faults.action_failure_rate <= 1:
            raise ValueError("action_failure_rate must be within [0, 1]")
        timed = (
            faults.dead_engines
            or faults.restarted_engines
            or faults.stuck_handlers
            or faults.coordinator_crashes
        )
        if timed and load.duration_s <= 0 and load.rate <= 0:
            raise ValueError(
                "engines die, restart or hang, and coordinators crash, at a point in time: "
                "give a duration or a rate"
            )
        if faults.restarted_engines < 0 or faults.stuck_handlers < 0:
            raise ValueError("restarted_engines and stuck_handlers must be >= 0")
        if faults.coordinator_crashes < 0:
            raise ValueError("coordinator_crashes must be >= 0")
        if not 0 <= faults.coordinator_crash_at_fraction < 1:
            raise ValueError("coordinator_crash_at_fraction must be within [0, 1)")
        faulty = faults.dead_engines + faults.slow_engines + faults.restarted_engines
        if faulty + (1 if faults.stuck_handlers else 0) > self.engine_count:
            raise ValueError("more dead, slow, restarted and stuck engines than engines")
        if self.time_scale <= 0:
            raise ValueError("time_scale must be > 0")
        if self.transport not in TRANSPORT_KINDS:
            raise ValueError(f"transport must be one of {', '.join(TRANSPORT_KINDS)}")
        # A handoff waiting for a fact its dead engine never sends ends at its
        # deadline: the run must wait at least that long for it.
        if self.settle_timeout_s <= load.handoff_timeout_s:
            raise ValueError("settle_timeout_s must exceed the handoff timeout")

    @property
    def engine_count(self) -> int:
        return len(self.load.stacks) * (self.prefill_engines + self.decode_engines)
