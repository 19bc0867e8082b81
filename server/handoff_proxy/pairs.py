"""Which prefill and which decode engine take the next request.

Each side is picked on its own: the engine of that role with the fewest
requests in flight on it now, ties to the one given first on the command
line (deterministic, so a test or an operator can tell where a request
goes). A request is in flight on its prefill engine from the pick until its
prefill leg ends, and on its decode engine from the pick until its decode
leg ends: the decode engine is named in StartHandoff at once, and the
prefill's part is over once it holds the KV. Least-in-flight needs no
feedback from the engines and follows their speed: a slow engine keeps its
requests longer and so gets fewer new ones.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from handoff_proxy.config import EngineAddress


class NoEngineError(Exception):
    """Every engine of a role is at ``--max-in-flight``."""

    def __init__(self, role: str, limit: int) -> None:
        super().__init__(
            f"no {role} engine free: every one has {limit} requests in flight "
            "(--max-in-flight); retry later, or add engines"
        )
        self.role = role


class Engine:
    """One engine and the requests in flight on it."""

    __slots__ = ("address", "in_flight", "role")

    def __init__(self, address: EngineAddress, role: str) -> None:
        self.address = address
        self.role = role  # "prefill" or "decode"
        self.in_flight = 0

    @property
    def engine_id(self) -> str:
        return self.address.engine_id

    @property
    def url(self) -> str:
        return self.address.url


@dataclass(slots=True)
class Lease:
    """One request's claim on one engine, given back once (:meth:`end`)."""

    engine: Engine
    ended: bool = False

    def end(self) -> None:
        if not self.ended:
            self.ended = True
            self.engine.in_flight -= 1


class Pool:
    """The engines of both roles; ``max_in_flight`` 0 means no limit."""

    def __init__(
        self,
        prefill: Sequence[EngineAddress],
        decode: Sequence[EngineAddress],
        max_in_flight: int = 0,
    ) -> None:
        self.prefill = [Engine(address, "prefill") for address in prefill]
        self.decode = [Engine(address, "decode") for address in decode]
        self.max_in_flight = max_in_flight

    def pick(self) -> tuple[Lease, Lease]:
        """The prefill's and the decode's leases for a new request; NoEngineError if none."""
        prefill = self._least(self.prefill, "prefill")
        decode = self._least(self.decode, "decode")
        prefill.in_flight += 1
        decode.in_flight += 1
        return Lease(prefill), Lease(decode)

    def _least(self, engines: list[Engine], role: str) -> Engine:
        # min() keeps the first of equals: ties go to the engine given first.
        best = min(engines, key=lambda engine: engine.in_flight)
        if self.max_in_flight and best.in_flight >= self.max_in_flight:
            raise NoEngineError(role, self.max_in_flight)
        return best
