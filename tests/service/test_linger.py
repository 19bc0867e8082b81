"""The stream writer's linger: none while the loop keeps up; once it is behind,
at most one write per interval."""

from __future__ import annotations

import asyncio
import time

from handoff_server.service.linger import Linger, Wake


def finishes_at_once(linger: Linger) -> bool:
    """``linger.wait()`` returns without ever suspending (no sleep, no turn of the loop)."""
    waiting = linger.wait()
    try:
        waiting.send(None)
    except StopIteration:
        return True
    waiting.close()
    return False


def woken(linger: Linger, held_s: float) -> None:
    """The stream's writer wakes ``held_s`` after its work arrived (the loop held meanwhile)."""
    wake = Wake()
    wake.set()
    time.sleep(held_s)
    linger.woke(wake)


async def test_a_loop_that_keeps_up_never_lingers() -> None:
    # Nothing here awaits: no timeout is needed (finishes_at_once never suspends).
    linger = Linger(3600)
    assert finishes_at_once(linger)  # never written yet
    linger.wrote()
    assert finishes_at_once(linger)  # just wrote, but never behind
    woken(linger, 0)  # woke at once: half an hour is far off
    assert finishes_at_once(linger)


async def test_once_the_loop_is_behind_a_stream_that_just_wrote_waits_out_the_interval() -> None:
    async with asyncio.timeout(10):
        linger = Linger(0.05)
        woken(linger, 0.03)  # later than half the interval
        linger.wrote()
        wrote_at = time.monotonic()
        assert not finishes_at_once(linger)
        await linger.wait()
        # asyncio's timers never fire early (beyond the clock's resolution).
        assert time.monotonic() - wrote_at >= 0.05 - 1e-3
        assert finishes_at_once(linger)  # the interval has passed since the write
        woken(linger, 0)  # the loop caught up
        linger.wrote()
        assert finishes_at_once(linger)


async def test_no_linger_when_its_interval_is_zero() -> None:
    linger = Linger(0)
    woken(linger, 0.01)
    linger.wrote()
    assert finishes_at_once(linger)
