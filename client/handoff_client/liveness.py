"""What a transport heard from its coordinator: the signs of life a lease counts from.

A sidecar's lease (docs/sdk.md) must count from the last message the
coordinator sent, not from when the sidecar noticed its stream was gone: a
black-holed connection can look open for minutes. So each built-in transport
stamps every message it reads (an action, an acknowledgement, a heartbeat)
here, and keeps the headers of its latest subscription, which advertise the
coordinator's incarnation, delivery timeout and heartbeat interval.
"""

from __future__ import annotations

import time
from collections.abc import Iterable

INCARNATION = "handoff-coordinator-incarnation"
DELIVERY_TIMEOUT_MS = "handoff-delivery-timeout-ms"
HEARTBEAT_MS = "handoff-heartbeat-ms"


class Liveness:
    """The last sign of life (``time.monotonic()``) and the subscription's headers."""

    def __init__(self) -> None:
        self.last_heard: float | None = None  # None: never subscribed
        self.headers: dict[str, str] = {}

    def subscribed(self, metadata: Iterable[tuple[str, str | bytes]] | None) -> None:
        """A subscription was confirmed with these response headers."""
        self.headers = {key: value for key, value in metadata or () if isinstance(value, str)}
        self.heard()

    def heard(self) -> None:
        self.last_heard = time.monotonic()

    def _ms(self, key: str) -> float | None:
        try:
            value = int(self.headers[key])
        except (KeyError, ValueError):
            return None
        return value / 1000 if value > 0 else None

    @property
    def delivery_timeout_s(self) -> float | None:
        """The server's delivery timeout, as advertised; None from an older server."""
        return self._ms(DELIVERY_TIMEOUT_MS)

    @property
    def heartbeat_s(self) -> float | None:
        """The server's heartbeat interval; None when it sends no heartbeats."""
        return self._ms(HEARTBEAT_MS)

    @property
    def coordinator_incarnation(self) -> str:
        return self.headers.get(INCARNATION, "unknown")
