"""Accounting of what callers hold and how fast they ask: calls in flight by
kind, and per caller identity (calls, engines, active handoffs, and the rates
of calls, starts and Connect reports).

Calls past a limit of what is held are refused rather than queued: the
caller hears so at once (RESOURCE_EXHAUSTED naming the setting) and may
retry, while the calls already admitted carry on. Rates are the exception:
a call past its identity's rate of calls waits its turn (at most
``rate_wait_s``, :meth:`Quotas.arrive`), and Connect reports past theirs hold
their stream back (:meth:`Quotas.report_delay_s`), so that a caller asking
faster than its rate is slowed to it instead of costing a refusal per try,
and its calls wait in the server's memory, not in the transport's queue
ahead of other callers'. Nothing here awaits or reads a clock of its own.
"""

from __future__ import annotations

from collections.abc import Callable


class Slot:
    """One call's place in a :class:`Budget`, from its arrival to its end."""

    __slots__ = ("budget", "waiting", "evicted", "released", "on_evict")

    def __init__(self, budget: Budget) -> None:
        self.budget = budget
        self.waiting = True  # its first message has not arrived yet
        self.evicted = False  # ended to make room for a newer arrival
        self.released = False
        self.on_evict: Callable[[], None] = lambda: None

    def arrived(self) -> None:
        """Its first message came: from now on it holds a slot of the reserved half."""
        if self.waiting:
            self.waiting = False
            self.budget.waiting.pop(self, None)

    def leave(self) -> None:
        self.budget.leave(self)


