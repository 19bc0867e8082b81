"""What the scheduler-side connector tells its worker each step.

vLLM runs the scheduler and the worker in separate processes; the only way
from one to the other is the connector metadata the scheduler builds each
step (and back, the worker's finished sets). These orders ride on it as one
extra attribute of NIXL's metadata, so NIXL's own fields are untouched.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class WorkerOrders:
    # Prefill (source) side, by vLLM request id: NIXL's expiry of the held
    # blocks is suppressed (the coordinator is in charge), set to now (free
    # them this step), or set to now + NIXL's lease (handed back to NIXL).
    hold: set[str] = field(default_factory=set)
    free: set[str] = field(default_factory=set)
    hand_back: set[str] = field(default_factory=set)
    # Decode (destination) side: report these receives finished this step,
    # as failed loads (the handoff ended) or as loaded (ActivateDestination).
    fail_recv: set[str] = field(default_factory=set)
    release_recv: set[str] = field(default_factory=set)

    def __bool__(self) -> bool:
        return bool(self.hold or self.free or self.hand_back or self.fail_recv or self.release_recv)


ATTRIBUTE = "handoff_orders"
