"""Completed handoffs packed for retention: a few words each.

The registry keeps a completed handoff for a while (late duplicates are
answered, a decode-phase cancel can still reopen it, its id is not reused),
so a retained one should cost little. A completed core's state comes from a
small finite set (stages, settlements, an action counter, a short lifecycle;
the transfer's sizes are forgotten on completion), so few distinct endings
exist: handoffs that ended alike share one :class:`Ending`, and each keeps
only its id and fallback delay besides.

Pure like the core, and built on its public :meth:`Handoff.checkpoint` and
:meth:`Handoff.restore` only.
"""

from __future__ import annotations

from dataclasses import dataclass

from handoff_server.domain.core import Checkpoint, Handoff
from handoff_server.domain.model import Completion, LifecycleEvent, Order, Phase


@dataclass(frozen=True, slots=True)
class Ending:
    """How a handoff ended: all of a completed core but its id and fallback delay."""

    order: Order
    completion: Completion
    lifecycle: tuple[LifecycleEvent, ...]
    state: Checkpoint  # the core's checkpoint, which holds the two above as well


# Each distinct ending once, shared by all that end so, and numbered: a
# packed core names its ending by number, so a retained record can too
# (retained.RetainedRecord).
_ENDINGS: list[Ending] = []
_NUMBERS: dict[Ending, int] = {}


def pack(core: Handoff) -> Completed:
    """This completed handoff in a few words, for as long as it is retained."""
    assert core.phase is Phase.COMPLETE, "only a completed handoff is packed"
    return Completed(
        core.handoff_id,
        core.fallback_transfer_delay_ms,
        ending_number(core.order, core.checkpoint()),
    )


def ending_number(order: Order, state: Checkpoint) -> int:
    """The number of the shared Ending of a completed core of ``order`` whose
    checkpoint is ``state``."""
    phase, completion, lifecycle, *_ = state
    assert phase is Phase.COMPLETE, "only a completed core ends"
    assert completion is not None, "a completed core has its completion"
    made = Ending(order, completion, lifecycle, state)
    number = _NUMBERS.get(made)
    if number is None:
        number = _NUMBERS[made] = len(_ENDINGS)
        _ENDINGS.append(made)
    return number


class Completed:
    """A completed handoff as :func:`pack` packs it: reads like one, and
    :meth:`unpack` gives back exactly the core it was packed from."""

    __slots__ = ("handoff_id", "fallback_transfer_delay_ms", "ending_number")

    def __init__(
        self, handoff_id: str, fallback_transfer_delay_ms: float, ending_number: int
    ) -> None:
        self.handoff_id = handoff_id
        self.fallback_transfer_delay_ms = fallback_transfer_delay_ms
        self.ending_number = ending_number

    @property
    def ending(self) -> Ending:
        return _ENDINGS[self.ending_number]

    @property
    def order(self) -> Order:
        return self.ending.order

    @property
    def phase(self) -> Phase:
        return Phase.COMPLETE

    @property
    def completion(self) -> Completion:
        return self.ending.completion

    @property
    def lifecycle(self) -> tuple[LifecycleEvent, ...]:
        return self.ending.lifecycle

    def snapshot(self) -> tuple[object, ...]:
        """The snapshot of the core it was packed from."""
        return self.unpack().snapshot()

    def unpack(self) -> Handoff:
        core = Handoff(self.handoff_id, self.ending.order, self.fallback_transfer_delay_ms)
        core.restore(self.ending.state)
        return core