class Budget:
    """Calls of one kind in flight, counted from their arrival, at most ``limit``.

    A call is counted before its first message arrives (a caller that sends
    headers and nothing else must not go uncounted), but such waiting calls
    hold half the slots at most: past that, a new arrival ends the oldest
    waiting call instead of being refused, so that a crowd of header-only
    calls can neither refuse a real caller nor take the slots of calls whose
    message has arrived.
    """

    def __init__(self, what: str, limit: int, setting: str) -> None:
        self.what = what
        self.limit = limit
        self.setting = setting
        self.in_flight = 0
        self.waiting_limit = max(limit // 2, 1)
        self.waiting: dict[Slot, None] = {}  # oldest first
        self.evicted = 0  # waiting calls ended for a newer arrival, in all

    def enter(self) -> Slot | None:
        """A slot for a call that just arrived; None when every slot is taken."""
        if len(self.waiting) >= self.waiting_limit:
            oldest = next(iter(self.waiting))
            self.leave(oldest)
            oldest.evicted = True
            self.evicted += 1
            oldest.on_evict()
        if self.in_flight >= self.limit:
            return None
        self.in_flight += 1
        slot = Slot(self)
        self.waiting[slot] = None
        return slot

    def leave(self, slot: Slot) -> None:
        if slot.released:
            return  # released already, when it was evicted
        slot.released = True
        self.waiting.pop(slot, None)
        self.in_flight -= 1

    def refusal(self) -> str:
        return f"{self.limit} {self.what} already in flight, the limit ({self.setting})"

    def eviction(self) -> str:
        return (
            f"{self.waiting_limit} {self.what} were waiting for their first message, half "
            f"the limit ({self.setting}): the oldest is ended to admit a new one"
        )


class Rate:
    """How often one identity may do something: ``per_s`` a second, in bursts
    of one second's worth; ``setting`` is what raises it."""

    __slots__ = ("per_s", "burst", "setting")

    def __init__(self, per_s: float, setting: str) -> None:
        self.per_s = per_s
        self.burst = max(per_s, 1.0)
        self.setting = setting


class Allowance:
    """One identity's token bucket for one :class:`Rate`: what it may do now."""

    __slots__ = ("left", "at")

    def __init__(self, rate: Rate, now: float) -> None:
        self.left = rate.burst
        self.at = now

    def refill(self, rate: Rate, now: float) -> float:
        self.left = min(rate.burst, self.left + (now - self.at) * rate.per_s)
        self.at = now
        return self.left

    def take(self, rate: Rate, now: float) -> bool:
        """One more, if the identity has it left (no debt)."""
        return self.reserve(rate, now, 0.0) is not None

    def reserve(self, rate: Rate, now: float, most_s: float) -> float | None:
        """Take one, into debt if it is paid within ``most_s``: the seconds until
        it is (0: at once); None, and nothing taken, past that."""
        left = self.refill(rate, now) - 1.0
        if left < 0.0 and -left / rate.per_s > most_s:
            return None
        self.left = left
        return max(0.0, -left / rate.per_s)

    def owe(self, rate: Rate, now: float, count: int) -> float:
        """Take ``count`` at once, into debt if need be; the seconds until the
        debt is paid (0: none)."""
        self.left = self.refill(rate, now) - count
        return max(0.0, -self.left / rate.per_s)


class Usage:
    """What one identity holds now, and what it may still ask for."""

    __slots__ = ("arriving", "calls", "streams", "active", "starts", "rpcs", "reports")

    def __init__(self, rates: Rates, now: float) -> None:
        self.arriving = 0  # calls whose first message has not arrived yet
        self.calls = 0  # unary (and other non-engine) calls in flight
        self.streams: dict[str, int] = {}  # engine id -> its live streams (a replacement overlaps)
        self.active = 0  # handoffs it started that are not complete
        self.starts = Allowance(rates.starts, now)  # StartHandoff calls
        self.rpcs = Allowance(rates.calls, now)  # calls of any RPC, counted as they arrive
        self.reports = Allowance(rates.reports, now)  # reports carried by Connect messages

    def idle(self, rates: Rates, now: float) -> bool:
        """Nothing held and every allowance full: forgetting it changes nothing."""
        return (
            not self.arriving
            and not self.calls
            and not self.streams
            and not self.active
            and self.starts.refill(rates.starts, now) >= rates.starts.burst
            and self.rpcs.refill(rates.calls, now) >= rates.calls.burst
            and self.reports.refill(rates.reports, now) >= rates.reports.burst
        )

    def held(self) -> int:
        """Calls counted against the limit: one per engine, however many of its
        streams overlap while a new one replaces the old."""
        return self.calls + len(self.streams)


class Rates:
    """The rates every identity is held to (each identity has its own allowance)."""

    __slots__ = ("starts", "calls", "reports")

    def __init__(self, *, starts_per_s: float, calls_per_s: float, reports_per_s: float) -> None:
        self.starts = Rate(starts_per_s, "max_starts_per_s_per_identity")
        self.calls = Rate(calls_per_s, "max_calls_per_s_per_identity")
        self.reports = Rate(reports_per_s, "max_reports_per_s_per_identity")


class Quotas:
    """Per caller identity (a token's name, a client certificate's SAN): calls in
    flight, active handoffs, and the rates of calls, starts and Connect
    reports, each with its own limit, so that one caller at its limits leaves
    everyone else's room intact.

    Callers with no identity (no token, no client certificate) are not counted
    here: the server-wide limits are theirs.
    """

    def __init__(
        self,
        *,
        calls: int,
        active: int,
        engines: int = 1_000_000,
        starts_per_s: float,
        calls_per_s: float = 1_000_000.0,
        reports_per_s: float = 1_000_000.0,
        rate_wait_s: float = 0.0,
        clock: Callable[[], float],
    ) -> None:
        self.calls = calls
        self.rate_wait_s = rate_wait_s
        self.engines = engines
        self.active = active
        self.rates = Rates(
            starts_per_s=starts_per_s, calls_per_s=calls_per_s, reports_per_s=reports_per_s
        )
        self.clock = clock
        self._usage: dict[str, Usage] = {}
        self._owners: dict[str, str] = {}  # active handoff id -> identity that started it

    def _of(self, identity: str) -> Usage:
        usage = self._usage.get(identity)
        if usage is None:
            usage = self._usage[identity] = Usage(self.rates, self.clock())
        return usage

    def _tidy(self, identity: str, usage: Usage) -> None:
        if usage.idle(self.rates, self.clock()):
            del self._usage[identity]

    def usage(self, identity: str) -> Usage | None:
        return self._usage.get(identity)

    # --- calls -------------------------------------------------------------

    def arrive(self, identity: str, rpc: str, within_s: float = 0.0) -> float | str:
        """Count a call of ``rpc`` that arrived and has not sent its first
        message yet, at most ``calls`` such calls per identity apart from those
        it holds with a message (so that a stream replacing its engine's is
        still admitted). Within the identity's rate of calls: the seconds it
        waits for its turn first (0: none), at most the lesser of ``within_s``
        (the call's time left) and ``rate_wait_s``; the refusal's reason past
        that, or when the identity has its limit of such calls."""
        usage = self._of(identity)
        if usage.arriving >= self.calls:
            self._tidy(identity, usage)
            return (
                f"{identity} has {usage.arriving} calls waiting for their first message or "
                "their turn, the limit per identity (max_calls_per_identity)"
            )
        rate, most_s = self.rates.calls, min(within_s, self.rate_wait_s)
        wait_s = usage.rpcs.reserve(rate, self.clock(), most_s)
        if wait_s is None:
            self._tidy(identity, usage)
            turn = f"; its turn was more than {most_s:.3g} s away (rate_wait_s)" if most_s else ""
            return (
                f"{identity} makes more than {rate.per_s:g} calls per second ({rpc} refused), "
                f"the limit per identity ({rate.setting}){turn}"
            )
        usage.arriving += 1
        return wait_s

    def arrived(self, identity: str) -> None:
        """The call's first message came (or it ended without one)."""
        usage = self._usage[identity]
        usage.arriving -= 1
        self._tidy(identity, usage)

    def enter_call(self, identity: str) -> str | None:
        """Count a call; the refusal's reason when the identity is at its limit."""
        usage = self._of(identity)
        if usage.held() >= self.calls:
            return self._full(identity, usage)
        usage.calls += 1
        return None

    def leave_call(self, identity: str) -> None:
        usage = self._usage[identity]
        usage.calls -= 1
        self._tidy(identity, usage)

    def enter_stream(self, identity: str, engine_id: str) -> str | None:
        """Count an engine's stream: a new stream of an engine already counted
        (it replaces the old one) is always admitted and not counted again."""
        usage = self._of(identity)
        live = usage.streams.get(engine_id, 0)
        if not live and usage.held() >= self.calls:
            return self._full(identity, usage)
        if not live and len(usage.streams) >= self.engines:
            # Well below max_engines: one identity cannot take every engine's place.
            self._tidy(identity, usage)
            return (
                f"engine {engine_id}: {identity} has {len(usage.streams)} engines with a live "
                "stream, the limit per identity (max_engines_per_identity)"
            )
        usage.streams[engine_id] = live + 1
        return None

    def leave_stream(self, identity: str, engine_id: str) -> None:
        usage = self._usage[identity]
        live = usage.streams.pop(engine_id) - 1
        if live:
            usage.streams[engine_id] = live
        self._tidy(identity, usage)

    def _full(self, identity: str, usage: Usage) -> str:
        self._tidy(identity, usage)
        return (
            f"{identity} has {usage.held()} calls in flight, the limit per identity "
            "(max_calls_per_identity)"
        )

    # --- handoffs ----------------------------------------------------------

    def admit_start(self, identity: str) -> str | None:
        """Take one StartHandoff from the identity's allowance; the refusal's reason if none is left
        or it already has its limit of active handoffs."""
        usage = self._of(identity)
        if usage.active >= self.active:
            return (
                f"{identity} has {usage.active} active handoffs, the limit per identity "
                "(max_active_handoffs_per_identity)"
            )
        rate = self.rates.starts
        if not usage.starts.take(rate, self.clock()):
            return (
                f"{identity} starts more than {rate.per_s:g} handoffs per second, "
                f"the limit per identity ({rate.setting})"
            )
        return None

    def report_delay_s(self, identity: str, reports: int) -> float:
        """Count ``reports`` carried by one Connect message; how long the stream
        should wait before handling them so that the identity stays within its
        rate of reports (0: at once). Not a refusal: the stream is only read
        more slowly, as when its acknowledgements are not read."""
        usage = self._of(identity)
        return usage.reports.owe(self.rates.reports, self.clock(), reports)

    def started(self, identity: str, handoff_id: str) -> None:
        """The identity's StartHandoff created ``handoff_id`` (a retry of one it
        already holds changes nothing)."""
        if handoff_id in self._owners:
            return
        self._owners[handoff_id] = identity
        self._of(identity).active += 1

    def finished(self, handoff_id: str) -> None:
        """``handoff_id`` left the active set (complete or abandoned): the registry's callback."""
        identity = self._owners.pop(handoff_id, None)
        if identity is not None:
            usage = self._usage[identity]
            usage.active -= 1
            self._tidy(identity, usage)
