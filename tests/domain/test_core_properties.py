"""Property-based tests: random interleavings of calls against the core's invariants."""

from __future__ import annotations

from hypothesis import HealthCheck, settings

from tests.support.core import HandoffMachine

HandoffMachine.TestCase.settings = settings(
    max_examples=400,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestHandoffMachine = HandoffMachine.TestCase
