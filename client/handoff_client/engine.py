"""The handlers an engine implements for its sidecar (docs/engine-contract.md says what
each must do); :class:`~handoff_client.sidecar.EngineSidecar` runs them."""

from __future__ import annotations

from typing import Protocol

from handoff_client.facts import Facts
from handoff_client.model import Action, Outcome


class SourceEngine(Protocol):
    """A prefill engine's handlers. See docs/engine-contract.md.

    Every handler is idempotent per (handoff id, action id): after a sidecar
    restart under the same incarnation, the server redelivers what was
    outstanding and the handler runs again. Handlers may run concurrently,
    also for one handoff, except that the sidecar never runs a cancel or
    release while an acquiring handler of the same handoff and side runs: it
    cancels that handler first (it sees ``CancelledError`` at its next await),
    so acquiring handlers must be cancellation-safe.
    """

    async def submit_prefill(self, action: Action, facts: Facts) -> Outcome:
        """Run the prefill; answer SUBMITTED, then report SourceHeld when it holds its KV.

        FAILED (``failed(reason)``) if it cannot; that starts cleanup.
        """
        ...

    async def release_source(self, action: Action, facts: Facts) -> Outcome:
        """The destination has the KV: free the prefill's blocks; APPLIED, or NOOP if
        nothing was held. Never FAILED: raise to have it redelivered later."""
        ...

    async def cancel_source(self, action: Action, facts: Facts) -> Outcome:
        """Abort the prefill and free its blocks; APPLIED or NOOP. Never FAILED.

        It may arrive before the SubmitPrefill it cancels (which then never
        runs) or after it. A transfer this engine is pushing for the handoff
        is stopped (or waited for) before the blocks are freed: the
        destination is canceled at the same moment. ``action.origin`` other
        than COORDINATOR marks a cancel the sidecar runs on its own (on a
        COMPLETE notice, the lease, a reconcile, a newer incarnation): it has
        no action id of the handoff's, and its outcome is not reported.
        """
        ...

    async def complete(self, action: Action) -> None:
        """A notice that the handoff is over (``action.completion`` says how, and
        ``action.end_reason`` why); no outcome.

        Anything the engine still held was freed through its cancel handler
        before this runs. It may be lost with a stream.
        """
        ...


class DestinationEngine(Protocol):
    """A decode engine's handlers. See :class:`SourceEngine` and docs/engine-contract.md."""

    async def reserve_destination(self, action: Action, facts: Facts) -> Outcome:
        """Reserve decode memory; answer ACCEPTED, then report DestinationReserved."""
        ...

    async def activate_destination(self, action: Action, facts: Facts) -> Outcome:
        """Start decoding; answer APPLIED. From then on the decode owns the request."""
        ...

    async def cancel_destination(self, action: Action, facts: Facts) -> Outcome:
        """Abort the decode (or the reservation) and free it; APPLIED or NOOP. Never FAILED.

        It may arrive before the action it cancels, or after it, also after
        a successful activation (the frontend canceled during decode). A
        transfer this engine is pulling for the handoff is stopped (or waited
        for) before the memory is freed. ``action.origin`` other than
        COORDINATOR marks a cancel the sidecar runs on its own; its outcome is
        not reported.
        """
        ...

    async def complete(self, action: Action) -> None:
        """A notice that the handoff is over (``action.completion`` says how, and
        ``action.end_reason`` why); no outcome."""
        ...


class Engine(SourceEngine, DestinationEngine, Protocol):
    """Both sides, plus the transfer (run by the handoff's ``transfer_executor``).

    The sidecar names the engine's memory with an incarnation: let it make
    one when it lives and dies with the engine; pass the engine's own
    (``EngineSidecar(..., incarnation=...)``, made once at the engine's start)
    when it runs beside an engine that outlives it. A new incarnation tells
    the server that everything the old one held is gone.

    Optional: ``async def held_handoffs(self) -> Iterable[tuple[str, Role]]``,
    the handoff sides the engine holds now. The sidecar calls it once, at its
    start, so that a sidecar restarted beside an engine that survived it (same
    incarnation) reconciles and leases those sides too. Against a sharded
    coordinator each side is reconciled with every shard, and freed only
    once none of them expects it held.
    """

    async def start_transfer(self, action: Action, facts: Facts) -> Outcome:
        """Start moving the KV (``action.delay_ms`` long); SCHEDULED, then TransferCompleted.

        A cancel of either side stops this transfer (or waits for it) before
        freeing: both sides are canceled at once.
        """
        ...
