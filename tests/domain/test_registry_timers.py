"""The timer loop wakes for retention, and stale timers never pile up while it sleeps."""

from __future__ import annotations

import pytest

from handoff_server.domain.model import NotFound, Phase
from handoff_server.domain.registry import LOSS_CHUNK
from handoff_server.domain.timers import TimerHeap, TimerKind
from tests.support.registry import DESTINATION, SOURCE, Harness


def test_the_first_retained_handoff_wakes_the_timer_loop() -> None:
    h = Harness(default_timeout_s=3600.0, retention_s=5.0, delivery_timeout_s=7200.0)
    wakes: list[float] = []
    h.registry._on_earlier_timer = lambda: wakes.append(h.clock.now)
    h.subscribe(SOURCE)
    h.subscribe(DESTINATION)
    handoff_id = h.start()
    assert h.registry.next_wakeup() == h.clock.now + 3600.0
    wakes.clear()
    h.succeed(handoff_id)
    # The loop was asleep until the deadline an hour away; retention ends sooner.
    assert wakes == [h.clock.now]
    assert h.registry.next_wakeup() == h.clock.now + 5.0
    h.advance(5.0)
    with pytest.raises(NotFound):
        h.registry.get(handoff_id)


def test_stale_timers_are_compacted_without_any_timer_firing() -> None:
    h = Harness(default_timeout_s=86400.0, retention_s=86400.0, max_retained=100_000)
    h.subscribe(SOURCE)
    h.subscribe(DESTINATION)
    for _ in range(5000):
        h.succeed(h.start())  # two deadline timers each, stale once it completes
        h.drain(SOURCE)
        h.drain(DESTINATION)
    assert h.registry.active_count == 0
    # Nothing fired (fire_due never ran), yet the heap holds no more than its
    # slack: 5,000 retained handoffs keep no timers.
    assert len(h.registry._timers) <= 1024 + 2 * 2 + 1


def test_compaction_while_a_timer_fires_never_fires_another_twice() -> None:
    """It did: pop_due went on popping the list compaction had just replaced,
    so a timer fired from the old list and again from the new one."""
    heap = TimerHeap(lambda timer: not timer.key.startswith("stale"))
    heap.schedule(1.0, TimerKind.UNREACHABLE, "engine-a", 0)
    heap.schedule(1.0, TimerKind.UNREACHABLE, "engine-b", 0)
    for index in range(2000):
        heap.schedule(5.0, TimerKind.DEADLINE, f"stale-{index}", 0)
    fired = []
    while (timer := heap.pop_due(1.0)) is not None:
        fired.append(timer.key)
        heap.compact(live_hint=0)  # as a firing timer that schedules another does
    while (timer := heap.pop_due(10.0)) is not None:
        fired.append(timer.key)
    assert fired == ["engine-a", "engine-b"]


def test_a_lost_backlog_is_reported_a_chunk_per_turn_in_linear_time() -> None:
    """An engine lost with a backlog far above LOSS_CHUNK: each fire_due
    reports one chunk (the loop runs in between), next_wakeup says more is due
    at once, and all of them are lost in the end, with one summary line."""
    h = Harness(
        delivery_timeout_s=5.0, default_timeout_s=600.0, max_queued_actions_per_engine=100_000
    )
    h.subscribe(DESTINATION)
    backlog = 5 * LOSS_CHUNK + 3
    ids = [h.start() for _ in range(backlog)]
    h.clock.advance(5.0)
    h.registry.fire_due()
    lost = [i for i in ids if h.phase(i) is not Phase.ACTIVE]
    assert len(lost) == LOSS_CHUNK
    assert h.registry.next_wakeup() == h.clock.now
    turns = 1
    while h.registry.next_wakeup() == h.clock.now:
        h.registry.fire_due()
        turns += 1
    assert turns == 6
    assert all(h.phase(i) is not Phase.ACTIVE for i in ids)
    assert h.value("handoff_engines_lost_total", cause="unreachable") == 1
