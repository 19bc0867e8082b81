"""Backoff with jitter, shared by call retries, report retries and reconnects."""

from __future__ import annotations

import random
from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class Backoff:
    """Exponential backoff with full jitter.

    Full jitter (a uniform draw below the exponential cap) spreads out the
    retries of many sidecars that lost the same server at the same moment,
    instead of having them reconnect in lockstep.
    """

    initial_s: float = 0.05
    max_s: float = 2.0
    multiplier: float = 2.0

    def __post_init__(self) -> None:
        if not (0 < self.initial_s <= self.max_s and self.multiplier >= 1):
            raise ValueError("backoff needs 0 < initial_s <= max_s and multiplier >= 1")

    def delay_s(self, failures: int, rng: random.Random) -> float:
        """How long to wait after ``failures`` consecutive failures (from 1)."""
        cap = min(self.max_s, self.initial_s * self.multiplier ** max(failures - 1, 0))
        return rng.uniform(0.0, cap)


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    """How a call that is safe to repeat is retried on UNAVAILABLE.

    The defaults ride through a coordinator restart: Kubernetes restarts a
    crashed container in seconds, and a recovered coordinator answers every
    call for the handoffs it had. So a call is retried until ``within_s``
    after its first attempt (and ``max_attempts`` in all), never past the
    call's deadline (``timeout_s``), which caps ``within_s``: each attempt
    gets what is left of it. To ride through a longer outage, give the call
    a longer ``timeout_s``.

    ``attempt_timeout_s``, for a call retried on DEADLINE_EXCEEDED too
    (StartHandoff): each attempt gets at most this much of the deadline, so
    an attempt whose answer was lost is asked again while time is left.
    None: an attempt gets all that is left.
    """

    max_attempts: int = 64
    backoff: Backoff = field(default_factory=Backoff)
    within_s: float = 15.0
    attempt_timeout_s: float | None = None

    def __post_init__(self) -> None:
        if self.max_attempts < 1:
            raise ValueError("max_attempts must be >= 1")
        if not self.within_s >= 0:
            raise ValueError("within_s must be >= 0")
        if self.attempt_timeout_s is not None and not self.attempt_timeout_s > 0:
            raise ValueError("attempt_timeout_s must be > 0 (or None)")
