"""The sidecar's outcome cache: what each action came to, keyed by (handoff id, action id).

Delivery is at least once, so an engine sees an action again after a
reconnect or a lost report. The cache answers the repeat without running the
handler twice (which could, say, allocate the same blocks twice).
"""

from __future__ import annotations

from collections import OrderedDict

from handoff_client.model import Outcome


class OutcomeCache:
    """Outcomes grouped by handoff, so a finished handoff is forgotten in one step.

    Bounded by handoffs, least recently used first out: a COMPLETE notice can
    be lost with a dropped stream, and the cache must not grow because of it.
    """

    def __init__(self, max_handoffs: int = 65_536) -> None:
        if max_handoffs < 1:
            raise ValueError("max_handoffs must be >= 1")
        self._max_handoffs = max_handoffs
        self._by_handoff: OrderedDict[str, dict[int, Outcome]] = OrderedDict()

    def get(self, handoff_id: str, action_id: int) -> Outcome | None:
        outcomes = self._by_handoff.get(handoff_id)
        return None if outcomes is None else outcomes.get(action_id)

    def put(self, handoff_id: str, action_id: int, outcome: Outcome) -> None:
        outcomes = self._by_handoff.get(handoff_id)
        if outcomes is None:
            outcomes = self._by_handoff[handoff_id] = {}
            while len(self._by_handoff) > self._max_handoffs:
                self._by_handoff.popitem(last=False)
        else:
            self._by_handoff.move_to_end(handoff_id)
        outcomes[action_id] = outcome

    def forget(self, handoff_id: str) -> None:
        """The handoff completed: none of its actions will be delivered again."""
        self._by_handoff.pop(handoff_id, None)
