"""Accounting of what callers hold: calls in flight, by kind.

A :class:`Budget` refuses rather than queues: a caller past a limit hears so
at once (RESOURCE_EXHAUSTED naming the setting) and may retry, while the
calls already admitted carry on.
"""

from __future__ import annotations


class Budget:
    """Calls of one kind in flight, at most ``limit``."""

    def __init__(self, what: str, limit: int, setting: str) -> None:
        self.what = what
        self.limit = limit
        self.setting = setting
        self.in_flight = 0

    def enter(self) -> bool:
        if self.in_flight >= self.limit:
            return False
        self.in_flight += 1
        return True

    def leave(self) -> None:
        self.in_flight -= 1

    def refusal(self) -> str:
        return f"{self.limit} {self.what} already in flight, the limit ({self.setting})"
