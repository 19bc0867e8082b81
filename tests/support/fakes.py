"""The fakes every area shares, one home each: a clock the test moves, a free port."""

from __future__ import annotations

import socket

START = 1_800_000_000.0  # seconds since the epoch: 2027, well clear of any real clock


class FakeClock:
    """A clock that reads ``now`` and moves only when the test says so."""

    def __init__(self, now: float = START) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def free_port() -> int:
    """A loopback port nothing listens on (for a server to come later, or never)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port
