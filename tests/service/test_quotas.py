"""Per-identity accounting on a fake clock: calls, engine streams, active handoffs, start rate."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from handoff_server.service.quotas import Quotas
from tests.support.fakes import FakeClock


def quotas(clock: FakeClock, *, calls: int = 3, active: int = 2, rate: float = 4.0) -> Quotas:
    return Quotas(calls=calls, active=active, starts_per_s=rate, clock=clock)


def test_calls_are_capped_per_identity_and_released() -> None:
    q = quotas(FakeClock(1000.0))
    assert [q.enter_call("a") for _ in range(3)] == [None, None, None]
    assert q.enter_call("a") == (
        "a has 3 calls in flight, the limit per identity (max_calls_per_identity)"
    )
    assert q.enter_call("b") is None  # another identity has its own room
    q.leave_call("a")
    assert q.enter_call("a") is None


def test_an_engine_s_overlapping_streams_count_once() -> None:
    q = quotas(FakeClock(1000.0), calls=2)
    assert q.enter_stream("a", "e1") is None
    assert q.enter_call("a") is None
    assert q.enter_stream("a", "e1") is None  # the replacement, while the old one ends
    assert q.enter_stream("a", "e2") is not None  # a new engine is one call too many
    q.leave_stream("a", "e1")
    usage = q.usage("a")
    assert usage is not None
    assert usage.held() == 2
    q.leave_stream("a", "e1")
    q.leave_call("a")
    assert q.usage("a") is None  # nothing held: nothing kept


def test_starts_are_rate_limited_with_a_burst_of_one_second() -> None:
    clock = FakeClock(1000.0)
    q = quotas(clock, active=100, rate=4.0)
    assert [q.admit_start("a") for _ in range(4)] == [None] * 4
    assert q.admit_start("a") == (
        "a starts more than 4 handoffs per second, the limit per identity "
        "(max_starts_per_s_per_identity)"
    )
    assert q.admit_start("b") is None
    clock.now += 0.5
    assert [q.admit_start("a") for _ in range(3)] == [
        None,
        None,
        "a starts more than 4 handoffs "
        "per second, the limit per identity (max_starts_per_s_per_identity)",
    ]


def test_active_handoffs_per_identity_until_they_finish() -> None:
    q = quotas(FakeClock(1000.0), active=2, rate=100.0)
    for handoff_id in ("h1", "h2"):
        assert q.admit_start("a") is None
        q.started("a", handoff_id)
    q.started("a", "h2")  # a retried start of one it holds: not counted again
    assert q.admit_start("a") == (
        "a has 2 active handoffs, the limit per identity (max_active_handoffs_per_identity)"
    )
    q.finished("h1")
    q.finished("unknown")  # started by nobody counted here (an anonymous caller)
    assert q.admit_start("a") is None


@given(
    st.lists(
        st.tuples(
            st.sampled_from(["call", "leave", "stream", "unstream"]),
            st.sampled_from(["a", "b"]),
            st.sampled_from(["e1", "e2", "e3"]),
        )
    )
)
def test_what_is_held_never_exceeds_the_limit_and_all_of_it_is_returned(
    steps: list[tuple[str, str, str]],
) -> None:
    q = quotas(FakeClock(1000.0), calls=2)
    calls: dict[str, int] = {"a": 0, "b": 0}
    streams: dict[tuple[str, str], int] = {}
    for op, identity, engine in steps:
        if op == "call" and q.enter_call(identity) is None:
            calls[identity] += 1
        elif op == "leave" and calls[identity]:
            q.leave_call(identity)
            calls[identity] -= 1
        elif op == "stream" and q.enter_stream(identity, engine) is None:
            streams[identity, engine] = streams.get((identity, engine), 0) + 1
        elif op == "unstream" and streams.get((identity, engine)):
            q.leave_stream(identity, engine)
            streams[identity, engine] -= 1
        for who in ("a", "b"):
            usage = q.usage(who)
            held = usage.held() if usage else 0
            assert held <= 2
            engines = {e for (i, e), n in streams.items() if i == who and n}
            assert held == calls[who] + len(engines)
    for (identity, engine), count in streams.items():
        for _ in range(count):
            q.leave_stream(identity, engine)
    for identity, count in calls.items():
        for _ in range(count):
            q.leave_call(identity)
    assert q.usage("a") is None
    assert q.usage("b") is None


def test_calls_of_every_rpc_are_rate_limited_per_identity() -> None:
    clock = FakeClock(1000.0)
    q = Quotas(calls=100, active=2, starts_per_s=4.0, calls_per_s=3.0, clock=clock)
    assert [q.arrive("a", "GetShardMap") for _ in range(3)] == [0.0] * 3
    assert q.arrive("a", "Reconcile") == (
        "a makes more than 3 calls per second (Reconcile refused), the limit per identity "
        "(max_calls_per_s_per_identity)"
    )
    assert q.arrive("b", "Reconcile") == 0.0  # another identity has its own allowance
    clock.now += 1 / 3
    assert q.arrive("a", "Reconcile") == 0.0


def test_a_call_past_its_rate_waits_its_turn_within_rate_wait_s() -> None:
    clock = FakeClock(1000.0)
    q = Quotas(calls=100, active=2, starts_per_s=4.0, calls_per_s=4.0, rate_wait_s=0.5, clock=clock)
    assert [q.arrive("a", "GetShardMap", 10.0) for _ in range(4)] == [0.0] * 4  # the burst
    # Past it, each call's turn comes a quarter second after the one before...
    assert [q.arrive("a", "GetShardMap", 10.0) for _ in range(2)] == [0.25, 0.5]
    # ...until the next would wait longer than rate_wait_s: refused, nothing taken.
    assert q.arrive("a", "GetShardMap", 10.0) == (
        "a makes more than 4 calls per second (GetShardMap refused), the limit per identity "
        "(max_calls_per_s_per_identity); its turn was more than 0.5 s away (rate_wait_s)"
    )
    # A call with less time left than its wait is refused rather than left to time out.
    clock.now += 0.25
    refusal = q.arrive("a", "Reconcile", 0.1)
    assert isinstance(refusal, str), refusal
    assert "its turn was more than 0.1 s away (rate_wait_s)" in refusal, refusal
    assert q.arrive("a", "Reconcile", 10.0) == 0.5
    assert q.arrive("b", "Reconcile", 10.0) == 0.0  # another identity waits for nobody
    # Waiting calls count as arriving ones: at most max_calls_per_identity of them.
    full = Quotas(
        calls=2, active=2, starts_per_s=4.0, calls_per_s=1.0, rate_wait_s=5.0, clock=clock
    )
    assert [full.arrive("a", "GetShardMap", 10.0) for _ in range(2)] == [0.0, 1.0]
    assert full.arrive("a", "GetShardMap", 10.0) == (
        "a has 2 calls waiting for their first message or their turn, the limit per "
        "identity (max_calls_per_identity)"
    )


def test_connect_reports_past_their_rate_are_delayed_not_refused() -> None:
    clock = FakeClock(1000.0)
    q = Quotas(calls=100, active=2, starts_per_s=4.0, reports_per_s=100.0, clock=clock)
    assert q.report_delay_s("a", 100) == 0.0  # a second's burst
    assert q.report_delay_s("a", 50) == 0.5  # in debt: half a second until paid
    assert q.report_delay_s("b", 50) == 0.0
    clock.now += 0.5
    assert q.report_delay_s("a", 10) == 0.1
